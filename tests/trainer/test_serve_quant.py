"""int8 and int4 weights and the int8 KV cache: half (int8) or under 0.3x (int4) of bfloat16's bytes, and a
trained `tiny` predicts what it predicts in float on held-out sequences of its source, and on held-out text
of a corpus that `data prepare` made. MXFP4 experts hold MXFP4's grid exactly (a GPT-OSS served with them:
tests/trainer/test_hf_gpt_oss.py)."""

import functools
import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import sharding
from trainer.config import load_config
from trainer.data import make_source, open_data
from trainer.run_loader import load_run_config
from trainer.serve import mxfp4, quant4
from trainer.serve.engine import Engine, Request, SamplingParams
from trainer.serve.kvcache import KVCache
from trainer.serve.memory import memory_plan
from trainer.serve.quant import Int8Weight, quantize_params, weight_bytes
from trainer.serve.weights import build_serving_model, init_weights, restore_weights

pytestmark = pytest.mark.compile_bound


@pytest.fixture(scope="module")
def restored(trained_tiny):
    cfg = load_run_config(str(trained_tiny.output_dir / "config.json"))
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    weights, step = restore_weights(model, str(trained_tiny.output_dir / "checkpoints"))
    assert step == 120
    return model, weights, jax.jit(lambda w, t: model.module(w)(t, train=False)[0])


def held_out(rows: int, length: int):
    """Sequences of the source `tiny` trains on, from a batch index training never reached."""
    return make_source(load_config("tiny"), seed=0).rows(99, list(range(rows)))[:, :length]


def test_int8_weights_take_about_half_of_bfloat16_and_predict_as_float(restored):
    model, weights, forward = restored
    int8 = {**weights, "params": quantize_params(weights["params"])}
    quantized = [n for n, p in int8["params"].items() if isinstance(p, Int8Weight)]
    assert "stacks.0.0.ffn.w_in" in quantized and "stacks.0.0.ffn.router" not in quantized
    bf16_bytes = sum(p.size * 2 for p in weights["params"].values())
    assert weight_bytes(int8["params"]) <= 0.55 * bf16_bytes
    plan = memory_plan(model, 1, 1, "float32", True)  # the start-up plan counts the same bytes
    assert plan["weights"] == weight_bytes(int8["params"])
    agree, kl = agreement(forward, weights, int8, held_out(32, 64))  # 32 held-out sequences of 64 positions
    assert agree >= 0.9 and kl <= 0.02, (agree, kl)


def agreement(forward, weights, int8, rows_BxL) -> tuple[float, float]:
    """How often the int8 model's most likely next token is the float model's, and the mean KL divergence
    of its next-token distribution from the float one's, over every position of the rows."""
    rows_BxL = jnp.asarray(rows_BxL, jnp.int32)
    agree, kl = _agreement(forward(weights, rows_BxL), forward(int8, rows_BxL))
    return float(agree), float(kl)


@jax.jit  # one program, where op by op each operation compiled one of its own
def _agreement(logits_p, logits_q):
    logp, logq = jax.nn.log_softmax(logits_p, axis=-1), jax.nn.log_softmax(logits_q, axis=-1)
    return jnp.mean(jnp.argmax(logp, -1) == jnp.argmax(logq, -1)), jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1))


@pytest.fixture(scope="module")
def prepared(trained_on_prepared):
    """`tiny` trained on text that `data prepare` tokenized, and 32 sequences of its held-out share (the
    documents training never reads), 64 positions each."""
    cfg = load_run_config(str(trained_on_prepared.output_dir / "config.json"))
    assert cfg.data.source == "records" and cfg.model.vocab_size == 320
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    weights, step = restore_weights(model, str(trained_on_prepared.output_dir / "checkpoints"))
    assert step == 150
    _, make_eval = open_data(cfg, seed=0, with_eval=True)
    evaluation = make_eval()
    rows = np.concatenate([next(evaluation) for _ in range(2)])[:32, :64]
    assert rows.shape == (32, 64)
    return model, weights, jax.jit(lambda w, t: model.module(w)(t, train=False)[0]), rows


def test_int8_weights_predict_as_float_on_held_out_text_of_a_prepared_corpus(prepared):
    _, weights, forward, rows = prepared
    agree, kl = agreement(forward, weights, {**weights, "params": quantize_params(weights["params"])}, rows)
    assert agree >= 0.9 and kl <= 0.02, (agree, kl)


