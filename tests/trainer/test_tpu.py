"""On a TPU chip, against the same computation on the CPU: the model's logits, every MoE path, a few training
steps, and ragged_dot under 'highest' precision. Marked `tpu`: skipped unless the run asks for the chip
(MOE_TPU_TESTS=1, tests/conftest.py) and one is there; nothing here compiles at collection.

    MOE_TPU_TESTS=1 python -m pytest -q -n 0 -m tpu tests/trainer/test_tpu.py

One process holds the chip, so these run in one pytest process (-n 0). MOE_TPU_TESTS=cpu runs the same
comparisons with a second CPU device standing in for the chip: a check of the tests themselves.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from moe_oracle import oracle_moe

from trainer import sharding
from trainer.attention import causal_attention
from trainer.config import load_config
from trainer.model import step_rngs
from trainer.moe import MoEBlock, MoEConfig, core
from trainer.moe.experts import ExpertWeights
from trainer.moe.parallel import moe_apply, moe_groups
from trainer.step import build_trainer

pytestmark = pytest.mark.tpu

B, L, D = 4, 64, 128  # MoE block inputs: 256 tokens, lane-sized rows
RELATIVE = 1e-5  # float32 at 'highest' precision, TPU vs CPU
BF16_LOSS = 2e-2  # a few training steps in bfloat16: the losses' relative agreement


@pytest.fixture(scope="module")
def chip():
    """The TPU device (with MOE_TPU_TESTS=cpu: the last CPU device, standing in)."""
    if os.environ.get("MOE_TPU_TESTS") == "cpu":
        return jax.devices("cpu")[-1]
    try:
        return jax.devices("tpu")[0]
    except RuntimeError as e:
        pytest.skip(f"no TPU here: {e}")


@pytest.fixture(scope="module")
def cpu():
    return jax.devices("cpu")[0]


def mesh_of(device):
    return sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, [device])


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@functools.cache
def tiny_trainers(chip, cpu, overrides=()):
    cfg = load_config("tiny", list(overrides))
    return build_trainer(cfg, mesh_of(chip), 10), build_trainer(cfg, mesh_of(cpu), 10), cfg


def tokens_BxT(cfg, rows=4, seed=0):
    return jax.random.randint(jax.random.key(seed), (rows, cfg.data.seq_len + 1), 0, cfg.model.vocab_size)


def logits_of(trainer, params, tokens):
    def forward(params, tokens):
        rest = step_rngs(trainer.rest, jnp.zeros((), jnp.int32))
        model = nnx.merge(trainer.graphdef, trainer.codec.unflatten(params), rest)
        return model(tokens, train=False)[0]

    return jax.jit(forward)(params, tokens)


def test_logits_and_greedy_tokens_match_the_cpu_on_the_same_weights(chip, cpu):
    on_chip, on_cpu, cfg = tiny_trainers(chip, cpu)
    with jax.default_matmul_precision("highest"):
        state = on_cpu.initial_state()
        params_chip = jax.device_put(state["params"], on_chip.state_shardings["params"])
        tokens = tokens_BxT(cfg)[:, :-1]
        want = logits_of(on_cpu, state["params"], jax.device_put(tokens, cpu))
        got = logits_of(on_chip, params_chip, jax.device_put(tokens, chip))
    assert relative_error(got, want) < RELATIVE
    np.testing.assert_array_equal(np.argmax(np.asarray(got), -1), np.argmax(np.asarray(want), -1))


def block_inputs(cfg: MoEConfig, dtype=jnp.float32):
    block = MoEBlock(cfg, D, mesh=None, rngs=nnx.Rngs(0))
    params = {n: getattr(block, n)[...] for n in ("router", "w_in", "w_gate", "w_out")}
    x = jax.random.normal(jax.random.key(1), (B, L, D), jnp.float32).astype(dtype)
    return x, params


def on_device(device, tree):
    return jax.device_put(tree, device)


def apply_on(device, x, params, cfg, topo=None):
    """The MoE block's output and aux on `device`: moe_apply's own layout choice, or `topo` under shard_map
    over a mesh of that one device (the expert-parallel code path, exchanges included)."""
    x, params = on_device(device, (x, params))
    w = ExpertWeights(params["w_in"], params["w_gate"], params["w_out"])
    if topo is None:
        return jax.jit(lambda x, r, w: moe_apply(x, r, w, cfg, None, train=True))(x, params["router"], w)
    mesh = jax.make_mesh((1,), ("expert",), devices=[device], axis_types=(AxisType.Auto,))

    def local(x, r, w):
        y, aux = moe_groups(x.reshape(1, -1, D), r, w.cast(x.dtype), cfg, topo, True, None)
        return y.reshape(x.shape).astype(x.dtype), aux

    spec = P("expert")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), ExpertWeights(spec, spec, spec)),
                            out_specs=(spec, P()))
    return jax.jit(sharded)(x, params["router"], w)


PATHS = {
    "capacity": dict(capacity_factor=1.25),
    "dropless ragged_dot": dict(capacity_factor=0.0, grouped_matmul="ragged_dot"),
    "dropless tiled": dict(capacity_factor=0.0, grouped_matmul="tiled"),
    "capacity, expert-parallel": dict(capacity_factor=1.25),
    "dropless, expert-parallel": dict(capacity_factor=0.0, grouped_matmul="ragged_dot"),
    "dropless megablox": dict(capacity_factor=0.0, grouped_matmul="megablox"),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_moe_path_matches_its_cpu_reference(chip, cpu, path):
    """Each path on the chip against the same block on the CPU (XLA's CPU program; the per-expert loop of
    moe_oracle for the dropless paths, which drop nothing), float32 at 'highest' precision."""
    cfg = MoEConfig(num_experts=8, top_k=2, d_ff=256, min_capacity=1, **PATHS[path])
    topo = None
    if "expert-parallel" in path:
        topo = core.Topology(expert_axis="expert", num_expert_shards=1, token_axes=("expert",),
                             exchange="padded" if chip.platform == "cpu" else "ragged",
                             grouped_matmul=cfg.grouped_matmul if cfg.grouped_matmul != "auto" else "ragged_dot")
    x, params = block_inputs(cfg)
    with jax.default_matmul_precision("highest"):
        got, aux = apply_on(chip, x, params, cfg, topo)
        # a Pallas kernel runs on the chip only: the CPU's reference takes the tiled path for it
        cpu_cfg = cfg.model_copy(update={"grouped_matmul": "tiled"}) if cfg.grouped_matmul == "megablox" else cfg
        want, want_aux = apply_on(cpu, x, params, cpu_cfg)
        if cfg.capacity_factor <= 0:
            oracle = oracle_moe(jax.device_put(x, cpu).reshape(-1, D), on_device(cpu, params), cfg)
            assert relative_error(got.reshape(-1, D), oracle) < RELATIVE
    assert relative_error(got, want) < RELATIVE
    assert float(aux["drop_fraction"]) == pytest.approx(float(want_aux["drop_fraction"]), abs=1e-6)
    np.testing.assert_allclose(np.asarray(aux["expert_load"]), np.asarray(want_aux["expert_load"]), atol=1e-6)


def test_ragged_dot_in_bfloat16_under_highest_precision_works(chip, cpu):
    """A user's jax.default_matmul_precision('highest') must not take the dropless path away: bfloat16 rows and
    weights under it compile and agree with the CPU (XLA's Mosaic kernel refuses fp32 contract precision on
    bf16 operands, so gmm.grouped_matmul states the precision of a bf16 product itself)."""
    cfg = MoEConfig(num_experts=8, top_k=2, d_ff=256, min_capacity=1, capacity_factor=0.0,
                    grouped_matmul="ragged_dot")
    x, params = block_inputs(cfg, jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        got, _ = apply_on(chip, x, params, cfg)
        want, _ = apply_on(cpu, x, params, cfg)
    assert got.dtype == jnp.bfloat16
    assert relative_error(got, want) < 2e-2


def test_a_few_training_steps_match_the_cpu_within_bfloat16(chip, cpu):
    """Three steps of tiny in bfloat16 from the same initial state on the same batch: the chip's losses within
    bfloat16's tolerance of the CPU's."""
    on_chip, on_cpu, cfg = tiny_trainers(chip, cpu, ("dtype=bfloat16",))
    losses = three_steps_each(on_chip, on_cpu, cfg)
    np.testing.assert_allclose(losses["chip"], losses["cpu"], rtol=BF16_LOSS)
    assert losses["chip"][-1] < losses["chip"][0]


def three_steps_each(on_chip, on_cpu, cfg) -> dict[str, list[float]]:
    """The losses of three steps on the chip and on the CPU from the CPU's initial state, on one batch thrice: its
    loss falls as the model fits it (random batches of uniform tokens differ from each other by more than three
    steps of warm-up learn: whether their losses fell depended on the initial draw)."""
    state_cpu = on_cpu.initial_state()
    state_chip = jax.device_put(state_cpu, on_chip.state_shardings)
    losses = {"chip": [], "cpu": []}
    batch = tokens_BxT(cfg, cfg.data.global_batch_size, seed=0)
    for _ in range(3):
        state_chip, metrics = on_chip.step_fn(state_chip, jax.device_put(batch, on_chip.batch_sharding))
        losses["chip"].append(float(metrics["loss"]))
        state_cpu, metrics = on_cpu.step_fn(state_cpu, jax.device_put(batch, on_cpu.batch_sharding))
        losses["cpu"].append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_splash_attention_matches_xla_forward_and_backward(chip, cpu, kv_heads):
    """The splash kernel on the chip against XLA's attention on the CPU, float32 at 'highest' precision: the
    output and the gradients of q, k and v (grouped-query too)."""
    shape = lambda heads: (2, 256, heads, 64)  # noqa: E731
    q, k, v = (jax.random.normal(jax.random.key(i), shape(h), jnp.float32) for i, h in ((0, 4), (1, kv_heads),
                                                                                          (2, kv_heads)))

    def loss(impl):
        return lambda q, k, v: jnp.sum(causal_attention(q, k, v, impl=impl) ** 2)

    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.value_and_grad(loss("splash"), argnums=(0, 1, 2)))(*on_device(chip, (q, k, v)))
        want = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(*on_device(cpu, (q, k, v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert relative_error(g, w) < 1e-4


def test_chunked_loss_and_the_chip_kernels_train_as_the_cpu(chip, cpu):
    """tiny at length 128 with splash attention, megablox and the loss in chunks on the chip: its losses
    within bfloat16's tolerance of XLA's attention, ragged_dot's reference and the whole loss on the CPU."""
    common = ("dtype=bfloat16", "data.seq_len=128", "moe.capacity_factor=0")
    chip_cfg = load_config("tiny", [*common, "model.attention=splash", "moe.grouped_matmul=megablox",
                                    "train.loss_chunk=32"])
    cpu_cfg = load_config("tiny", [*common, "model.attention=xla", "moe.grouped_matmul=tiled"])
    on_chip, on_cpu = build_trainer(chip_cfg, mesh_of(chip), 10), build_trainer(cpu_cfg, mesh_of(cpu), 10)
    losses = three_steps_each(on_chip, on_cpu, cpu_cfg)
    np.testing.assert_allclose(losses["chip"], losses["cpu"], rtol=BF16_LOSS)


