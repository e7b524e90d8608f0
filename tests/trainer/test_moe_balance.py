"""Auxiliary-loss-free balancing, sigmoid gating and group-limited routing.

Routing on 8 fake CPU devices (tests/conftest.py) under expert parallelism, the bias's update
rule step by step, and the bias in training: it balances a real run, resumes bit-exactly, and an
EP=8 run and a one-device run train the same.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from moe_oracle import oracle_routing

from trainer.config import ConfigError, load_config
from trainer.metrics import Reporter
from trainer.moe import MoEBlock, MoEConfig, core, routing
from trainer.moe.experts import ExpertWeights
from trainer.moe.parallel import moe_apply
from trainer.train import RunSpec, run

# The DeepSeek-V3-like routing: 64 experts in 8 groups, top-8 from at most 4 groups.
DEEPSEEK = dict(num_experts=64, top_k=8, d_ff=16, score="sigmoid", route_scale=2.5, balance="bias",
                expert_groups=8, routing_groups_limit=4, capacity_factor=0.0)
TOKENS, D = 16384, 16


@functools.cache
def ep8_mesh():
    return jax.make_mesh((1, 8), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


@functools.cache
def routing_inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (TOKENS, D))
    router = jax.random.normal(keys[1], (D, 64)) * 0.5
    bias = jax.random.normal(keys[2], (64,)) * 0.05
    return x, router, bias


def route_on_ep8(cfg: MoEConfig, x, router, bias):
    """The block's routing (core.token_choice) with the tokens split over the 8 expert devices."""
    mesh = ep8_mesh()

    def local(x_TxD, router, bias):
        logits = core.route_tokens(x_TxD[None], router, cfg, True, None)
        experts, weights, _, _ = core.token_choice(logits, cfg, bias)
        return experts[0], weights[0]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P(), P()), out_specs=(P("expert"), P("expert")))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    return jax.device_get(jax.jit(fn)(put(x, P("expert")), put(router, P()), put(bias, P())))