def test_int4_weights_take_under_0_3x_of_bfloat16_and_predict_as_float_on_held_out_text(prepared):
    model, weights, forward, rows = prepared
    assert (quant4.storage_for("cpu"), quant4.storage_for("tpu")) == ("nibbles", "native")
    int4 = {**weights, "params": quant4.quantize_params(weights["params"])}  # the CPU's storage: nibbles
    w_in = int4["params"]["stacks.0.0.ffn.w_in"]  # [layers, E, D, F], 2 x 8 x 64 x 64: grouped along D, 2 a byte
    assert isinstance(w_in, quant4.Int4Weight) and w_in.packed.dtype == jnp.uint8
    assert (w_in.packed.shape, w_in.scale.shape) == ((2, 8, 32, 64), (2, 8, 1, 64))
    assert not isinstance(int4["params"]["stacks.0.0.ffn.router"], quant4.Int4Weight)
    bf16_bytes = sum(p.size * 2 for p in weights["params"].values())
    assert weight_bytes(int4["params"]) <= 0.3 * bf16_bytes
    assert memory_plan(model, 1, 1, "float32", "int4")["weights"] == weight_bytes(int4["params"])
    agree, kl = agreement(forward, weights, int4, rows)
    assert agree >= 0.8 and kl <= 0.05, (agree, kl)
    # jnp.int4 storage (a TPU's) holds the same values and scales: the same logits
    native = {**weights, "params": quant4.quantize_params(weights["params"], storage="native")}
    assert native["params"]["stacks.0.0.ffn.w_in"].values.dtype == jnp.int4
    tokens_BxL = jnp.asarray(rows, jnp.int32)
    np.testing.assert_array_equal(np.asarray(forward(native, tokens_BxL)), np.asarray(forward(int4, tokens_BxL)))


def test_quantized_weights_are_widened_a_layer_at_a_time_inside_the_compiled_step(restored):
    """The forward pass's scratch (XLA's compiled memory analysis) at int8 and int4 exceeds float's by less
    than one layer's float weights: the stacked weights enter the layer loop as integers, never as a float
    copy of the whole stack (which took 1.47 MB here against float's 0.49 MB)."""
    model, weights, forward = restored
    tokens_1xL = jnp.zeros((1, 8), jnp.int32)

    def scratch(params) -> int:
        return forward.lower({**weights, "params": params}, tokens_1xL).compile().memory_analysis().temp_size_in_bytes

    temp = {"float": scratch(weights["params"]), "int8": scratch(quantize_params(weights["params"])),
            "int4": scratch(quant4.quantize_params(weights["params"]))}
    layer = sum(p.nbytes for n, p in weights["params"].items() if n.startswith("stacks.")) / model.cfg.model.num_layers
    assert temp["int8"] - temp["float"] < layer and temp["int4"] - temp["float"] < layer, (temp, layer)


def test_a_quantized_load_holds_less_than_the_float_model_and_what_the_fit_check_counts(restored, trained_tiny):
    """Loading at int8 reads and quantizes one array at a time: the device buffers alive as each float array
    arrives (jax.live_arrays: the quantized ones before it and itself) stay within the start-up plan's weights
    + loading, below the float model's size, and the weights are the float ones quantized."""
    model, weights, _ = restored
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    peaks = []

    def held(name):
        peaks.append(sum(a.nbytes for a in jax.live_arrays() if id(a) not in before))

    int8, _ = restore_weights(model, str(trained_tiny.output_dir / "checkpoints"), "int8", on_array=held)
    assert len(peaks) == len(model.codec.names)
    plan = memory_plan(model, 1, 1, "float32", "int8")
    float_bytes = sum(p.nbytes for p in weights["params"].values())
    assert max(peaks) <= plan["weights"] + plan["loading"] < float_bytes, (max(peaks), plan, float_bytes)
    w_in = int8["params"]["stacks.0.0.ffn.w_in"]
    np.testing.assert_array_equal(np.asarray(w_in.values),
                                  np.asarray(quantize_params(weights["params"])["stacks.0.0.ffn.w_in"].values))