def stacked_on(device, stack, x_MxK, block_group_NB):
    """Layer 1 of `stack` times x through the grouped matmul, traced on `device`'s own mesh: the kernels pick
    their path by the traced mesh's platform (the chip's Mosaic kernel, the CPU's XLA reference), not by the
    process's default backend, which on a TPU host is the chip's even for the CPU device's arrays."""
    from trainer.moe.gmm import grouped_matmul
    from trainer.moe.stacked import LayerOf

    def layer(s, x):
        with sharding.logical_mesh(mesh_of(device)):
            return grouped_matmul(x, LayerOf(s, jnp.int32(1)), block_group_NB, jnp.int32(8))

    return jax.jit(layer)(stack, jax.device_put(x_MxK, device))


@pytest.mark.parametrize("fmt, inputs", [("mxfp4", 256), ("int4", 1152)])
def test_the_stacked_grouped_matmul_reads_a_quantized_stack_as_the_cpu(chip, cpu, monkeypatch, fmt, inputs):
    """A layer of a quantized expert stack, on the chip and on the CPU (tokamax's XLA reference there); the same
    rows out. MXFP4 (FP4 values, a scale a block of 32 inputs: trainer/serve/mxfp4.py): on the chip the layer
    read widened (the Mosaic kernel's matrix unit takes no FP4 operand on a v5e). int4 in jnp.int4 (a float32
    scale a group of 128 inputs, 9 groups: the last tile of 1,024 inputs holds one): on the chip
    gmm.int4_grouped_matmul reading the scales as held."""
    from trainer.serve import mxfp4, quant4

    monkeypatch.setattr("sys.argv", ["pytest"])  # the kernel library parses no test runner's flags
    keys = jax.random.split(jax.random.key(0), 2)
    w = jax.random.normal(keys[0], (2, 8, inputs, 256), jnp.bfloat16) * 0.05  # [layers, experts, in, out]
    x_MxK = jax.random.normal(keys[1], (128, inputs), jnp.bfloat16)
    block_group_NB = jnp.arange(8, dtype=jnp.int32)  # blocks of 16 rows, one an expert of layer 1

    def run(device):
        held = (mxfp4.quantize_array("stacks.0.0.ffn.w_in", w) if fmt == "mxfp4"
                else quant4.quantize_array("stacks.0.0.ffn.w_in", w, storage="native"))
        return stacked_on(device, jax.device_put(held, device), x_MxK, block_group_NB)

    assert relative_error(run(chip), run(cpu)) < 1e-2


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_few_assignments_through_the_direct_kernel_match_the_cpu(chip, cpu, fmt):
    """A decode step's few assignments, each through its expert read from a quantized stack (trainer/moe/direct.py):
    on the chip by stacked_rows_product (int8: a scale an output channel; int4 in jnp.int4: a scale a group of 128
    inputs, 12 groups for the down projection), on the CPU by XLA's product of each expert's slice; the same
    output. One of the tokens routes twice to the same expert."""
    from trainer.moe.direct import direct_ffn
    from trainer.moe.stacked import LayerOf
    from trainer.serve import quant, quant4

    keys = jax.random.split(jax.random.key(1), 4)
    layers, experts, d, f = 2, 8, 1024, 1536
    shapes = ((layers, experts, d, f), (layers, experts, d, f), (layers, experts, f, d))
    stacks = [jax.random.normal(key, shape, jnp.bfloat16) * 0.05 for key, shape in zip(keys[:3], shapes, strict=True)]
    names = ("stacks.0.0.ffn.w_in", "stacks.0.0.ffn.w_gate", "stacks.0.0.ffn.w_out")
    x_TxD = jax.random.normal(keys[3], (2, d), jnp.bfloat16)
    experts_TxK = jnp.asarray([[3, 5], [6, 6]], jnp.int32)
    gates_TxK = jnp.asarray([[0.6, 0.4], [0.5, 0.5]], jnp.float32)

    def run(device, kernel):
        held = [quant.quantize_array(n, s) if fmt == "int8" else quant4.quantize_array(n, s, storage="native")
                for n, s in zip(names, stacks, strict=True)]

        def step(held, x):
            with sharding.logical_mesh(mesh_of(device)):
                w = ExpertWeights(*(LayerOf(h, jnp.int32(1)).astype(jnp.bfloat16) for h in held))
                return direct_ffn(x, experts_TxK, gates_TxK, w, "kernel" if kernel else "xla")

        return jax.jit(step)(jax.device_put(held, device), jax.device_put(x_TxD, device))

    assert relative_error(run(chip, True), run(cpu, False)) < 1e-2