def groups_reached(experts_TxK, per_group=8):
    return np.array([len(set(row)) for row in (np.asarray(experts_TxK) // per_group).tolist()])


@pytest.mark.compile_bound  # compiling dominates (tests/trainer/conftest.py)
def test_group_limited_sigmoid_routing_on_eight_devices():
    """E=64, k=8, G=8, M=4 over 16,384 tokens: no token reaches more than 4 groups (without the limit
    many do), the weights sum to route_scale, and the selection is the oracle's."""
    x, router, bias = routing_inputs()
    cfg = MoEConfig(**DEEPSEEK)
    experts, weights = route_on_ep8(cfg, x, router, bias)
    reached = groups_reached(experts)
    assert reached.max() == 4 and reached.min() >= 1
    free, _ = route_on_ep8(MoEConfig(**{**DEEPSEEK, "routing_groups_limit": 0}), x, router, bias)
    assert (groups_reached(free) > 4).mean() > 0.1
    np.testing.assert_allclose(weights.sum(-1), 2.5, atol=1e-6)
    _, _, oracle_experts, oracle_weights, _ = oracle_routing(x, router, cfg, bias)
    np.testing.assert_array_equal(np.sort(experts, -1), np.sort(np.asarray(oracle_experts), -1))
    np.testing.assert_allclose(np.sort(weights, -1), np.sort(np.asarray(oracle_weights), -1), rtol=1e-6)
    # The bias picks experts: a different bias changes the selection, the weights stay unbiased scores.
    other, _ = route_on_ep8(cfg, x, router, -bias)
    assert (np.sort(other, -1) != np.sort(experts, -1)).any(axis=1).mean() > 0.1


def test_shifting_every_bias_by_one_constant_changes_neither_selection_nor_weights():
    x, router, bias = routing_inputs()
    cfg = MoEConfig(**DEEPSEEK)
    experts, weights = route_on_ep8(cfg, x, router, bias)
    for shift in (0.25, -1.0):
        shifted_experts, shifted_weights = route_on_ep8(cfg, x, router, bias + shift)
        np.testing.assert_array_equal(shifted_experts, experts)
        np.testing.assert_array_equal(shifted_weights, weights)


@pytest.mark.compile_bound  # compiling dominates (tests/trainer/conftest.py)
def test_the_ep8_block_with_a_shifted_bias_gives_the_same_output():
    """The whole block (dropless exchange, group-limited sigmoid routing) on EP=8."""
    mesh = ep8_mesh()
    cfg = MoEConfig(**DEEPSEEK)
    x, router, bias = routing_inputs()
    keys = jax.random.split(jax.random.key(1), 3)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    w = ExpertWeights(*(put(jax.random.normal(k, s) * 0.2, P("expert"))
                        for k, s in zip(keys, [(64, D, 16), (64, D, 16), (64, 16, D)], strict=True)))
    xs = put(x[:2048].reshape(16, 128, D), P(("data", "expert")))
    apply = jax.jit(lambda b: moe_apply(xs, put(router, P()), w, cfg, mesh, train=True, bias_E=b))
    y, aux = apply(put(bias, P()))
    y_shifted, aux_shifted = apply(put(bias + 0.5, P()))
    np.testing.assert_array_equal(y, y_shifted)
    assert 1.0 < float(aux["groups_per_token"]) <= 4.0
    assert float(aux["groups_per_token"]) == float(aux_shifted["groups_per_token"])


def test_sigmoid_weights_of_one_expert_are_not_normalised():
    """With k = 1 normalising would make the weight 1 and leave the router no gradient."""
    logits_TxE = jnp.array([[0.0, 2.0, 1.0]])
    _, weights, _, _ = routing.top_k_routing(logits_TxE, 1, score="sigmoid", route_scale=2.0)
    np.testing.assert_allclose(weights, [[2.0 / (1.0 + np.exp(-2.0))]], rtol=1e-6)
    _, weights2, _, _ = routing.top_k_routing(logits_TxE, 2, score="sigmoid")
    s = 1 / (1 + np.exp(-np.array([2.0, 1.0])))
    np.testing.assert_allclose(weights2, [s / s.sum()], rtol=1e-6)


def test_group_scores_are_the_sum_of_each_groups_two_best_scores():
    """Group 0 holds the single best expert (0.9) but group 1's two best sum higher (0.7 + 0.6)."""
    select_1xE = jnp.array([[0.9, 0.1, 0.0, 0.7, 0.6, 0.0]])
    masked = routing.limit_to_best_groups(select_1xE, 2, 1)
    np.testing.assert_array_equal(np.isfinite(masked), [[False, False, False, True, True, True]])


@pytest.mark.parametrize("overrides,message", [
    (["moe.expert_groups=8", "moe.routing_groups_limit=1", "moe.top_k=2"], "routing_groups_limit"),
    (["moe.expert_groups=3"], "expert_groups"),
    (["moe.routing_groups_limit=2"], "needs expert_groups"),
    (["moe.balance=loss"], "moe.balance"),
    (["moe.bias_rate=-0.1"], "bias_rate"),
    (["moe.score=sigmoid", "moe.softmax_before_topk=false"], "softmax_before_topk"),
])
def test_config_checks_group_limits_and_balancing_at_load_time(overrides, message):
    """M >= k / (E / G): with 8 groups of one expert, a token needs 2 groups for its top-2."""
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)
    load_config("tiny", ["moe.expert_groups=4", "moe.routing_groups_limit=1"])  # 1 group of 2 holds top-2


# ----------------------------------------------------------------------------- the bias step by step

SKEWED = dict(num_experts=16, top_k=2, d_ff=8, capacity_factor=0.0, balance="bias", block_rows=8, score="sigmoid")


def skewed_block(rate):
    cfg = MoEConfig(**SKEWED, bias_rate=rate)
    block = MoEBlock(cfg, D, rngs=nnx.Rngs(0))
    # Feature 0 is always 1 and raises experts 0-3's logits by 1.5: a router frozen far from balance.
    block.router[...] = block.router[...].at[0].set(jnp.where(jnp.arange(16) < 4, 1.5, 0.0))
    return cfg, block


def skewed_tokens(step, num=4096):
    """Fresh tokens every step, from one distribution."""
    return jax.random.normal(jax.random.key(100 + step), (num // 64, 64, D)).at[..., 0].set(1.0)


@functools.cache
def balance_step():
    return nnx.jit(lambda blk, x: blk(x, train=True)[1])


@pytest.mark.compile_bound  # compiling dominates (tests/trainer/conftest.py)
def test_the_bias_alone_balances_a_frozen_skewed_router():
    """Nothing but the bias moves (no optimizer): max/mean load from >= 3 to <= 1.15, 4,096 tokens a step."""
    cfg, block = skewed_block(0.003)
    loads = []
    for step in range(120):
        aux = balance_step()(block, skewed_tokens(step))
        loads.append(float(aux["load_max_over_mean"]))
    assert loads[0] >= 3.0, loads[0]
    assert np.mean(loads[-20:]) <= 1.15, loads[-20:]
    assert max(loads[-20:]) <= 1.2, loads[-20:]


@pytest.mark.compile_bound  # compiling dominates (tests/trainer/conftest.py)
def test_the_bias_moves_by_exactly_minus_rate_zero_or_plus_rate_towards_the_mean_load():
    """Each step's direction, recomputed by the oracle from that step's tokens and the old bias:
    up for an expert under the mean load, down over it, unchanged at it. rate 0: bit-identical."""
    rate = np.float32(0.01)
    cfg, block = skewed_block(float(rate))
    moved = set()
    for step in range(12):
        old = np.asarray(block.expert_bias[...])
        x = skewed_tokens(step, 1024)
        balance_step()(block, x)
        _, _, experts, _, _ = oracle_routing(x.reshape(-1, D), block.router[...], cfg, jnp.asarray(old))
        counts = np.bincount(np.asarray(experts).ravel(), minlength=16)
        direction = np.sign(counts.sum() - 16 * counts).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(block.expert_bias[...]), old + rate * direction)
        moved |= set(direction.tolist())
    assert moved == {-1.0, 1.0} or moved == {-1.0, 0.0, 1.0}
    _, frozen = skewed_block(0.0)
    start = np.asarray(frozen.expert_bias[...]).copy()
    for step in range(10):
        balance_step()(frozen, skewed_tokens(step, 1024))
    assert np.asarray(frozen.expert_bias[...]).tobytes() == start.tobytes()


def test_evaluation_leaves_the_bias_alone():
    _, block = skewed_block(0.01)
    nnx.jit(lambda blk, x: blk(x, train=False)[1])(block, skewed_tokens(0, 1024))
    assert not np.asarray(block.expert_bias[...]).any()


def test_the_bias_is_state_not_a_parameter():
    _, block = skewed_block(0.01)
    assert "expert_bias" not in nnx.state(block, nnx.Param)
    assert not hasattr(MoEBlock(MoEConfig(**{**SKEWED, "balance": "aux_loss"}), D, rngs=nnx.Rngs(0)), "expert_bias")


# ----------------------------------------------------------------------------- the bias in training

BIAS_RUN = ["moe.capacity_factor=0", "moe.balance=bias", "moe.num_experts=16", "moe.top_k=2"]
# The balancing run's data and schedule (150 steps). The resume test trains the same model (its bias at rate
# 1e-3) so that its train step is the same program: the run's compilation cache (tests/conftest.py) holds it
# when that test comes, and compiling it optimised is most of either test's time.
BALANCED = BIAS_RUN + ["data.synthetic_vocab=256", "data.synthetic_branching=16", "optim.decay_steps=150"]


def train(tmp_path, name, steps, overrides, devices=1, expert=1, **spec):
    path = tmp_path / f"{name}.jsonl"
    reporter = Reporter(str(path))
    try:
        result = run(RunSpec(config=load_config("tiny", overrides), steps=steps, num_devices=devices,
                             mesh_shape={"data": devices // expert, "expert": expert}, **spec), reporter)
    finally:
        reporter.close()
    assert result.step == steps
    return [json.loads(line) for line in path.read_text().splitlines()]


def restored_state(output_dir, step):
    return ocp.StandardCheckpointer().restore(os.path.join(output_dir, "checkpoints", str(step), "state"))


def test_bias_balancing_evens_the_load_of_a_real_run(tmp_path):
    """256 states, 16 successors, E=16, k=2, dropless, 150 steps: max/mean load (mean of the last 20
    steps, every MoE layer) <= 1.3 with rate 1e-3, clearly below the same run at rate 0.

    150 steps rather than 300: the bias has settled by then (measured 1.18 and 1.16 at rate 1e-3 against
    1.46 and 1.48 at rate 0, as 300 steps gave 1.19 against 1.49), so both bounds keep the margins they
    had; at 100 steps the gap (0.23) is under the 0.25 asserted, so the second bound still fails a bias
    that balances too slowly."""
    steps = 150
    ends = {}
    for rate in (1e-3, 0.0):
        rows = train(tmp_path, f"rate{rate}", steps, BALANCED + [f"moe.bias_rate={rate}"])
        ends[rate] = [np.mean([r[f"moe.{i}.load_max_over_mean"] for r in rows[-20:]]) for i in (0, 1)]
        assert rows[-1]["aux_loss"] == 0.0  # balance: bias has no auxiliary loss
    assert max(ends[1e-3]) <= 1.3, ends
    assert max(ends[1e-3]) < max(ends[0.0]) - 0.25, ends  # measured: 1.18 against 1.48 (float rounding moves it)


def test_forty_steps_equal_twenty_a_restore_and_twenty(tmp_path):
    """Loss, parameters and bias bit-exact. The model, data and schedule are the balancing test's run at rate
    1e-3 (BALANCED): its train step, compiled once."""
    overrides = BALANCED + ["train.checkpoint_every=20", "moe.bias_rate=0.001"]
    straight = train(tmp_path, "a", 40, overrides, output_dir=str(tmp_path / "a"))
    first = train(tmp_path, "b1", 20, overrides, output_dir=str(tmp_path / "b"))
    second = train(tmp_path, "b2", 40, overrides, output_dir=str(tmp_path / "b"))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    a, b = restored_state(tmp_path / "a", 40), restored_state(tmp_path / "b", 40)
    assert a["params"].keys() == b["params"].keys() and set(a["moe_bias"]) == {
        "stacks.0.0.ffn.expert_bias"}  # both layers' [2, E]
    for part in ("params", "moe_bias"):
        for name in a[part]:
            assert np.asarray(a[part][name]).tobytes() == np.asarray(b[part][name]).tobytes(), name
    moved = np.abs(a["moe_bias"]["stacks.0.0.ffn.expert_bias"]).max()
    assert moved > 0.01  # it moved: 40 steps of 1e-3, ten more one way than the other (measured 0.019)


# An expert-parallel run steps the bias exactly as one device does: tests/trainer/test_tensor_parallel.py, whose
# deepseek-tiny cases (bias balancing, capacity and dropless, on data=2,expert=4, expert=2,model=4 and the
# others) compare each mesh's bias after 20 steps with the one-device run's, bit for bit.


def test_deepseek_tiny_trains_to_the_entropy_floor_as_tiny_does(tmp_path):
    """The named config: sigmoid gating, bias balancing, a shared expert, 2 of 4 groups, dropless. 60 steps: the
    mean loss of the last ten is within 0.05 of the floor by then (measured: +0.046 at 60 steps, +0.018 at 120,
    +0.229 at 20), well inside the 0.15 asserted."""
    cfg = load_config("deepseek-tiny")
    assert (cfg.moe.score, cfg.moe.balance, cfg.moe.num_shared_experts, cfg.moe.routing_groups_limit) == \
        ("sigmoid", "bias", 1, 2)
    path = tmp_path / "m.jsonl"
    reporter = Reporter(str(path))
    try:
        run(RunSpec(config=cfg, steps=60, num_devices=1, mesh_shape={"data": 1, "expert": 1}), reporter)
    finally:
        reporter.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    floor = rows[-1]["entropy_floor"]
    final = np.mean([r["loss"] for r in rows[-10:]])
    assert rows[0]["loss"] > floor + 3
    assert floor - 0.1 < final < floor + 0.15, (final, floor)
    assert all(r[f"moe.{i}.groups_per_token"] <= 2.0 for r in rows for i in (0, 1))


@pytest.mark.compile_bound  # compiling dominates (tests/trainer/conftest.py)
def test_rematerialised_blocks_step_the_bias_as_plain_ones_do():
    """nnx.remat recomputes the block in the backward pass; the stepped bias still comes out of it."""
    from trainer import sharding
    from trainer.data import DataIterator, make_source
    from trainer.step import build_trainer
    from trainer.train import global_batch

    states = []
    for remat in ("false", "true"):
        cfg = load_config("tiny", BIAS_RUN + ["moe.bias_rate=0.01", f"model.remat={remat}"])
        trainer = build_trainer(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]), 4)
        data = DataIterator(make_source(cfg, cfg.train.seed), cfg.data.global_batch_size, cfg.model.vocab_size)
        state = trainer.initial_state()
        for _ in range(2):
            state, _ = trainer.step_fn(state, global_batch(trainer, next(data)))
        states.append(jax.device_get(state["moe_bias"]))
    for name in states[0]:
        assert np.abs(states[0][name]).max() > 0
        np.testing.assert_array_equal(states[1][name], states[0][name], err_msg=name)