def test_the_int8_kv_cache_decodes_close_to_float(restored):
    model, weights, forward = restored
    engine = Engine(model, weights, slots=2, max_len=64, chunk=8, kv_dtype="int8")
    assert engine.cache.k.dtype == jnp.int8
    m = model.cfg.model
    # int8 values and a float32 scale per (position, head): (16 + 4) / 64 bytes of float32 at head size 16
    assert KVCache.nbytes(m.num_layers, 2, 64, m.kv_heads, m.head_size, "int8") <= \
        (20 / 64) * KVCache.nbytes(m.num_layers, 2, 64, m.kv_heads, m.head_size, "float32")
    requests = [engine.submit(Request(row[:12].tolist(), SamplingParams(max_tokens=40))) for row in held_out(4, 12)]
    engine.run()
    # Each generated token against the float model's greedy choice after the same tokens (teacher forcing,
    # through the forward pass compiled above: rows padded to its 32 x 64).
    tokens_BxL = np.zeros((32, 64), np.int32)
    for i, r in enumerate(requests):
        tokens_BxL[i, :52] = r.prompt + r.output
    best_BxL = np.asarray(jnp.argmax(forward(weights, jnp.asarray(tokens_BxL)), -1))
    agree = np.mean([best_BxL[i, 11:51] == np.asarray(r.output) for i, r in enumerate(requests)])
    assert agree >= 0.9, agree


@pytest.mark.parametrize("name,shape", [("embed", (6, 256)), ("blocks.0.attn.wo", (4, 16, 8)),
                                        ("blocks.0.ffn.w_out", (3, 384, 5)), ("blocks.0.attn.wq", (96, 2, 4)),
                                        ("stacks.0.1.ffn.w_out", (2, 3, 384, 5)),
                                        ("stacks.0.0.attn.wo", (3, 4, 16, 8))])
@pytest.mark.parametrize("storage", quant4.STORAGES)
def test_int4_weights_on_the_grid_come_back_exactly(name, shape, storage):
    """A weight whose every group is a scale (a power of two: exact in float) times integers of -7..7, 7
    among them, is its own int4 rounding: unpacked, it must come back bit for bit (the nibbles' order and
    sign, the groups' axis and length)."""
    axis = quant4.group_axis(name, shape)
    group = quant4.group_size(shape[axis])
    groups = shape[axis] // group
    rng = np.random.default_rng(0)
    q = rng.integers(-7, 8, (*shape[:axis], groups, group, *shape[axis + 1:]))
    q[(slice(None),) * (axis + 1) + (0,)] = 7  # each group's first value
    scale_shape = (*shape[:axis], groups, *shape[axis + 1:])
    scale = np.repeat(2.0 ** rng.integers(-8, 0, scale_shape), group, axis=axis)
    w = np.asarray(q.reshape(shape) * scale, np.float32)

    @jax.jit  # as quantize_array jits it: op by op, each of its operations would compile a program of its own
    def round_trip(w):
        stored = quant4.quantize_weight(w, axis, storage)
        return stored, stored.dequantize()

    stored, widened = round_trip(w)
    assert stored.arrays_of()[0].size * {"nibbles": 2, "native": 1}[storage] == w.size
    assert stored.scale.shape == scale_shape
    np.testing.assert_array_equal(np.asarray(widened), w)


def test_int4_weights_split_over_expert_and_model_as_the_float_ones_and_predict_as_on_one_device():
    """On expert=2,model=4 (8 fake devices) each packed weight and its scales keep the weight's split where
    it divides them, a device holds what the start-up memory check counts, and the forward pass returns
    the one-device int4 model's logits."""
    cfg = load_config("tiny", ["model.num_layers=1"])
    one = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    tp = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 2, "model": 4}, jax.devices()[:8]))
    weights = init_weights(one)
    placed = jax.device_put(weights, {k: tp.shardings[k] for k in weights})
    int4, tp_int4 = ({**w, "params": quant4.quantize_params(w["params"])} for w in (weights, placed))
    w_out = tp_int4["params"]["stacks.0.0.ffn.w_out"]  # [1, E, F, D], F over model: 64 / 2 packed, a group of 64
    assert w_out.packed.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "model")
    assert w_out.packed.addressable_shards[0].data.shape == (1, 4, 8, 64)
    assert w_out.scale.sharding.spec == jax.sharding.PartitionSpec(None, "expert")  # its one group is not split
    on_device_0 = sum(s.data.nbytes for leaf in jax.tree.leaves(tp_int4["params"]) for s in leaf.addressable_shards
                      if s.device == jax.devices()[0])
    assert memory_plan(tp, 1, 1, "float32", "int4")["weights"] == on_device_0
    tokens_BxL = jnp.asarray(held_out(2, 16), jnp.int32)
    logits = [jax.jit(lambda w, t, m=m: m.module(w)(t, train=False)[0])(w, tokens_BxL)
              for m, w in ((one, int4), (tp, tp_int4))]
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(logits[0]), atol=1e-4)