def test_the_engine_draws_the_cpus_greedy_tokens_with_chunks_taken_along(chip, cpu):
    """The serving engine on the chip, where a prompt admitted while others decode goes with their decode step
    (serve --mixed-prefill's accelerator default), against the engine on the CPU with chunks in programs of
    their own: the same float32 weights at 'highest' precision, the same greedy tokens for every request."""
    from trainer.serve.engine import Engine, Request, SamplingParams
    from trainer.serve.weights import build_serving_model, init_weights

    cfg = load_config("tiny", [])
    rng = np.random.RandomState(7)
    prompts = [rng.randint(0, cfg.model.vocab_size, n).tolist() for n in (5, 70, 3, 130, 40, 9)]
    outputs = {}
    with jax.default_matmul_precision("highest"):
        on_cpu = build_serving_model(cfg, mesh_of(cpu))
        weights = init_weights(on_cpu)
        for device, mixed in ((cpu, False), (chip, True)):
            model = build_serving_model(cfg, mesh_of(device))
            placed = jax.device_put(weights, jax.tree.map(lambda a: a.sharding, model.abstract()))
            engine = Engine(model, placed, slots=4, max_len=192, chunk=16, mixed_prefill=mixed)
            requests = [engine.submit(Request(p, SamplingParams(max_tokens=12))) for p in prompts]
            engine.run()
            assert bool(any(name.startswith("mixed/") for name in engine.runner.calls)) == mixed
            outputs[mixed] = [r.output for r in requests]
    assert outputs[True] == outputs[False] and all(len(o) == 12 for o in outputs[True])


