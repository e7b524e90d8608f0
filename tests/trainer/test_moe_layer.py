"""MoEBlock, the Flax NNX module: its interface, layouts, expert choice, shared experts, jitter."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from moe_oracle import expert_ffn, oracle_expert_choice, oracle_moe

from trainer.moe import MoEBlock, MoEConfig
from trainer.moe.capacity import expert_capacity

B, L, D = 8, 8, 16
SMALL = dict(num_experts=8, d_ff=32, min_capacity=1)


@functools.cache
def mesh(shape=(2, 4)):
    return jax.make_mesh(shape, ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def x_BxLxD(seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (B, L, D), dtype)


def params_of(block: MoEBlock) -> dict:
    return {n: getattr(block, n)[...] for n in ("router", "w_in", "w_gate", "w_out")}


@functools.cache
def apply_block(cfg: MoEConfig, mesh_shape, train: bool = True, seed: int = 0):
    m = None if mesh_shape is None else mesh(mesh_shape)
    block = MoEBlock(cfg, D, mesh=m, rngs=nnx.Rngs(seed))
    x = x_BxLxD()
    if m is not None:
        x = jax.device_put(x, NamedSharding(m, P(("data", "expert"))))
    y, aux = nnx.jit(lambda blk, x: blk(x, train=train))(block, x)
    return block, y, aux


def test_interface_shapes_dtypes_and_aux_keys():
    cfg = MoEConfig(**SMALL)
    block, y, aux = apply_block(cfg, None)
    assert y.shape == (B, L, D) and y.dtype == jnp.float32
    balance = {"load_max_over_mean", "load_min_over_mean", "load_cv", "groups_per_token"}
    assert set(aux) == {"aux_loss", "z_loss", "drop_fraction", "expert_load"} | balance
    assert aux["expert_load"].shape == (8,) and aux["expert_load"].dtype == jnp.float32
    np.testing.assert_allclose(float(aux["expert_load"].sum()), 1.0, rtol=1e-6)
    for key in ("aux_loss", "z_loss", "drop_fraction", *balance):
        assert aux[key].shape == () and float(aux[key]) >= 0
    load = np.asarray(aux["expert_load"])
    np.testing.assert_allclose(aux["load_max_over_mean"], load.max() * 8, rtol=1e-6)
    np.testing.assert_allclose(aux["load_min_over_mean"], load.min() * 8, rtol=1e-6)
    np.testing.assert_allclose(aux["load_cv"], load.std() / load.mean(), rtol=1e-5)
    assert 1.0 <= float(aux["groups_per_token"]) <= 2.0  # no mesh: one group of all experts


def test_parameters_carry_logical_axis_names():
    block = MoEBlock(MoEConfig(**SMALL, num_shared_experts=1), D, rngs=nnx.Rngs(0))
    expected = {
        "router": ("embed", None), "w_in": ("expert", "embed", "mlp"), "w_gate": ("expert", "embed", "mlp"),
        "w_out": ("expert", "mlp", "embed"), "shared_w_in": ("embed", "mlp"), "shared_w_gate": ("embed", "mlp"),
        "shared_w_out": ("mlp", "embed"),
    }
    for name, names in expected.items():
        param = getattr(block, name)
        assert isinstance(param, nnx.Param)
        assert tuple(param.get_metadata()["out_sharding"]) == names, name
        assert param[...].dtype == jnp.float32


def test_losses_are_already_scaled_by_their_coefficients():
    base = MoEConfig(**SMALL)
    doubled = MoEConfig(**{**base.model_dump(), "aux_loss_coef": 0.02, "z_loss_coef": 0.002})
    _, _, aux = apply_block(base, None)
    _, _, aux2 = apply_block(doubled, None)
    np.testing.assert_allclose(aux2["aux_loss"], 2 * aux["aux_loss"], rtol=1e-6)
    np.testing.assert_allclose(aux2["z_loss"], 2 * aux["z_loss"], rtol=1e-6)


@pytest.mark.parametrize("capacity_factor", [8.0, 0.0])
def test_sharded_block_equals_the_unsharded_block(capacity_factor):
    """With room for every assignment the routing groups do not matter, so no mesh, the
    (data=2, expert=4) mesh and a data-only mesh (no shard_map) all agree."""
    cfg = MoEConfig(**SMALL, capacity_factor=capacity_factor)
    _, y, aux = apply_block(cfg, None)
    for shape in ((2, 4), (8, 1)):
        _, y_mesh, aux_mesh = apply_block(cfg, shape)
        np.testing.assert_allclose(y_mesh, y, rtol=1e-5, atol=1e-5)
        for key in aux:
            np.testing.assert_allclose(aux_mesh[key], aux[key], rtol=1e-5, err_msg=key)


def test_the_block_output_is_the_oracle_and_excludes_the_residual():
    cfg = MoEConfig(**SMALL, capacity_factor=8.0)
    block, y, _ = apply_block(cfg, None)
    y_ref = oracle_moe(x_BxLxD().reshape(-1, D), params_of(block), cfg)
    np.testing.assert_allclose(y.reshape(-1, D), y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_expert_choice_block_equals_its_oracle_and_each_expert_is_full(mesh_shape):
    cfg = MoEConfig(**SMALL, routing="expert_choice", capacity_factor=1.0, routing_groups=8)
    block, y, aux = apply_block(cfg, mesh_shape)
    capacity = expert_capacity(B * L // 8, cfg.top_k, 1.0, 8, 1)
    x = x_BxLxD().reshape(-1, D)
    y_ref = oracle_expert_choice(x, params_of(block), cfg, 8, capacity)
    np.testing.assert_allclose(y.reshape(-1, D), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["expert_load"], np.full(8, 1 / 8), rtol=1e-6)
    chosen = np.abs(np.asarray(y_ref)).max(axis=1) > 0
    np.testing.assert_allclose(aux["drop_fraction"], 1 - chosen.mean(), rtol=1e-6)
    assert float(aux["aux_loss"]) == 0.0


def test_shared_expert_adds_a_dense_ffn_for_every_token():
    cfg = MoEConfig(**SMALL, capacity_factor=8.0, num_shared_experts=1, shared_d_ff=24)
    block, y, _ = apply_block(cfg, None)
    x = x_BxLxD().reshape(-1, D)
    shared = expert_ffn(x, block.shared_w_in[...], block.shared_w_gate[...], block.shared_w_out[...])
    routed = oracle_moe(x, params_of(block), cfg)
    np.testing.assert_allclose(y.reshape(-1, D), routed + shared, rtol=1e-5, atol=1e-5)
    assert block.shared_w_in[...].shape == (D, 24)


def test_jitter_perturbs_routing_in_training_only():
    cfg = MoEConfig(**SMALL, capacity_factor=8.0, jitter=0.5)
    block = MoEBlock(cfg, D, rngs=nnx.Rngs(0))
    plain = MoEBlock(MoEConfig(**SMALL, capacity_factor=8.0), D, rngs=nnx.Rngs(0))
    run = nnx.jit(lambda blk, x, train: blk(x, train=train)[0], static_argnums=2)
    x = x_BxLxD()
    y_eval = run(block, x, False)
    np.testing.assert_array_equal(y_eval, run(block, x, False))
    np.testing.assert_allclose(y_eval, run(plain, x, False), rtol=1e-6)
    y_train, y_train2 = run(block, x, True), run(block, x, True)
    assert float(jnp.abs(y_train - y_eval).max()) > 1e-4
    assert float(jnp.abs(y_train - y_train2).max()) > 1e-4  # fresh noise on every call


def test_eval_uses_the_eval_capacity_factor():
    cfg = MoEConfig(**SMALL, capacity_factor=0.25, eval_capacity_factor=8.0)
    _, _, aux_train = apply_block(cfg, None, True)
    _, _, aux_eval = apply_block(cfg, None, False)
    assert float(aux_train["drop_fraction"]) > 0.1
    assert float(aux_eval["drop_fraction"]) == 0.0


def test_bfloat16_compute_keeps_float32_parameters():
    block = MoEBlock(MoEConfig(**SMALL), D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y, aux = nnx.jit(lambda blk, x: blk(x))(block, x_BxLxD())
    assert y.dtype == jnp.bfloat16 and block.w_in[...].dtype == jnp.float32
    assert aux["aux_loss"].dtype == jnp.float32


def test_experts_must_divide_over_the_expert_axis():
    with pytest.raises(ValueError, match="num_experts"):
        MoEBlock(MoEConfig(num_experts=6, d_ff=8), D, mesh=mesh((2, 4)), rngs=nnx.Rngs(0))


def test_routing_groups_must_fit_the_mesh_and_the_batch():
    block = MoEBlock(MoEConfig(**SMALL, routing_groups=3), D, mesh=mesh((2, 4)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="routing_groups"):
        block(x_BxLxD())


def _benchmark_module():
    """benchmarks/moe_layer.py, imported from the checkout (it is not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_layer.py"
    spec = importlib.util.spec_from_file_location("moe_layer_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "random"])
def test_the_benchmarks_balanced_routing_gives_every_expert_its_fair_share_on_every_device(balanced):
    """`benchmarks/moe_layer.py --routing balanced`: token t's top-k are experts t, t + 1, ... (mod E),
    so each device's tokens put exactly T * k / E assignments on every expert; the random router does not."""
    bench = _benchmark_module()
    experts, k, d_model, tokens, devices = 16, 2, 64, 1024, 8
    mesh = jax.make_mesh((1, devices), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    x, router, _ = bench.make_inputs(mesh, experts, d_model, 8, tokens, balanced_k=k if balanced else 0)
    logits = np.asarray(x.reshape(tokens, d_model) @ router)
    chosen = np.argsort(-logits, axis=1)[:, :k].reshape(devices, -1)
    counts = np.stack([np.bincount(c, minlength=experts) for c in chosen])
    fair = tokens // devices * k // experts
    assert (counts == fair).all() == balanced, counts
    # What the benchmark reports of the same routing: the largest send and the most loaded device's
    # rows, against their fair shares (the block routes as above: softmax top-k, no bias).
    largest, most_loaded = bench.sends(x, router, MoEConfig(num_experts=experts, top_k=k, d_ff=8), devices)
    per_device = counts.reshape(devices, devices, experts // devices).sum(axis=2)  # [source, destination]
    assert largest == pytest.approx(per_device.max() / (tokens // devices * k / devices))
    assert most_loaded == pytest.approx(per_device.sum(axis=0).max() / (tokens * k / devices))
    assert (largest == 1.0 and most_loaded == 1.0) == balanced
    if balanced:
        top = np.argmax(logits, axis=1)
        np.testing.assert_array_equal(top, np.arange(tokens) % experts)


def test_the_benchmarks_collectives_floor_runs_the_blocks_six_collectives_in_a_chain():
    """`--stages` times the dropless block's collectives alone: the statistics' all-reduce, four
    all_to_all of [devices * chunk, D] rows and the router gradient's all-reduce, each after the last."""
    import re

    bench = _benchmark_module()
    devices, chunk, d_model, experts = 8, 16, 32, 16
    mesh = jax.make_mesh((1, devices), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    step, args = bench.collectives_step(mesh, chunk, d_model, experts)
    hlo = step.lower(*args).compile().as_text()
    kinds = [m.group(1) for line in hlo.splitlines() if " = " in line
             for m in [re.search(r"\s(all-to-all|all-reduce|all-gather|collective-permute)\(", line)] if m]
    assert sorted(kinds) == ["all-reduce"] * 2 + ["all-to-all"] * 4, kinds
    rows, grad = step(*args)
    assert rows.shape == (devices * devices * chunk, d_model) and grad.shape == (d_model, experts)


def test_the_benchmarks_time_each_step_right_after_an_untimed_call_of_its_own():
    """Both benchmarks (moe_layer.py and moe_exchange_ab.py) time through `interleaved`: a step
    timed right after another one ran up to 1.8x slower, so each timed call must follow a call of
    the same step, and every step must be timed once per round."""
    bench = _benchmark_module()
    calls = []
    steps = {name: (lambda name=name: calls.append(name) or jnp.zeros(()), ()) for name in ("ideal", "block")}
    times = bench.interleaved(steps, reps=3)
    assert {name: len(t) for name, t in times.items()} == {"ideal": 3, "block": 3}
    assert all(wall >= 0 and cpu >= 0 for t in times.values() for wall, cpu in t)
    warm, rounds = calls[:2], calls[2:]
    assert warm == ["ideal", "block"]
    assert rounds == ["ideal", "ideal", "block", "block"] * 3, rounds


@pytest.mark.parametrize("argv, message", [(["--token-scale", "0"], "whole number >= 1"),
                                           (["--token-scale", "x"], "whole number >= 1"),
                                           (["--case", "9"], "the cases are 0 to")])
def test_the_benchmark_refuses_a_bad_case_or_token_scale_before_running_anything(argv, message, capsys):
    bench = _benchmark_module()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