def test_decoding_reads_each_layers_experts_from_the_whole_stack_and_draws_the_same_tokens(restored, monkeypatch):
    """Through the grouped matmul that takes a layer of the stacked expert weights whole (trainer/moe/stacked.py:
    tokamax's ragged dot over [layers * experts] groups, its XLA reference on a CPU, the Mosaic kernel on a
    TPU) the engine draws the tokens it draws with each assignment's expert read directly (trainer/moe/direct.py,
    the default at 4 slots of top-2: 8 assignments), the experts held as int8 integers and scales (the other
    formats: the next tests, a layer's product alone)."""
    model, weights, _ = restored
    monkeypatch.setattr("sys.argv", ["moe-tpu", "serve", "--checkpoint", "ckpt"])  # the kernel library reads no argv
    params = quantize_params(weights["params"])
    assert model.cfg.moe.direct_assignments >= 4 * model.cfg.moe.top_k
    cfg = model.cfg.model_copy(update={"moe": model.cfg.moe.model_copy(update={"grouped_matmul": "ragged_dot",
                                                                                "direct_assignments": 0})})
    stacked = build_serving_model(cfg, model.mesh)

    def tokens(serving_model):
        engine = Engine(serving_model, {**weights, "params": params}, slots=4, max_len=32, chunk=16, min_span=32)
        requests = [engine.submit(Request(row.tolist(), SamplingParams(max_tokens=12))) for row in held_out(4, 12)]
        engine.run()
        return engine, [r.output for r in requests]

    engine, whole = tokens(stacked)
    assert whole == tokens(model)[1]
    runner = engine.runner
    decode = runner.program(f"decode/{runner.spans()[-1]}/4").lower(runner.weights, runner.cache,
                                                                  *runner.decode_inputs(4, False))
    m = cfg.model  # the kernel's weight: every MoE layer's experts (tiny: one stack) as one [layers * experts] operand
    text = decode.as_text(debug_info=True)
    assert "tokamax" in text and f"tensor<{m.num_moe_layers * cfg.moe.num_experts}x{m.d_model}x" in text


def test_a_decode_step_runs_its_layers_unrolled_where_decode_layers_says_and_draws_the_same_tokens(restored):
    """model.decode_layers=unrolled: a lone stream's decode program runs the layers one after another (each
    reading its slice of the stacked int4 weights where it lies), every slot's and the prefill's still scan
    them; the engine draws the scanned decode's tokens. auto on a CPU scans (the tests' and dry runs' compile
    time)."""
    model, weights, _ = restored
    params = quant4.quantize_params(weights["params"], storage="native")

    def engine_of(decode_layers):
        layers = model.cfg.model.model_copy(update={"decode_layers": decode_layers})
        cfg = model.cfg.model_copy(update={"model": layers})
        return Engine(build_serving_model(cfg, model.mesh), {**weights, "params": params}, slots=2, max_len=32,
                      chunk=16, min_span=32)

    def loops(runner):  # the while loops of the lone decode step's program, every slot's and the prefill's
        return {name: runner.program(name).lower(runner.weights, runner.cache, *runner.example_inputs(name))
                .as_text().count("stablehlo.while") for name in ("decode/32/1", "decode/32/2", "prefill/32")}

    def tokens(engine):
        requests = [engine.submit(Request(row.tolist(), SamplingParams(max_tokens=8))) for row in held_out(2, 12)]
        engine.run()
        return [r.output for r in requests]

    scanned, unrolled = engine_of("scan"), engine_of("unrolled")
    assert tokens(unrolled) == tokens(scanned)
    scanned_loops = loops(scanned.runner)
    (decode, both, prefill), (decode_unrolled, both_unrolled, prefill_unrolled) = (
        scanned_loops.values(), loops(unrolled.runner).values())
    assert unrolled.runner.rows() == [1, 2]
    assert decode_unrolled < decode and both_unrolled == both > 0 and prefill_unrolled == prefill > 0, (
        decode_unrolled, decode, both, prefill)
    assert loops(engine_of("auto").runner) == scanned_loops