def test_an_int8_tables_rows_read_from_their_tiles_on_the_chip_are_its_rows(chip, cpu):
    """take_tiles (a decode step's rows of an int8 embedding, each from its memory tile, by a Pallas kernel) on
    the chip gives jnp.take's rows on the CPU, in the last, partial tile too."""
    from trainer.serve.quant import take_tiles

    table = jax.random.randint(jax.random.key(3), (1000, 1024), -127, 128, jnp.int32).astype(jnp.int8)
    indices = jnp.asarray([[999, 0, 517], [31, 32, 990]], jnp.int32)
    got = jax.jit(take_tiles)(jax.device_put(table, chip), jax.device_put(indices, chip))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(jax.device_put(table, cpu), indices, 0)))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_engine_on_quantized_weights_draws_the_cpus_greedy_tokens(chip, cpu, fmt):
    """The engine on int4 weights (jnp.int4 values, as a TPU holds them, quantized once on the CPU) or int8,
    `tiny` made 128 wide so that its groups are whole lane tiles, a dense layer and a MoE layer: on the chip a
    lone stream's decode layers unrolled (model.decode_layers' accelerator default), int4's attention projections
    group by group (Widened.contract_leading), a decode step's few assignments and the dense FFN's products
    through stacked_rows_product (the dense stack read in place: layer_product), int8's embedding rows through
    take_tiles, the rest XLA's products; on the CPU every product XLA's, the layers scanned. float32 at
    'highest' precision, the same greedy tokens for every request."""
    from jax.sharding import NamedSharding

    from trainer.serve import quant, quant4
    from trainer.serve.engine import Engine, Request, SamplingParams
    from trainer.serve.weights import build_serving_model, init_weights

    cfg = load_config("tiny", ["model.d_model=128", "moe.d_ff=128", "model.moe_every=2"])
    rng = np.random.RandomState(11)
    prompts = [rng.randint(0, cfg.model.vocab_size, n).tolist() for n in (4, 37, 2)]
    outputs = []
    with jax.default_matmul_precision("highest"):
        on_cpu = build_serving_model(cfg, mesh_of(cpu))
        weights = init_weights(on_cpu)
        held = {**weights, "params": quant4.quantize_params(weights["params"], storage="native") if fmt == "int4"
                else quant.quantize_params(weights["params"])}
        for device in (cpu, chip):
            model, mesh = build_serving_model(cfg, mesh_of(device)), mesh_of(device)
            placed = jax.tree.map(lambda a, m=mesh: jax.device_put(a, NamedSharding(m, a.sharding.spec)), held)
            engine = Engine(model, placed, slots=4, max_len=96, chunk=16)
            requests = [engine.submit(Request(p, SamplingParams(max_tokens=10))) for p in prompts]
            engine.run()
            outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1] and all(len(o) == 10 for o in outputs[0])
