"""Routing, capacity and the aux losses as pure functions, on hand-computed inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_oracle import oracle_keep

from trainer.moe import MoEConfig, dispatch, routing
from trainer.moe import capacity as cap


def test_top1_picks_the_argmax_and_weights_are_its_probability_renormalised_to_one():
    logits_TxE = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    experts, weights, priority, probs = routing.top_k_routing(logits_TxE, 1)
    np.testing.assert_array_equal(experts, [[1], [0]])
    np.testing.assert_allclose(weights, [[1.0], [1.0]])
    np.testing.assert_allclose(priority[:, 0], probs.max(-1), rtol=1e-6)


def test_top1_without_renormalisation_keeps_the_raw_probability_as_in_switch():
    logits_TxE = jnp.array([[0.0, 2.0, 1.0]])
    _, weights, _, _ = routing.top_k_routing(logits_TxE, 1, renormalize=False)
    expected = math.exp(2) / (1 + math.exp(2) + math.exp(1))
    np.testing.assert_allclose(weights, [[expected]], rtol=1e-6)


def test_top2_softmax_before_topk_renormalises_the_two_chosen_probabilities():
    logits_TxE = jnp.log(jnp.array([[0.1, 0.5, 0.3, 0.1]]))
    experts, weights, priority, _ = routing.top_k_routing(logits_TxE, 2)
    np.testing.assert_array_equal(experts, [[1, 2]])
    np.testing.assert_allclose(priority, [[0.5, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(weights, [[0.5 / 0.8, 0.3 / 0.8]], rtol=1e-6)


def test_top2_softmax_after_topk_is_a_softmax_over_the_chosen_logits():
    logits_TxE = jnp.array([[1.0, 4.0, 3.0, -2.0]])
    experts, weights, _, _ = routing.top_k_routing(logits_TxE, 2, softmax_before_topk=False)
    np.testing.assert_array_equal(experts, [[1, 2]])
    e = math.exp(1.0)
    np.testing.assert_allclose(weights, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-6)


def test_router_logits_are_float32_whatever_the_input_dtype():
    x = jnp.ones((2, 4), jnp.bfloat16)
    assert routing.router_logits(x, jnp.ones((4, 3))).dtype == jnp.float32


def test_balancing_loss_equals_num_experts_times_sum_of_f_times_p_by_hand():
    # 4 tokens, 2 experts, top-1: experts chosen 0, 0, 0, 1 -> f = (3/4, 1/4).
    probs_TxE = jnp.array([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    experts_TxK = jnp.array([[0], [0], [0], [1]])
    counts, prob_sums = routing.balance_stats(experts_TxK, probs_TxE)
    loss = routing.load_balancing_loss(counts, prob_sums, jnp.float32(4))
    p = np.array([0.9 + 0.6 + 0.7 + 0.2, 0.1 + 0.4 + 0.3 + 0.8]) / 4
    np.testing.assert_allclose(loss, 2 * (0.75 * p[0] + 0.25 * p[1]), rtol=1e-6)


def test_balancing_loss_is_one_for_a_uniform_router():
    probs_TxE = jnp.full((4, 4), 0.25)
    experts_TxK = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]])
    counts, prob_sums = routing.balance_stats(experts_TxK, probs_TxE)
    np.testing.assert_allclose(routing.load_balancing_loss(counts, prob_sums, jnp.float32(4)), 1.0, rtol=1e-6)


def test_z_loss_is_the_mean_squared_logsumexp_by_hand():
    logits_TxE = jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    np.testing.assert_allclose(routing.router_z_loss(logits_TxE), expected, rtol=1e-6)


def test_jitter_scales_inputs_within_one_plus_minus_eps_and_is_off_at_zero():
    x = jnp.ones((64, 8))
    jittered = routing.multiplicative_jitter(x, jax.random.key(0), 0.1)
    assert float(jittered.min()) >= 0.9 and float(jittered.max()) <= 1.1
    assert float(jnp.std(jittered)) > 0


def test_expert_choice_gives_every_expert_exactly_its_capacity_of_distinct_tokens():
    logits_TxE = jax.random.normal(jax.random.key(0), (32, 4))
    tokens_ExC, weights_ExC, probs_TxE = routing.expert_choice_routing(logits_TxE, 6)
    assert tokens_ExC.shape == (4, 6)
    for e in range(4):
        chosen = np.asarray(tokens_ExC[e])
        assert len(set(chosen.tolist())) == 6
        best = np.argsort(-np.asarray(probs_TxE[:, e]), kind="stable")[:6]
        np.testing.assert_array_equal(np.sort(chosen), np.sort(best))
    np.testing.assert_allclose(weights_ExC, jnp.take_along_axis(probs_TxE.T, tokens_ExC, axis=1))


@pytest.mark.parametrize(
    "tokens,k,factor,experts,minimum,expected",
    [
        (2048, 2, 1.25, 16, 4, 320),  # ceil(2048 * 2 * 1.25 / 16)
        (100, 1, 1.0, 8, 4, 13),  # ceil(12.5)
        (16, 1, 0.1, 8, 4, 4),  # the minimum wins
        (8, 2, 8.0, 2, 4, 8),  # never more than the tokens
    ],
)
def test_capacity_formula(tokens, k, factor, experts, minimum, expected):
    assert cap.expert_capacity(tokens, k, factor, experts, minimum) == expected


# Hand-built routing for the priority orders: 4 tokens, 2 experts, top-2 (every
# token uses both experts), capacity 3, so each expert drops one of its 4 assignments.
EXPERTS_TxK = jnp.array([[0, 1], [1, 0], [0, 1], [1, 0]])
PRIORITY_TxK = jnp.array([[0.6, 0.4], [0.9, 0.1], [0.55, 0.45], [0.7, 0.3]])


def test_position_priority_serves_first_choices_then_second_choices_in_token_order():
    slot_N, keep_N = cap.assign_slots(EXPERTS_TxK, PRIORITY_TxK, 2, 3, "position")
    keep_TxK = np.asarray(keep_N).reshape(2, 4).T
    # Expert 0 sees first choices of tokens 0, 2, then second choices of 1, 3: token 3's is dropped.
    # Expert 1 sees first choices of tokens 1, 3, then second choices of 0, 2: token 2's is dropped.
    np.testing.assert_array_equal(keep_TxK, [[1, 1], [1, 1], [1, 0], [1, 0]])
    np.testing.assert_array_equal(np.asarray(slot_N).reshape(2, 4).T, [[0, 5], [3, 2], [1, 6], [4, 6]])
    assert 1 - keep_TxK.mean() == 0.25


def test_probability_priority_drops_the_least_probable_assignment_of_each_expert():
    _, keep_N = cap.assign_slots(EXPERTS_TxK, PRIORITY_TxK, 2, 3, "probability")
    keep_TxK = np.asarray(keep_N).reshape(2, 4).T
    # Expert 0 probabilities: t0 .6, t1 .1, t2 .55, t3 .3 -> t1 dropped; expert 1: t0 .4, t1 .9,
    # t2 .45, t3 .7 -> t0 dropped.
    np.testing.assert_array_equal(keep_TxK, [[1, 0], [1, 0], [1, 1], [1, 1]])


_assign_slots = jax.jit(cap.assign_slots, static_argnums=(2, 3, 4))


@settings(max_examples=8, deadline=None)
@given(
    st.sampled_from([(16, 1, 4), (16, 2, 4), (12, 3, 5)]), st.integers(1, 6),
    st.sampled_from(["position", "probability"]), st.integers(0, 2**31 - 1),
)
def test_slots_match_the_naive_loop_and_never_collide(shape, capacity, priority, seed):
    tokens, k, experts = shape
    key_e, key_p = jax.random.split(jax.random.key(seed))
    experts_TxK = jnp.argsort(jax.random.uniform(key_e, (tokens, experts)), axis=-1)[:, :k].astype(jnp.int32)
    priority_TxK = jax.random.uniform(key_p, (tokens, k))
    slot_N, keep_N = _assign_slots(experts_TxK, priority_TxK, experts, capacity, priority)
    cfg = MoEConfig(num_experts=experts, top_k=k, drop_priority=priority)
    expected = oracle_keep(experts_TxK, priority_TxK, cfg, 1, capacity)
    np.testing.assert_array_equal(np.asarray(keep_N).reshape(k, tokens).T, expected)
    kept_slots = np.asarray(slot_N)[np.asarray(keep_N)]
    assert len(set(kept_slots.tolist())) == len(kept_slots)
    assert np.all(kept_slots // capacity == np.asarray(cap.flatten_choices(experts_TxK))[np.asarray(keep_N)])


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 0.25, -0.25, 1e-30, -1e-30, 3.5, -3.5, np.inf, -np.inf, np.nan, -np.nan,
                                 1e30, -1e30]), min_size=1, max_size=40))
def test_the_integer_sort_keys_order_floats_as_the_sort_does(values):
    """ordered_int's keys, the index a last key, give the stable order lax.sort gives the floats themselves:
    -0 tied with 0, every NaN tied with every other, after +inf."""
    x = jnp.asarray(values, jnp.float32)
    iota = jnp.arange(x.shape[0], dtype=jnp.int32)
    want = jax.lax.sort((x, iota), num_keys=1, is_stable=True)[1]
    got = jax.lax.sort((cap.ordered_int(x), iota), num_keys=2, is_stable=False)[1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tied_priorities_keep_the_assignment_order():
    """Equal probabilities: the earlier assignment (choice-major: first choices in token order, then second
    choices) keeps its slot, as the naive loop has it."""
    experts_TxK = jnp.asarray([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]], jnp.int32)
    priority_TxK = jnp.full((5, 2), 0.5, jnp.float32)
    _, keep_N = _assign_slots(experts_TxK, priority_TxK, 2, 3, "probability")
    cfg = MoEConfig(num_experts=2, top_k=2, drop_priority="probability")
    np.testing.assert_array_equal(np.asarray(keep_N).reshape(2, 5).T,
                                  oracle_keep(experts_TxK, priority_TxK, cfg, 1, 3))


def test_dispatch_and_combine_move_rows_without_one_hot_and_match_the_gshard_einsum():
    x_TxD = jax.random.normal(jax.random.key(1), (4, 3))
    slot_N, keep_N = cap.assign_slots(EXPERTS_TxK, PRIORITY_TxK, 2, 3, "position")
    gate_N = cap.flatten_choices(PRIORITY_TxK) * keep_N
    buf_SxD = dispatch.dispatch_to_slots(x_TxD, slot_N, 6, 2)
    dispatch_TxExC, combine_TxExC = dispatch.einsum_dispatch_combine_tensors(slot_N, gate_N, 4, 2, 3, 2)
    np.testing.assert_allclose(buf_SxD.reshape(2, 3, 3), dispatch.einsum_dispatch(x_TxD, dispatch_TxExC), rtol=1e-6)
    out_SxD = buf_SxD * 2.0
    y = dispatch.combine_from_slots(out_SxD, slot_N, gate_N, 2)
    np.testing.assert_allclose(y, dispatch.einsum_combine(out_SxD.reshape(2, 3, 3), combine_TxExC), rtol=1e-6)


def test_take_rows_gradient_is_the_gather_transpose():
    x = jax.random.normal(jax.random.key(2), (5, 3))
    index = jnp.array([4, 0, 5, 0, 2])  # 5 reads the zero row; row 0 is read twice
    inverse = jnp.array([[1, 5, 4, 5, 0], [3, 5, 5, 5, 5]])
    ct = jax.random.normal(jax.random.key(3), (5, 3))
    fast = jax.grad(lambda x: jnp.sum(dispatch.take_rows(x, index, inverse) * ct))(x)
    plain = jax.grad(lambda x: jnp.sum(dispatch.gather_rows(x, index) * ct))(x)
    np.testing.assert_allclose(fast, plain, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=80), st.lists(st.integers(-5, 900), min_size=1, max_size=30))
def test_searchsorted_right_counts_the_sorted_values_at_most_each_query(counts, queries):
    """Both of its methods (all-pairs comparison up to 64 values, binary search above) agree with numpy."""
    ends = np.cumsum(counts)
    got = dispatch.searchsorted_right(jnp.asarray(ends, jnp.int32), jnp.asarray(queries, jnp.int32))
    np.testing.assert_array_equal(got, np.searchsorted(ends, queries, side="right"))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 80), st.integers(0, 2**31 - 1))
def test_lookup_reads_a_table_as_a_gather_does(size, seed):
    """Small tables by comparison, large ones by a gather: both table[index], 0 past the table's end."""
    rng = np.random.default_rng(seed)
    table = rng.integers(-1000, 1000, size).astype(np.int32)
    index = rng.integers(0, size + 2, 50).astype(np.int32)
    expected = np.where(index < size, table[np.minimum(index, size - 1)], 0)
    np.testing.assert_array_equal(dispatch.lookup(jnp.asarray(table), jnp.asarray(index)), expected)