@jax.jit
def widened(w):
    """A LayerOf's layer as the layer reads its own slice (LayerOf.read), in float32: in one program, where op by op
    every layer's read dispatched each of its operations anew."""
    return w.read().astype(jnp.float32)


@pytest.mark.parametrize("fmt", ["float", "int8", "int4-native", "mxfp4"])
def test_a_layers_grouped_product_from_the_whole_stack_is_the_product_with_its_own_slice(fmt):
    """stacked_matmul (the stack as [layers * experts] groups, other layers' groups empty; int8's row scales
    applied after, int4 and MXFP4 as QArrays) against ragged_dot over the layer's widened slice, for each
    layer; rows past the groups come back zero."""
    from trainer.moe.gmm import stacked_matmul
    from trainer.moe.stacked import LayerOf

    rng = np.random.default_rng(1)
    layers, experts, inputs, outputs, rows = 3, 4, 64, 48, 40
    w = jnp.asarray(rng.normal(0, 0.05, (layers, experts, inputs, outputs)), jnp.float32)
    name = "stacks.0.0.ffn.w_in"  # a routed experts' stacked weight, [layers, experts, in, out]
    held = {"float": lambda a: a, "int8": lambda a: quantize_params({name: a})[name],
            "int4-native": lambda a: quant4.quantize_params({name: a}, storage="native")[name],
            "mxfp4": lambda a: mxfp4.quantize_params({name: a})[name]}[fmt](w)
    x = jnp.asarray(rng.normal(0, 1, (rows, inputs)), jnp.float32)
    sizes = jnp.asarray([9, 0, 17, 6], jnp.int32)  # 32 rows in groups, 8 past them
    for layer in range(layers):
        stacked = LayerOf(held, jnp.int32(layer))
        got = jax.jit(stacked_matmul)(x, stacked, sizes)  # one program (the layer is an operand), not op by op
        want = jax.lax.ragged_dot(x, widened(stacked), sizes.at[-1].add(rows - 32), precision="highest")
        np.testing.assert_allclose(np.asarray(got[:32]), np.asarray(want[:32]), rtol=1e-5, atol=1e-5)
        assert not np.any(np.asarray(got[32:]))


@pytest.mark.parametrize("fmt, kernel", [("float", False), ("int8", False), ("int8", True), ("int4-native", False),
                                         ("int4-native", True), ("int4-nibbles", False), ("mxfp4", False)])
