"""Model invariants: causality, jit equals no-jit, logical names on every parameter, sharding rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from trainer import sharding
from trainer.config import load_config
from trainer.model import ParamCodec, build_model

DROPLESS = ["moe.capacity_factor=0"]


def tokens(batch=2, length=16, seed=0):
    """Random token ids [batch, length]."""
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256)


@pytest.mark.parametrize("overrides", [DROPLESS, DROPLESS + ["model.moe_every=2", "model.num_kv_heads=2"]])
def test_causality(overrides):
    """Changing token t never changes the outputs at positions before t."""
    model = build_model(load_config("tiny", overrides))
    forward = nnx.jit(lambda m, x: m(x, train=False)[0])
    x = tokens()
    logits = forward(model, x)
    for t in (0, 7, 15):
        changed = x.at[:, t].set((x[:, t] + 1) % 256)
        logits2 = forward(model, changed)
        np.testing.assert_array_equal(logits[:, :t], logits2[:, :t])
        assert not np.allclose(logits[:, t], logits2[:, t])


def test_jit_equals_no_jit_forward():
    model = build_model(load_config("tiny"))
    x = tokens()
    eager, aux = model(x)
    jitted, aux_j = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["expert_load"], aux_j["expert_load"], atol=1e-6)
    assert eager.shape == (2, 16, 256) and eager.dtype == jnp.float32
    assert aux["expert_load"].shape == (8,) and float(aux["expert_load"].sum()) == pytest.approx(1.0)


def test_remat_and_bfloat16_compute_keep_float32_master_weights():
    x = tokens()
    loss = nnx.jit(lambda m, x: jnp.mean(nnx.grad(lambda m: m(x)[0].std())(m)["embed"][...] ** 2))
    base = build_model(load_config("tiny"))
    remat = build_model(load_config("tiny", ["model.remat=true"]))
    np.testing.assert_allclose(loss(base, x), loss(remat, x), rtol=1e-5)
    bf16 = build_model(load_config("tiny", ["dtype=bfloat16"]))
    logits = nnx.jit(lambda m, x: m(x)[0])(bf16, x)
    assert logits.dtype == jnp.float32
    assert {p.dtype for p in jax.tree.leaves(nnx.state(bf16, nnx.Param))} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x)[0])(base, x), logits, atol=0.1)


def test_every_param_has_logical_names_and_codec_round_trips():
    model = build_model(load_config("tiny", ["model.moe_every=2"]))
    params = nnx.state(model, nnx.Param)
    codec = ParamCodec(params)
    assert all(sharding.variable_names(v) is not None for v in codec.variables.values())
    flat = codec.flatten(params)
    # Layers 0 (dense) and 1 (MoE) are one stack of period 2, each position's parameters with a layer axis.
    assert flat["stacks.0.0.attn.wq"].shape[0] == 1 and flat["stacks.0.1.ffn.w_in"].ndim == 4
    assert "stacks.0.0.ffn.w_in" in flat and flat["stacks.0.0.ffn.w_in"].ndim == 3  # dense [1, D, F]
    back = codec.flatten(codec.unflatten(flat))
    assert all(back[k] is flat[k] for k in flat)


def test_builds_for_shapes_draw_nothing_and_leave_the_initial_state_its_draws():
    """The planner's, the trainer's and the engine's abstract builds trace no draw (initializers.shapes_only);
    the trainer's initial state, made after all of them in this process, is still the eager build's, draw
    for draw: no program traced for shapes stands in for the one that draws."""
    from trainer import initializers
    from trainer.params import param_inventory
    from trainer.serve.weights import build_serving_model
    from trainer.step import build_trainer

    cfg = load_config("tiny", ["model.num_layers=2"])
    with initializers.shapes_only():
        assert not initializers.lecun(jax.random.key(1), (8, 4), jnp.float32).any()
    assert initializers.lecun(jax.random.key(1), (8, 4), jnp.float32).std() > 0.1
    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    assert len(param_inventory(cfg)) == len(ParamCodec(nnx.state(build_model(cfg), nnx.Param)).names)
    build_serving_model(cfg, mesh)
    state = jax.device_get(build_trainer(cfg, mesh, total_steps=10).initial_state())
    eager = nnx.state(build_model(cfg, seed=cfg.train.seed), nnx.Param)
    expected = ParamCodec(eager).flatten(eager)
    assert state["params"].keys() == expected.keys()
    for name, value in expected.items():  # eager and jitted draws differ by a rounding at most
        np.testing.assert_allclose(state["params"][name], np.asarray(value), rtol=1e-5, atol=1e-6, err_msg=name)
    assert sum(np.asarray(v).std() > 0 for v in expected.values()) >= len(expected) // 2


def test_sharding_rules_map_names_to_the_mesh():
    mesh = sharding.make_mesh({"data": 2, "expert": 4}, jax.devices()[:8])
    variables = ParamCodec(nnx.state(build_model(load_config("tiny")), nnx.Param)).variables
    specs = sharding.param_specs(variables, mesh)
    # The stacked layers' leading axis is never split.
    assert specs["stacks.0.0.ffn.w_in"] == P(None, "expert", None, None)
    assert specs["stacks.0.0.ffn.w_out"] == P(None, "expert", None, None)
    assert specs["stacks.0.0.attn.wq"] == P(None, None, None, None)
    assert specs["embed"] == P(None, None)
    fsdp = sharding.param_specs(variables, mesh, fsdp=True)
    assert fsdp["stacks.0.0.attn.wq"] == P(None, "data", None, None)
    assert fsdp["stacks.0.0.ffn.w_in"] == P(None, "expert", "data", None)
    assert fsdp["stacks.0.0.attn_norm.scale"] == P(None, None)
    assert sharding.batch_sharding(mesh).spec == P(("data", "expert"), None)
    # A dimension the mesh cannot divide stays whole.
    assert sharding.logical_to_spec(("expert", "embed"), (6, 64), mesh) == P(None, None)


@pytest.mark.parametrize("text, count, expected", [
    (None, 8, {"data": 8, "expert": 1, "model": 1}),
    ("data=2,expert=4", 8, {"data": 2, "expert": 4, "model": 1}),
    ("expert=8", 8, {"data": 1, "expert": 8, "model": 1}),
    ("expert=2,model=4", 8, {"data": 1, "expert": 2, "model": 4}),
    ("data=2,expert=2,model=2", 8, {"data": 2, "expert": 2, "model": 2}),
])
def test_parse_mesh(text, count, expected):
    assert sharding.parse_mesh(text, count) == expected


@pytest.mark.parametrize("text, needle", [
    ("data=3,expert=2", "needs 6 devices"), ("data=2,pipe=4", "unknown axis 'pipe'"), ("data=x", "integer"),
    ("data=2,model=2", "data=2,expert=1,model=2 needs 4 devices"), ("model", "data=D,expert=E,model=T"),
])
def test_parse_mesh_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        sharding.parse_mesh(text, 8)