@pytest.mark.parametrize("experts,block_rows", [(4, 8), (16, 8), (16, 64)])
def test_an_assignments_row_from_its_expert_is_the_row_through_the_sorted_order(experts, block_rows):
    """The dropless layout's row of each assignment, from its expert's offset (no permutation gathered), is the
    row aligned_layout gives its place in the expert-sorted order; skewed routing leaves some experts empty."""
    rng = np.random.default_rng(experts + block_rows)
    experts_N = jnp.asarray(np.minimum(rng.geometric(0.3, 300) - 1, experts - 1), jnp.int32)
    order_N, counts_E = dispatch.sort_by_expert(experts_N, experts)
    rank_N = dispatch.inverse_index(order_N, order_N.shape[0])
    dest_1xN, _ = dispatch.aligned_layout(counts_E[None], 300, block_rows)
    direct_N = rank_N + dispatch.lookup(dispatch.aligned_offsets(counts_E[None], block_rows)[0], experts_N)
    np.testing.assert_array_equal(direct_N, dest_1xN[0][rank_N])
    assert np.any(np.asarray(counts_E) == 0) or experts == 4


def test_spans_cover_every_experts_blocks_once_largest_first():
    """Each expert's blocks run as full spans of SPAN_BLOCKS blocks, then its remainder's binary digits,
    largest first; every block in use lies in exactly one span, of its own expert."""
    counts_SxG = jnp.array([[0, 3, 40, 9, 1], [0, 70, 2, 8, 0], [0, 7, 30, 0, 8]], jnp.int32)
    dest_SxR, blocks = dispatch.aligned_layout(counts_SxG, 80, 8)
    sizes = dispatch.span_sizes()
    slots = dispatch.span_slots(blocks.group_NB.shape[0], counts_SxG.shape[1])
    group_NB, starts, groups = (np.asarray(a) for a in (blocks.group_NB, blocks.span_start_NS, blocks.span_group_NS))
    cover = np.zeros(group_NB.shape[0], int)
    spans_of = {g: [] for g in range(counts_SxG.shape[1])}
    for c, size in enumerate(sizes):
        first = sum(slots[:c])
        for i in range(first, first + int(blocks.span_count_C[c])):
            cover[starts[i]:starts[i] + size] += 1
            assert np.all(group_NB[starts[i]:starts[i] + size] == groups[i])
            spans_of[int(groups[i])].append((int(starts[i]), size))
    assert np.all(cover[:int(blocks.num_blocks)] == 1) and np.all(cover[int(blocks.num_blocks):] == 0)
    for g, spans in spans_of.items():
        n = -(-int(counts_SxG[:, g].sum()) // 8)
        assert [size for _, size in sorted(spans)] == [sizes[0]] * (n // sizes[0]) + [
            s for s in sizes[1:] if n % sizes[0] & s]
    # Every row lands in its expert's blocks, each buffer row at most once.
    rows = np.asarray(dest_SxR)[np.arange(80)[None] < np.asarray(counts_SxG).sum(1)[:, None]]
    assert len(set(rows.tolist())) == len(rows) == int(counts_SxG.sum())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"top_k": 0}, "top_k"),
        ({"num_experts": 4, "top_k": 5}, "top_k"),
        ({"routing": "hash"}, "routing"),
        ({"drop_priority": "random"}, "drop_priority"),
        ({"jitter": 1.5}, "jitter"),
        ({"routing": "expert_choice", "capacity_factor": 0.0}, "expert_choice"),
        ({"min_capacity": -1}, "min_capacity"),
    ],
)
def test_config_rejects_bad_values_with_a_message_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