def test_a_few_assignments_read_their_experts_directly_as_the_exact_ffn(fmt, kernel):
    """direct_ffn (each assignment's expert sliced from the whole stack, in the form it is held; int8 and int4
    stacks also through the TPU's kernel, in Pallas' interpreter) against the FFN of float64 products with the
    layer's widened slice, for every layer; with the experts' biases and GPT-OSS's clamped gating as plain
    [experts, ...] arrays."""
    from trainer.moe.direct import direct_ffn
    from trainer.moe.stacked import LayerOf
    from trainer.moe.weights import Activation, ExpertWeights

    rng = np.random.default_rng(2)
    layers, experts, d, f = 3, 4, 256, 384  # int4: 2 and 3 groups of 128 inputs
    names = ("stacks.0.0.ffn.w_in", "stacks.0.0.ffn.w_gate", "stacks.0.0.ffn.w_out")
    stacks = [jnp.asarray(rng.normal(0, 0.05, shape), jnp.float32)
              for shape in ((layers, experts, d, f), (layers, experts, d, f), (layers, experts, f, d))]
    quantized = {"float": lambda n, a: a, "int8": lambda n, a: quantize_params({n: a})[n],
                 "int4-native": lambda n, a: quant4.quantize_params({n: a}, storage="native")[n],
                 "int4-nibbles": lambda n, a: quant4.quantize_params({n: a}, storage="nibbles")[n],
                 "mxfp4": lambda n, a: mxfp4.quantize_params({n: a})[n]}[fmt]
    held = [quantized(n, a) for n, a in zip(names, stacks, strict=True)]
    x = jnp.asarray(rng.normal(0, 1, (3, d)), jnp.float32)
    experts_TxK = jnp.asarray([[1, 3], [2, 1], [0, 0]], jnp.int32)  # the last token twice the same expert
    gates_TxK = jnp.asarray([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]], jnp.float32)

    def want(ws, activation=lambda g, h: g / (1 + np.exp(-g)) * h, biases=None):
        out = np.zeros((x.shape[0], d))
        for t in range(x.shape[0]):
            for k in range(2):
                e, x64 = int(experts_TxK[t, k]), np.asarray(x[t], np.float64)
                h, g = x64 @ ws[0][e], x64 @ ws[1][e]
                if biases is not None:
                    h, g = h + biases[0][e], g + biases[1][e]
                y = activation(g, h) @ ws[2][e] + (0 if biases is None else biases[2][e])
                out[t] += float(gates_TxK[t, k]) * y
        return out

    for layer in range(layers):
        layer_of = [LayerOf(h, jnp.int32(layer)).astype(jnp.float32) for h in held]
        args = (x, experts_TxK, gates_TxK, ExpertWeights(*layer_of), "kernel" if kernel else "xla")
        got = jax.jit(direct_ffn, static_argnums=4)(*args)
        if layer == 0:  # the layer is an operand (LayerOf.index): every layer's program is this one
            assert ("pallas_call" in str(jax.make_jaxpr(direct_ffn, static_argnums=4)(*args))) == kernel
        np.testing.assert_allclose(np.asarray(got), want([np.asarray(widened(w), np.float64) for w in layer_of]),
                                   rtol=1e-5, atol=1e-6)
    if fmt == "float":  # GPT-OSS: biases and the clamped gating, the weights as one layer's arrays
        biases = [jnp.asarray(rng.normal(0, 0.5, (experts, n)), jnp.float32) for n in (f, f, d)]
        clamped = Activation(clamped=True, alpha=1.702, limit=0.5)
        arrays = [a[1] for a in stacks]
        got = jax.jit(direct_ffn, static_argnums=4)(x, experts_TxK, gates_TxK,
                                                    ExpertWeights(*arrays, *biases, activation=clamped), "kernel")

        def gpt_oss(g, h):
            g, h = np.minimum(g, 0.5), np.clip(h, -0.5, 0.5)
            return (h + 1) * g / (1 + np.exp(-1.702 * g))

        np.testing.assert_allclose(np.asarray(got), want([np.asarray(a, np.float64) for a in arrays], gpt_oss,
                                                         [np.asarray(b, np.float64) for b in biases]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4-native", "int4-nibbles"])
@pytest.mark.parametrize("rows", [1, 11])
def test_a_dense_layer_reads_its_quantized_stack_in_place_as_its_slice(fmt, rows):
    """A dense FFN's weight kept as its whole quantized stack in a serving step (split_stacks: [layers, 1, in,
    out]) and read through layer_product: with the kernel (Pallas' interpreter on a CPU) and through XLA's
    product of the layer's slice as held, both the float64 product of the layer's widened weight; prefill's
    rows past LAYER_ROWS go to XLA."""
    from trainer.moe.direct import LAYER_ROWS, layer_product
    from trainer.moe.stacked import split_stacks, with_layer

    rng = np.random.default_rng(5)
    layers, d, f = 3, 256, 384
    name = "stacks.0.0.ffn.w_out"
    stack = jnp.asarray(rng.normal(0, 0.05, (layers, f, d)), jnp.float32)
    held = {"int8": lambda: quantize_params({name: stack})[name],
            "int4-native": lambda: quant4.quantize_params({name: stack}, storage="native")[name],
            "int4-nibbles": lambda: quant4.quantize_params({name: stack}, storage="nibbles")[name]}[fmt]()
    from flax import nnx

    params = nnx.State({"0": {"ffn": {"w_out": nnx.Param(held), "w_bias": nnx.Param(stack[:, 0])}}})
    kept, whole = split_stacks(params, layers)
    assert list(whole) == [("0", "ffn", "w_out")] and kept["0"]["ffn"]["w_out"].get_value().shape == (layers,)
    x = jnp.asarray(rng.normal(0, 1, (rows, 1, f)), jnp.float32)
    for layer in range(layers):
        w = with_layer(kept, whole, jnp.int32(layer))["0"]["ffn"]["w_out"].get_value()
        want = np.asarray(x, np.float64) @ np.asarray(widened(w)[0], np.float64)
        for products in ("kernel", "xla"):
            got = jax.jit(layer_product, static_argnums=(2, 3))(x, w, jnp.float32, products)
            if layer == 0:  # every layer's slice has the same shapes: the same program
                jaxpr = str(jax.make_jaxpr(layer_product, static_argnums=(2, 3))(x, w, jnp.float32, products))
                assert ("pallas_call" in jaxpr) == (products == "kernel" and fmt != "int4-nibbles")  # no nibble kernel
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    long = jnp.ones((LAYER_ROWS + 1, f), jnp.float32)
    assert "pallas_call" not in str(jax.make_jaxpr(layer_product, static_argnums=(2, 3))(long, w, jnp.float32,
                                                                                          "kernel"))


def test_int4_grouped_kernel_reads_the_held_scales_and_equals_the_exact_product():
    """The TPU's int4 grouped matmul (gmm.int4_grouped_matmul, through Pallas' interpreter) over float32 scales
    as the stack holds them: each row's product with its group's integers times their scales rounded to
    bfloat16, to float32's precision, with a last tile of inputs that holds one scale of its eight, empty
    groups and groups sharing a tile of rows; the shapes it takes (a tile's scales: 8 rows, or all)."""
    from trainer.moe.gmm import int4_grouped_matmul, int4_kernel_fits

    rng = np.random.default_rng(2)
    groups, inputs, outputs, rows = 4, 1152, 128, 16
    q = rng.integers(-7, 8, (groups, inputs, outputs))
    scale = rng.uniform(1e-3, 2e-2, (groups, inputs // 128, outputs)).astype(np.float32)
    x = jnp.asarray(rng.normal(0, 1, (rows, inputs)), jnp.bfloat16)
    sizes = np.array([5, 0, 6, 3])
    kernel = jax.jit(functools.partial(int4_grouped_matmul, tiles=(8, 1024, 128), interpret=True))  # not op by op
    got = kernel(x, jnp.asarray(q, jnp.int4), jnp.asarray(scale), jnp.asarray(sizes, jnp.int32))
    group = np.repeat(np.arange(groups), sizes)
    rounded = np.asarray(jnp.asarray(scale, jnp.bfloat16), np.float64)
    w = q[group] * np.repeat(rounded[group], 128, axis=1)
    want = np.einsum("mk,mkn->mn", np.asarray(x, np.float64)[:sizes.sum()], w)
    np.testing.assert_allclose(np.asarray(got[:sizes.sum()]), want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert int4_kernel_fits(1024, 8, 1024) and int4_kernel_fits(2816, 22, 1024) and int4_kernel_fits(512, 4, 512)
    assert not int4_kernel_fits(384, 3, 256) and not int4_kernel_fits(192, 3, 192)  # 2 scales a tile; 64 inputs


def test_mxfp4_weights_on_the_grid_come_back_exactly_and_as_the_hub_dequantises_them():
    """A stacked experts' weight whose every block of 32 inputs is a power of two times FP4 values, a 6 or a 4
    among them, is its own MXFP4: its values and scale bytes come back bit for bit; Hub bytes dequantised as
    trainer/hf/mxfp4.py does (transformers' way) come back as the same bfloat16 values; anything else stays."""
    from trainer.hf import mxfp4 as hub

    rng = np.random.default_rng(0)
    layers, experts, inputs, outputs = 2, 3, 96, 5
    codes = rng.integers(0, 16, (layers, experts, inputs // 32, 32, outputs))
    codes[:, :, :, 0] = rng.choice([6, 7, 14, 15], (layers, experts, inputs // 32, outputs))  # 4 or 6, signed
    exponents = rng.integers(-12, 3, (layers, experts, inputs // 32, 1, outputs))
    w = jnp.asarray((hub.FP4_VALUES[codes] * 2.0 ** exponents).reshape(layers, experts, inputs, outputs))
    held = mxfp4.quantize_array("stacks.0.0.ffn.w_in", w)
    assert held.values.dtype == jnp.float4_e2m1fn and held.scale.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(held.scale), exponents[:, :, :, 0] + 127)
    np.testing.assert_array_equal(np.asarray(held.dequantize()), np.asarray(w))
    assert held.nbytes * 8 == w.size * 4.25
    assert memory_plan_bytes("stacks.0.0.ffn.w_in", w) == held.nbytes
    # The Hub's layout: blocks [E, out, in / 32, 16] and scales [E, out, in / 32], any bytes
    blocks = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (experts, outputs, inputs // 32), dtype=np.uint8)
    theirs = hub.dequantized(blocks, scales)  # bfloat16 [E, in, out]
    ours = mxfp4.quantize_array("blocks.0.ffn.w_out", jnp.asarray(theirs)).dequantize()
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours).view(np.int16), theirs.view(np.int16))
    dense = jnp.ones((64, 8), jnp.bfloat16)
    assert mxfp4.quantize_array("blocks.0.ffn.w_in", dense) is dense  # a dense FFN's weight: kept
    with pytest.raises(ValueError, match=r"blocks.0.ffn.w_in \[4, 48, 8\] has 48 inputs an output"):
        mxfp4.quantize_array("blocks.0.ffn.w_in", jnp.ones((4, 48, 8)))


def memory_plan_bytes(name: str, w: jax.Array) -> int:
    """What the start-up memory check counts of one weight held in MXFP4 on one device."""
    from trainer.serve.memory import weight_shard_bytes

    one = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    return weight_shard_bytes(name, w, jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec()), "mxfp4")


@pytest.mark.parametrize("rows", [2, 300])  # a decode step's few rows; a prefill's, more than a group's values
@pytest.mark.parametrize("storage", quant4.STORAGES)
@pytest.mark.parametrize("name", ["head", "embed"])
def test_an_int4_heads_group_by_group_product_is_the_widened_weights(storage, name, rows):
    """The head's logits from an int4 weight group by group (Widened.contract: integers in the matmul, scales
    after) against the widened weight's product, for the head [d_model, vocab] and the tied embedding [vocab,
    d_model] read transposed."""
    rng = np.random.default_rng(2)
    shape = (256, 96) if name == "head" else (96, 256)
    w = jnp.asarray(rng.normal(0, 0.05, shape), jnp.float32)
    held = quant4.quantize_params({name: w}, storage=storage)[name]
    x = jnp.asarray(rng.normal(0, 1, (3, rows, 256)), jnp.float32)
    got, whole = jax.jit(lambda held, x: (held.contract(x, jnp.float32), held[...]))(held, x)  # not op by op
    want = jnp.einsum("bld,dv->blv", x, whole if name == "head" else whole.T, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, shape, n", [("head", (256, 96), 1), ("embed", (96, 256), 1),
                                            ("wq", (256, 4, 8), 1), ("wo", (4, 8, 64), 2)])
def test_an_int8_weights_product_scales_after_the_integers_and_is_the_exact_product(name, shape, n):
    """An int8 weight's product (Int8Weight.contract and contract_leading: the integers through the matmul,
    each output channel scaled after) against a float64 product with the weight its integers and scales make:
    the head [d_model, vocab], the tied embedding [vocab, d_model] read as the head, a q projection and wo
    contracting two axes. Float32 out whatever the compute dtype (logits are not rounded to bfloat16)."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(0, 0.05, shape), jnp.float32)
    held = quantize_params({name: w})[name]
    assert isinstance(held, Int8Weight)
    exact = np.asarray(held.values, np.float64) * np.asarray(held.scale, np.float64)
    width = 256 if name == "embed" else math.prod(shape[:n])
    x = rng.normal(0, 1, (3, 5, width))
    if name == "embed":
        want, got = x @ exact.T, held.contract(jnp.asarray(x, jnp.float32), jnp.float32)
    elif n == 1 and len(shape) == 2:
        want, got = x @ exact, held.contract(jnp.asarray(x, jnp.float32), jnp.float32)
    else:
        xs = x.reshape(3, 5, *shape[:n])
        want = np.tensordot(xs, exact, n)
        got = held.contract_leading(jnp.asarray(xs, jnp.float32), n, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    low = held.contract(jnp.asarray(x, jnp.bfloat16), jnp.bfloat16) if n == 1 and len(shape) == 2 else \
        held.contract_leading(jnp.asarray(x.reshape(3, 5, *shape[:n]), jnp.bfloat16), n, jnp.bfloat16)
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(low), want, rtol=0.05, atol=0.05)
