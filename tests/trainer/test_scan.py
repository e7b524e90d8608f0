"""The layers scanned per pattern (trainer/stacks.py, trainer/model.py) against the same stacked parameters run
a layer at a time (model.scan_layers=false, each layer traced apart): a train step's loss, metrics, updated
parameters and balancing biases agree on one device and on a mesh with expert and tensor parallelism; the
stacks' plan compiles each pattern once; every layer's parameter has one place in the stacked layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import sharding, stacks
from trainer.config import load_config
from trainer.data import open_data
from trainer.step import CPU_FAST_COMPILE, build_trainer

pytestmark = pytest.mark.compile_bound  # compiling dominates (tests/trainer/conftest.py)

D, M = "dense", "moe"


@pytest.mark.parametrize("kinds, expected", [
    ((M,) * 32, [(0, 1, 32)]),
    ((D, M) * 16, [(0, 2, 16)]),  # moe_every=2: one stack of the pair
    ((D, D, D) + (M,) * 29, [(0, 1, 3), (3, 1, 29)]),  # DeepSeek's first dense layers
    ((D, M, D, M, D, M, M, M), [(0, 2, 3), (6, 1, 2)]),  # Qwen's mlp_only_layers cutting a run
    ((D, M, M, D, M, M), [(0, 3, 2)]),
    ((M,), [(0, 1, 1)]),
])
def test_the_plan_compiles_each_pattern_once(kinds, expected):
    plan = stacks.plan_stacks(kinds)
    assert [(s.start, s.period, s.repeats) for s in plan] == expected
    # Every layer once, each at a place of its own structure's period position.
    layers = sorted(s.layer(j, r) for s in plan for j in range(s.period) for r in range(s.repeats))
    assert layers == list(range(len(kinds)))
    assert all(kinds[s.layer(j, r)] == kinds[s.layer(j, 0)] for s in plan for j in range(s.period)
               for r in range(s.repeats))


def test_every_layer_name_has_one_place_in_the_stacked_layout():
    m = load_config("tiny", ["model.num_layers=7", "model.moe_every=1", "model.dense_layers=[0,3]"]).model
    assert [(s.start, s.period, s.repeats) for s in stacks.layer_stacks(m)] == [(0, 3, 2), (6, 1, 1)]
    assert stacks.locate(m, "blocks.5.ffn.w_in") == ("stacks.0.2.ffn.w_in", 1)
    assert stacks.locate(m, "embed") == ("embed", None)
    assert stacks.layer_names(m, "stacks.0.1.attn.wq") == ["blocks.1.attn.wq", "blocks.4.attn.wq"]
    flat = {f"blocks.{i}.attn_norm.scale": np.full((2,), i) for i in range(7)} | {"embed": np.ones(3)}
    stacked = stacks.stack_flat(m, flat, np.stack)
    assert stacked["stacks.0.0.attn_norm.scale"][:, 0].tolist() == [0, 3]
    back = stacks.unstack_flat(m, stacked)
    assert set(back) == set(flat) and all(np.array_equal(back[k], flat[k]) for k in flat)
    with pytest.raises(ValueError, match="layer 7 is outside"):
        stacks.locate(m, "blocks.7.attn.wq")


# Three layers (dense, then two MoE: two stacks), the balancing bias moved every step, jitter's random streams
# stacked a layer each, remat inside the scan; 8 rows of 16 tokens.
COMMON = ["model.num_layers=3", "model.dense_layers=[0]", "moe.balance=both", "moe.bias_rate=0.01",
          "moe.jitter=0.01", "model.remat=true", "data.global_batch_size=8", "data.seq_len=16", "train.seed=1"]


def test_a_scanned_step_equals_the_layer_by_layer_one():
    """On data=2,expert=2,model=2 (experts and their hidden sizes split: shard_map inside the scan); one
    device runs the same scan in every other test of the suite."""
    shape = sharding.parse_mesh("data=2,expert=2,model=2", 8)
    devices = jax.devices()[:shape["data"] * shape["expert"] * shape["model"]]
    results, initial = [], None
    for scan in (True, False):
        cfg = load_config("tiny", COMMON + [f"model.scan_layers={str(scan).lower()}"])
        tr = build_trainer(cfg, sharding.make_mesh(shape, devices), 10)
        data, _ = open_data(cfg, cfg.train.seed)
        # Both from the scanned trainer's initial state, kept on the host (the step donates its state): the same
        # parameters and layout either way (model.scan_layers changes how the stacks run, not what they hold),
        # initialised once.
        initial = jax.device_get(tr.initial_state()) if initial is None else initial
        state = jax.device_put(initial, tr.state_shardings)
        batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=tr.batch_sharding)
        step_fn = tr.step_fn.lower(tr.abstract_state, batch).compile(compiler_options=CPU_FAST_COMPILE)
        rows = []
        for _ in range(2):
            state, metrics = step_fn(state, sharding.global_batch(tr, next(data)))
            rows.append(jax.device_get(metrics))
        results.append((rows, jax.device_get(state)))
    (scanned, s_state), (unrolled, u_state) = results
    for a, b in zip(scanned, unrolled, strict=True):
        assert set(a) == set(b) and "moe.2.load_cv" in a and "moe.0.load_cv" not in a  # true layer indices
        for key in a:
            np.testing.assert_allclose(a[key], b[key], rtol=2e-5, atol=2e-6, err_msg=key)
    for part in ("params", "moe_bias"):
        for name in s_state[part]:
            np.testing.assert_allclose(s_state[part][name], u_state[part][name], rtol=1e-3, atol=5e-5, err_msg=name)
    assert np.abs(s_state["moe_bias"]["stacks.1.0.ffn.expert_bias"]).max() > 0  # the biases moved, per layer
    assert s_state["moe_bias"]["stacks.1.0.ffn.expert_bias"].shape == (2, 8)


def test_a_checkpoint_of_the_per_layer_layout_restores_stacked(tmp_path):
    """A checkpoint written before the layers were stacked (`blocks.{i}.…`: here the state unstacked and saved
    as such) resumes, fine-tunes (--init-from) and serves in the stacked layout, every array equal."""
    from trainer.checkpoint import Checkpointer, _walk
    from trainer.init_from import initial_state as fine_tune
    from trainer.serve.weights import build_serving_model, restore_weights

    cfg = load_config("tiny", ["model.num_layers=3", "model.dense_layers=[0]", "moe.balance=both"])
    tr = build_trainer(cfg, sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1]), 10)
    state = jax.device_get(tr.initial_state())
    state["moe_bias"] = {n: np.arange(v.size, dtype=np.float32).reshape(v.shape) for n, v in state["moe_bias"].items()}
    old = _walk(state, lambda flat: stacks.unstack_flat(cfg.model, flat))
    assert "blocks.2.ffn.w_in" in old["params"] and "blocks.2.ffn.w_in" in old["opt_state"][1][0].mu
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), every=1, keep=2)
    old["step"] = np.asarray(3, np.int32)
    ckpt.save(3, old, {}, force=True)
    ckpt.wait()
    restored = ckpt.restore_latest(tr.abstract_state, cfg.model)
    ckpt.close()
    assert restored.step == 3 and restored.unreadable == ()
    got, want = jax.tree.leaves_with_path(restored.state), jax.tree.leaves_with_path({**state, "step": 3})
    assert [p for p, _ in got] == [p for p, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
    tuned, _ = fine_tune(tr, str(tmp_path))
    served, step = restore_weights(build_serving_model(cfg, tr.mesh), str(tmp_path / "checkpoints"))
    for weights in (tuned, served):
        for part in ("params", "moe_bias"):
            assert all(np.array_equal(weights[part][n], state[part][n]) for n in state[part]), part


def test_the_layers_made_in_one_loop_are_those_made_one_by_one_to_the_bit():
    """The initialisation builds a stack's layers in one jax.lax.map (one Block in the program however deep):
    every parameter, bias and RNG stream equals what building the layers one after another gave, with the
    same logical axes, in the program the trainer jits."""
    from flax import nnx

    from trainer.model import Transformer

    # MLA; a dense stack of one layer, a MoE stack of several; the balancing bias; jitter's forked streams
    cfg = load_config("deepseek-tiny", ["moe.jitter=0.1", "param_dtype=bfloat16"])
    assert [s.repeats for s in stacks.layer_stacks(cfg.model)] == [2]

    def build(together: bool):
        with nnx.use_eager_sharding(False):
            return Transformer(cfg, mesh=None, rngs=nnx.Rngs(cfg.train.seed), layers_together=together)

    def made(together: bool):
        state = jax.jit(lambda: nnx.state(build(together))).lower().compile(compiler_options=CPU_FAST_COMPILE)()
        return {path: (type(var).__name__, sharding.variable_names(var), raw(var.get_value()))
                for path, var in nnx.to_flat_state(state)}

    def raw(value):
        keys = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(value) if keys else value)

    together, one_by_one = made(True), made(False)
    assert together.keys() == one_by_one.keys()
    for path, (kind, names, value) in one_by_one.items():
        assert together[path][:2] == (kind, names), path
        assert together[path][2].dtype == value.dtype and np.array_equal(together[path][2], value), path