def test_dropless_config_stays_dropless_in_evaluation():
    cfg = MoEConfig(capacity_factor=0.0)
    assert cfg.is_dropless(True) and cfg.is_dropless(False)
    assert not MoEConfig().is_dropless(True)


def test_groups_kept_by_their_best_score_or_by_their_top_two():
    """DeepSeek-V3 scores a group by the sum of its two best, V2 (group_score max) by its best: here they
    keep different groups, and the token's experts come from the kept group only."""
    probs_1xE = jnp.log(jnp.array([[0.40, 0.01, 0.30, 0.29]]))  # softmax gives these back
    top2, _, _, _ = routing.top_k_routing(probs_1xE, 2, renormalize=False, expert_groups=2, groups_limit=1)
    best, weights, _, _ = routing.top_k_routing(probs_1xE, 2, renormalize=False, expert_groups=2, groups_limit=1,
                                                group_score="max", route_scale=1.5)
    assert sorted(np.asarray(top2)[0].tolist()) == [2, 3]  # 0.30 + 0.29 > 0.40 + 0.01
    assert sorted(np.asarray(best)[0].tolist()) == [0, 1]  # 0.40 > 0.30
    np.testing.assert_allclose(np.sort(np.asarray(weights)[0]), [0.015, 0.6], rtol=1e-5)  # unnormalised x 1.5
