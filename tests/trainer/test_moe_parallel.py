"""The expert-parallel block against the naive per-expert oracle: forward, gradients, drops.

Every case runs without a mesh, on mesh expert=8 and on mesh data=2 x expert=4
(8 fake CPU devices, tests/conftest.py). Capacity is counted per routing group
(8 groups of 16 tokens everywhere), so all three layouts and the oracle must
keep and drop exactly the same assignments.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from moe_oracle import oracle_aux, oracle_capacity, oracle_keep, oracle_moe, oracle_routing, ragged_all_to_all_on_cpu

from trainer.moe import MoEConfig, core, exchange
from trainer.moe.exchange import Chunks, padded_chunks
from trainer.moe.experts import ExpertWeights
from trainer.moe.parallel import make_topology, moe_apply, moe_groups

B, L, D, F, E, GROUPS = 16, 8, 16, 32, 8, 8
MESHES = {"none": None, "expert8": (1, 8), "data2_expert4": (2, 4),
          # Tensor parallelism: each expert's hidden dimension split over `model` as well.
          "expert2_model4": (1, 2, 4), "data2_model4": (2, 1, 4), "data2_expert2_model2": (2, 2, 2)}
CASES = {
    "top1": dict(top_k=1, capacity_factor=4.0),
    "top2": dict(top_k=2, capacity_factor=4.0),
    "top2_tight_probability": dict(top_k=2, capacity_factor=1.0, drop_priority="probability"),
    "top1_tight_position": dict(top_k=1, capacity_factor=1.0, drop_priority="position"),
    "top2_dropless": dict(top_k=2, capacity_factor=0.0, block_rows=8),
    "top2_dropless_ragged_dot": dict(top_k=2, capacity_factor=0.0, block_rows=8, grouped_matmul="ragged_dot"),
    # DeepSeek-V3 routing: sigmoid scores, a selection bias, at most 2 of 4 groups of 2 experts.
    "top2_sigmoid_bias_groups_tight": dict(top_k=2, capacity_factor=1.0, score="sigmoid", route_scale=2.5,
                                           balance="bias", expert_groups=4, routing_groups_limit=2),
    "top2_sigmoid_bias_groups_dropless": dict(top_k=2, capacity_factor=0.0, block_rows=8, score="sigmoid",
                                              route_scale=2.5, balance="both", expert_groups=4,
                                              routing_groups_limit=2),
    # The once-per-device exchange; with top-4 of 8 experts on 4 devices most tokens share a device.
    "top2_dropless_once": dict(top_k=2, capacity_factor=0.0, block_rows=8, exchange_rows="device"),
    "top4_dropless_once_groups": dict(top_k=4, capacity_factor=0.0, block_rows=8, exchange_rows="device",
                                      score="sigmoid", balance="both", expert_groups=4, routing_groups_limit=2),
}
# Every case without a mesh and on expert=8; on data=2 x expert=4 the top-2 cases (top-1
# shares all of their code but the k). The ragged_dot grouped matmul is the TPU/GPU choice.
PAIRS = [(c, m) for c in CASES for m in MESHES if "model" not in m
         and (m != "data2_expert4" or c.startswith("top2_") or c == "top2" or "once" in c)]
PAIRS.remove(("top2_dropless_ragged_dot", "data2_expert4"))
# With a model axis: capacity (tight: drops), dropless once per assignment and once per device, group-limited
# sigmoid routing with the bias, each on one of the three meshes.
PAIRS += [("top2_tight_probability", "data2_model4"), ("top2_dropless", "expert2_model4"),
          ("top4_dropless_once_groups", "data2_expert2_model2"), ("top2_sigmoid_bias_groups_tight", "expert2_model4")]
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def make_config(case: str) -> MoEConfig:
    return MoEConfig(num_experts=E, d_ff=F, min_capacity=1, routing_groups=GROUPS, **CASES[case])


@functools.cache
def make_mesh(name: str):
    shape = MESHES[name]
    axes = ("data", "expert", "model")[: len(shape or ())]
    return None if shape is None else jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


@functools.cache
def inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    params = {
        "router": jax.random.normal(keys[0], (D, E)) * 0.5,
        "w_in": jax.random.normal(keys[1], (E, D, F)) * D**-0.5,
        "w_gate": jax.random.normal(keys[2], (E, D, F)) * D**-0.5,
        "w_out": jax.random.normal(keys[3], (E, F, D)) * F**-0.5,
    }
    x = jax.random.normal(keys[4], (B, L, D))
    ct = jax.random.normal(keys[5], (B, L, D))
    return x, params, ct


def case_inputs(case: str):
    """inputs(), with a balancing bias (large enough to change the selection) when the case routes with one."""
    x, params, ct = inputs()
    if make_config(case).uses_bias:
        params = {**params, "bias": jnp.linspace(-0.2, 0.2, E)[::-1]}
    return x, params, ct


def place(mesh, x, params):
    """Lays inputs out as the trainer does: batch over (data, expert), experts over expert, their hidden
    dimension over model."""
    if mesh is None:
        return x, params
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    hidden = "model" if "model" in mesh.axis_names else None
    specs = {"w_in": P("expert", None, hidden), "w_gate": P("expert", None, hidden), "w_out": P("expert", hidden)}
    experts = {n: put(params[n], specs[n]) for n in ("w_in", "w_gate", "w_out")}
    replicated = {n: put(params[n], P()) for n in ("router", "bias") if n in params}
    return put(x, P(("data", "expert"))), {**replicated, **experts}


def block_loss(x, params, ct, cfg, mesh):
    """A scalar that reaches every output and both losses, so gradients cover the router too."""
    w = ExpertWeights(params["w_in"], params["w_gate"], params["w_out"])
    y, aux = moe_apply(x, params["router"], w, cfg, mesh, train=True, bias_E=params.get("bias"))
    loss = jnp.sum(y.astype(jnp.float32) * ct) + aux["aux_loss"] + aux["z_loss"]
    return loss, (y, aux)


# The block's gradient jitted once for the module: a config, mesh and input layout is traced and compiled once,
# whichever test asks first (the float32 matrix below, the skewed and balanced routings, the all-gathered counts),
# where a fresh jax.jit(jax.grad(...)) per call traced and lowered it again. One per core.MERGED_COUNTS_LIMIT, which
# the block reads as it is traced: a test that lowers the limit gets a program traced under its limit.
_block_grads = {}


def block_grad(x, params, ct, cfg, mesh):
    """((dx, dparams), (y, aux)) of block_loss."""
    if core.MERGED_COUNTS_LIMIT not in _block_grads:
        _block_grads[core.MERGED_COUNTS_LIMIT] = jax.jit(jax.grad(block_loss, argnums=(0, 1), has_aux=True),
                                                         static_argnums=(3, 4))
    return _block_grads[core.MERGED_COUNTS_LIMIT](x, params, ct, cfg, mesh)


@functools.cache
def run_block(case: str, mesh_name: str):
    cfg, mesh = make_config(case), make_mesh(mesh_name)
    x, params, ct = case_inputs(case)
    x, params = place(mesh, x, params)
    (dx, dparams), (y, aux) = block_grad(x, params, ct, cfg, mesh)
    return jax.device_get((y, aux, dx, dparams))


def oracle_loss(x, params, ct, keep_TxK, cfg):
    """block_loss's scalar from the oracle: `keep_TxK` (oracle_keep's, all True where nothing drops) masks the
    dropped assignments."""
    y = oracle_moe(x.reshape(-1, D), params, cfg, keep_TxK).reshape(B, L, D)
    aux = oracle_aux(x.reshape(-1, D), params, cfg)
    return jnp.sum(y * ct) + aux["aux_loss"] + aux["z_loss"], (y, aux)


# Jitted once for the module (the oracle runs op by op otherwise): one program per config, shared by every test that
# asks for that config's reference.
oracle_grad = jax.jit(jax.grad(oracle_loss, argnums=(0, 1), has_aux=True), static_argnums=(4,))


@functools.cache
def run_oracle(case: str):
    cfg = make_config(case)
    x, params, ct = case_inputs(case)
    x_TxD = x.reshape(-1, D)
    _, _, experts, _, priority = oracle_routing(x_TxD, params["router"], cfg, params.get("bias"))
    keep = oracle_keep(experts, priority, cfg, GROUPS, oracle_capacity(B * L // GROUPS, cfg, True))
    (dx, dparams), (y, aux) = oracle_grad(x, params, ct, keep, cfg)
    return y, aux, dx, dparams, keep


@pytest.mark.parametrize("case,mesh_name", PAIRS)
def test_forward_and_gradients_equal_the_oracle_in_float32(case, mesh_name):
    y, aux, dx, dparams = run_block(case, mesh_name)
    y_ref, aux_ref, dx_ref, dparams_ref, _ = run_oracle(case)
    np.testing.assert_allclose(y, y_ref, **F32_TOL)
    np.testing.assert_allclose(dx, dx_ref, **F32_TOL)
    for name in ("router", "w_in", "w_gate", "w_out"):
        np.testing.assert_allclose(dparams[name], dparams_ref[name], **F32_TOL, err_msg=name)
    np.testing.assert_allclose(aux["aux_loss"], aux_ref["aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(aux["z_loss"], aux_ref["z_loss"], rtol=1e-5)


@pytest.mark.parametrize("case,mesh_name", PAIRS)
def test_drop_fraction_and_expert_load_match_the_oracle(case, mesh_name):
    _, aux, _, _ = run_block(case, mesh_name)
    *_, keep = run_oracle(case)
    np.testing.assert_allclose(aux["drop_fraction"], 1.0 - keep.mean(), rtol=1e-6)
    cfg = make_config(case)
    x, params, _ = case_inputs(case)
    _, _, experts, _, _ = oracle_routing(x.reshape(-1, D), params["router"], cfg, params.get("bias"))
    load = np.bincount(np.asarray(experts).ravel(), minlength=E) / experts.size
    np.testing.assert_allclose(aux["expert_load"], load, rtol=1e-6)
    assert aux["expert_load"].shape == (E,) and aux["expert_load"].dtype == np.float32


def test_tight_capacity_really_drops_and_ample_capacity_and_dropless_do_not():
    for case in ("top2_tight_probability", "top1_tight_position"):
        assert 0.05 < run_oracle(case)[-1].size - run_oracle(case)[-1].sum()
    for case in ("top1", "top2", "top2_dropless"):
        assert run_oracle(case)[-1].all()
        assert float(run_block(case, "expert8")[1]["drop_fraction"]) == 0.0


@pytest.mark.parametrize("case", ["top2_tight_probability", "top1_tight_position"])
def test_the_same_tokens_are_dropped_with_and_without_expert_parallelism(case):
    """A dropped assignment contributes nothing, so equal outputs token by token on a
    mask that differs from the no-drop routing show the same assignments were dropped."""
    y_local = run_block(case, "none")[0]
    for mesh_name in ("expert8", "data2_expert4"):
        np.testing.assert_allclose(run_block(case, mesh_name)[0], y_local, **F32_TOL)
    keep = run_oracle(case)[-1]
    dropped_tokens = ~keep.all(axis=1)
    y_no_drops = run_oracle(case.split("_")[0])[0].reshape(-1, D)
    differs = np.abs(y_local.reshape(-1, D) - y_no_drops).max(axis=1) > 1e-4
    np.testing.assert_array_equal(differs, dropped_tokens)


@pytest.mark.parametrize("case", ["top2", "top2_dropless"])
def test_bfloat16_block_is_within_rounding_of_the_float32_oracle(case):
    """Tolerance 8u of the largest reference magnitude, u = 2^-8 the bf16 unit roundoff.

    Why: in bf16 the expert path rounds about six times before the output (x, the weights,
    h = x W_in, g = x W_gate, silu(g) * h, the output), each by at most u/2 relative to the
    terms of the next sum; sums with cancellation (sum of |terms| about 2-3x |sum| here)
    scale that, so 6 * u/2 * 2.5 ~ 7.5u bounds the forward error; the backward products
    round about as often. Observed: y 3.1u, dx 1.4u, weight gradients <= 3.0u. Routing is
    not part of the error: the oracle gets the same bf16-rounded x and router logits are
    float32 in both, so every token picks the same experts."""
    cfg = make_config(case)
    mesh = make_mesh("expert8")
    x, params, ct = inputs()
    x16 = x.astype(jnp.bfloat16)
    xs, ps = place(mesh, x16, params)
    (dx, dparams), (y, _) = block_grad(xs, ps, ct, cfg, mesh)
    assert y.dtype == jnp.bfloat16 and dparams["w_in"].dtype == jnp.float32
    x32 = x16.astype(jnp.float32)
    (dx_ref, dparams_ref), (y_ref, _) = oracle_grad(x32, params, ct, np.ones((B * L, 2), bool), cfg)
    u = 2.0**-8
    err = np.abs(np.asarray(y, np.float32) - y_ref).max()
    assert err <= 8 * u * np.abs(y_ref).max(), err
    assert np.abs(np.asarray(dx, np.float32) - dx_ref).max() <= 8 * u * np.abs(dx_ref).max()
    for name in ("w_in", "w_gate", "w_out"):
        g, g_ref = np.asarray(dparams[name]), np.asarray(dparams_ref[name])
        assert np.abs(g - g_ref).max() <= 8 * u * np.abs(g_ref).max(), name


@pytest.mark.parametrize("case,mesh_name", [("top2_tight_probability", "none")])
def test_jit_equals_no_jit(case, mesh_name):
    """Eagerly, op by op (shard_map would run each op on 8 devices: slow, and the layouts are
    already pinned to the unsharded path by the tests above)."""
    cfg, mesh = make_config(case), make_mesh(mesh_name)
    x, params, ct = inputs()
    x, params = place(mesh, x, params)
    eager_loss, (eager_y, eager_aux) = block_loss(x, params, ct, cfg, mesh)
    jit_y, jit_aux = run_block(case, mesh_name)[:2]
    np.testing.assert_allclose(eager_y, jit_y, **F32_TOL)
    for key in jit_aux:
        np.testing.assert_allclose(eager_aux[key], jit_aux[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("case", ["top2_dropless", "top4_dropless_once_groups"])
def test_ragged_exchange_equals_the_padded_exchange(case):
    """The TPU/GPU dropless exchange (ragged_all_to_all) cannot compile on CPU; with the
    collective lowered as an emulation of its documented semantics it must move exactly the
    rows the padded all_to_all moves: same outputs and gradients, bit for bit. The backward
    exchange is jax's own transpose of the primitive. Once per assignment, on routing that one round
    of the padded exchange moves (further rounds split a device's rows into other spans, whose float32
    sums round differently), and once per device; the latter sums a token's gated outputs on the
    receiver, where the two programs fuse differently (float32 contractions), so there it agrees to
    rounding."""
    cfg, mesh = make_config(case), make_mesh("data2_expert4")
    x, params, ct = balanced_inputs() if cfg.exchange_rows != "device" else inputs()
    padded = make_topology(cfg, mesh)
    w = ExpertWeights(params["w_in"], params["w_gate"], params["w_out"])

    def grads(topo):
        def local(x_bxLxD, router, w_local):
            y, _ = moe_groups(x_bxLxD.reshape(1, -1, D), router, w_local, cfg, topo, True, None)
            return y.reshape(x_bxLxD.shape)

        spec = P(topo.token_axes)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), ExpertWeights(*(P("expert"),) * 3)),
                           out_specs=spec, check_vma=False)
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2)))(x, params["router"], w)

    with ragged_all_to_all_on_cpu():
        ragged = grads(dataclasses.replace(padded, exchange="ragged"))
    for a, b in zip(jax.tree.leaves(grads(padded)), jax.tree.leaves(ragged), strict=True):
        if cfg.exchange_rows == "device":
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
        else:
            np.testing.assert_array_equal(a, b)


def balanced_inputs():
    """Token t picks experts t % 8 and (t + 1) % 8: 8 rows from each source to each device."""
    x, params, ct = inputs()
    t = jnp.arange(B * L)
    x = 0.01 * x + (3 * jax.nn.one_hot(t % E, D) + 2 * jax.nn.one_hot((t + 1) % E, D)).reshape(B, L, D)
    return x, {**params, "router": jnp.eye(D, E)}, ct


def skewed_inputs():
    """Every token picks experts 0 and 1: all rows go to the one device (of 4) or two (of 8) holding them."""
    x, params, ct = inputs()
    return jnp.abs(x) + 1.0, {**params, "router": params["router"].at[:, :2].set(2.0)}, ct


def assert_block_equals_oracle(x, params, ct, cfg, mesh, names=("router", "w_in", "w_gate", "w_out")):
    """Outputs and gradients of the sharded (dropless) block against the oracle, which keeps every assignment;
    returns the block's aux. Tolerances are relative to each array's scale (these inputs can be several times
    larger)."""
    (dx, dparams), (y, aux) = block_grad(*place(mesh, x, params), ct, cfg, mesh)
    (dx_ref, dparams_ref), (y_ref, _) = oracle_grad(x, params, ct, np.ones((B * L, cfg.top_k), bool), cfg)
    close = lambda a, b, msg="": np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=msg)
    close(y, y_ref)
    close(dx, dx_ref)
    for name in names:
        close(dparams[name], dparams_ref[name], name)
    return aux


@pytest.mark.parametrize("case", ["top2_dropless", "top2_dropless_once"])
def test_dropless_stays_exact_when_every_token_goes_to_two_experts(case):
    """The worst case of the dropless exchange: every device sends all its rows to the two
    devices that hold experts 0 and 1, twice the first round's chunk, so the padded exchange runs its
    loop of further rounds, recomputed in the backward pass. Still equal to the oracle."""
    cfg, mesh = make_config(case), make_mesh("expert8")
    tokens = B * L // 8  # per device; each sends all of them (once per device) or twice that to each of two
    chunks = (exchange.once_per_device_chunks(tokens, 8, 2) if cfg.exchange_rows == "device"
              else padded_chunks(2 * tokens, 8))
    assert int(exchange.padded_rounds(jnp.full((8, 8), tokens), chunks)) == 2
    aux = assert_block_equals_oracle(*skewed_inputs(), cfg, mesh, names=("w_in", "w_gate", "w_out"))
    np.testing.assert_allclose(aux["expert_load"][:2], [0.5, 0.5], rtol=1e-6)


def test_padded_exchange_chunks_are_five_and_three_quarters_of_the_fair_share_in_multiples_of_8():
    """The first round's chunk is 1.25x a destination's fair share, each further round's 0.75x:
    two rounds hold twice the fair share. Never more than all N rows."""
    assert padded_chunks(2048, 8) == Chunks(320, 192)
    assert padded_chunks(512, 8) == Chunks(80, 48)
    assert padded_chunks(32, 4) == Chunks(16, 8)
    assert padded_chunks(36, 4) == Chunks(16, 8)
    assert padded_chunks(8, 2) == Chunks(8, 8)
    assert padded_chunks(256, 8, cap=32) == Chunks(32, 24)
    assert exchange.once_per_device_chunks(128, 8, 4) == padded_chunks(512, 8, cap=128) == Chunks(80, 48)
    assert [Chunks(80, 48).start(r) for r in range(4)] == [0, 80, 128, 176]


def test_one_round_moves_every_row_when_every_send_fits_the_first_chunk():
    """Balanced routing (each source sends 8 of its 32 rows to each of 4 devices) fits a first chunk
    of 16: one round; a send of 17 to 24 rows takes one more round of 8, one of 32 rows (two hot
    experts on one device) three."""
    chunks = padded_chunks(32, 4)
    balanced_SxJ = jnp.full((4, 4), 8)
    assert chunks == Chunks(16, 8)
    rounds = lambda sizes: int(exchange.padded_rounds(sizes, chunks))
    assert rounds(balanced_SxJ) == 1
    assert rounds(balanced_SxJ.at[1, 3].set(16)) == 1  # exactly full fits
    assert rounds(balanced_SxJ.at[1, 3].set(17)) == 2
    assert rounds(balanced_SxJ.at[1, 3].set(24)) == 2
    assert rounds(balanced_SxJ.at[2, 0].set(32)) == 3
    assert rounds(jnp.zeros((4, 4), jnp.int32)) == 1  # nothing to send
    assert exchange.padded_rounds(balanced_SxJ.at[2, 0].set(32), chunks, longest=16) == 1  # static: none can be longer


def test_window_counts_the_rows_of_each_group_a_round_moves():
    """Chunk rows sorted by group: counts [3, 5, 2] fill rows 0-2, 3-7, 8-9; a round of 4 rows
    from row 4 takes rows 4-7 (all group 1), one from row 8 rows 8-9 (group 2)."""
    counts = jnp.array([[3, 5, 2], [0, 0, 9]])
    np.testing.assert_array_equal(exchange._window(counts, 0, 4), [[3, 1, 0], [0, 0, 4]])
    np.testing.assert_array_equal(exchange._window(counts, 4, 4), [[0, 4, 0], [0, 0, 4]])
    np.testing.assert_array_equal(exchange._window(counts, 8, 4), [[0, 0, 2], [0, 0, 1]])
    total = sum(exchange._window(counts, r * 4, 4) for r in range(3))
    np.testing.assert_array_equal(total, counts)


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
def test_padded_exchange_equals_the_oracle_for_balanced_and_skewed_routing(skewed):
    """The CPU dropless exchange pads each destination's rows to 1.25x its fair share; when a send
    is longer it takes further rounds. One round or several give the oracle's block and gradients."""
    x, params, ct = skewed_inputs() if skewed else balanced_inputs()
    assert_block_equals_oracle(x, params, ct, make_config("top2_dropless"), make_mesh("data2_expert4"))


@pytest.mark.parametrize("case,mesh_name", [("top2_dropless", "data2_expert4"), ("top2_dropless_once", "expert8")])
@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
def test_the_exchange_that_all_gathers_its_counts_equals_the_oracle(skewed, case, mesh_name, monkeypatch):
    """Every device's counts (rows per expert, or pairs per device) come with the statistics'
    all-reduce up to core.MERGED_COUNTS_LIMIT; past it each expert group all-gathers its own and
    the rounds take a max over the data axis. That path too gives the oracle's block, in one round
    or several."""
    monkeypatch.setattr(core, "MERGED_COUNTS_LIMIT", 0)
    x, params, ct = skewed_inputs() if skewed else balanced_inputs()
    assert_block_equals_oracle(x, params, ct, make_config(case), make_mesh(mesh_name))
