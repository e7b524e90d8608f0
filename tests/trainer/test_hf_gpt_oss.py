"""GPT-OSS held to transformers: a tiny random GptOssForCausalLM (four layers, sliding windows of 8 and full
attention alternating, attention sinks, q/k/v/o biases, YaRN, experts with biases and the clamped SwiGLU, a
router with a bias) is imported and must give transformers' logits over sequences five windows long, and its
greedy continuations through the serving engine; bfloat16 import then export gives back every tensor bit for
bit, and MXFP4 experts import as transformers dequantises them."""

import functools
import json

import numpy as np
import pytest
from hf_models import (
    VOCAB,
    hf_model,
    one_torch_thread,  # noqa: F401 - autouse: torch on one thread here
    safetensors_of,
    trainer_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.hf.convert import export_checkpoint, import_checkpoint  # noqa: E402
from trainer.hf.errors import HFError  # noqa: E402

pytestmark = pytest.mark.compile_bound
LENGTH, WINDOW = 40, 8  # five sliding windows
# Harmony's special tokens at the top of the tiny vocabulary (o200k_harmony's ids are 200002 and on).
HARMONY = {"<|return|>": VOCAB - 7, "<|start|>": VOCAB - 6, "<|end|>": VOCAB - 5, "<|message|>": VOCAB - 4,
           "<|channel|>": VOCAB - 3, "<|call|>": VOCAB - 2}


def harmony_tokenizer(path) -> None:
    """A word-level tokenizer.json whose ids below the harmony tokens are words w1, w2, ..."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, min(HARMONY.values()))}, **HARMONY}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in HARMONY])
    tokenizer.save(str(path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the transformers model, the directory holding its save `hub` and the import of it `imported`)."""
    tmp = tmp_path_factory.mktemp("gpt_oss")
    model = hf_model("gpt_oss")
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    model.save_pretrained(tmp / "hub")
    harmony_tokenizer(tmp / "hub" / "tokenizer.json")
    (tmp / "hub" / "tokenizer_config.json").write_text(json.dumps({"chat_template": HARMONY_TEMPLATE}))
    done = import_checkpoint(str(tmp / "hub"), str(tmp / "imported"))
    assert done["family"] == "gpt_oss" and done["layouts"] == ["fused"]
    return model, tmp


@functools.cache
def _forward():
    """One jitted forward for the module's models (one shape: compiled once)."""
    import jax
    from flax import nnx

    return jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens, train=False)[0],
                   static_argnums=0)


def _logits(run_dir, tokens) -> np.ndarray:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    jax.config.update("jax_default_matmul_precision", "highest")
    graphdef, state = nnx.split(trainer_model(str(run_dir))[0])
    return np.asarray(_forward()(graphdef, state, jnp.asarray(tokens)))


def _theirs(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def test_logits_equal_transformers(imported):
    model, tmp = imported
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH))
    ours, theirs = _logits(tmp / "imported", tokens), _theirs(model, tokens)
    assert np.abs(ours - theirs).max() <= 1e-4 and np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_logits_at_initializer_range_0_2_stay_within_1e_3(tmp_path):
    """Weights ten times larger: sharper attention (sinks included), routing and clamped experts."""
    model = hf_model("gpt_oss", seed=6, initializer_range=0.2)
    model.save_pretrained(tmp_path / "hub")
    import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, LENGTH))
    ours, theirs = _logits(tmp_path / "imported", tokens), _theirs(model, tokens)
    assert np.abs(ours - theirs).max() <= 1e-3 and np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_generation_through_the_serving_engine_equals_transformers(imported):
    """4 prompts of 12 tokens (longer than the window), prefilled in chunks of 8, then 32 greedy tokens each
    through the key/value cache, against transformers' generate(do_sample=False); on 4 devices, the experts
    split over `expert` and the heads (their sinks too) and the experts' hidden units over `model` (the down
    projection's bias added once)."""
    import jax

    from trainer import sharding
    from trainer.hf.orbax_io import open_run
    from trainer.serve.engine import Engine, Request, SamplingParams
    from trainer.serve.weights import build_serving_model, restore_weights

    model, tmp = imported
    prompts, new = np.random.default_rng(5).integers(0, VOCAB, (4, 12)), 32
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                  do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    served = build_serving_model(open_run(str(tmp / "imported"), None).cfg,
                                 sharding.make_mesh({"data": 1, "expert": 2, "model": 2}, jax.devices()[:4]))
    weights, _ = restore_weights(served, str(tmp / "imported" / "checkpoints"))
    max_len = prompts.shape[1] + new
    engine = Engine(served, weights, slots=4, max_len=max_len, chunk=WINDOW, min_span=max_len)  # one span
    requests = [engine.submit(Request(p.tolist(), SamplingParams(max_tokens=new, temperature=0.0))) for p in prompts]
    engine.run()
    expected = expected[:, prompts.shape[1]:].tolist()
    assert [r.output for r in requests] == expected
    # A further end token (as <|call|> is GPT-OSS's) ends a request where it is drawn, as the eos does.
    engine.output.stop_ids = frozenset({expected[0][5]})
    again = engine.submit(Request(prompts[0].tolist(), SamplingParams(max_tokens=new, temperature=0.0)))
    engine.run()
    assert again.output == expected[0][:expected[0].index(expected[0][5]) + 1] and again.eos


def test_return_and_call_stop_generation_besides_the_eos(imported):
    """The import keeps generation_config.json's eos list; `<|return|>` and `<|call|>` stop generation (the
    list's others and harmony's turn ends found in the tokenizer), `<|return|>` the eos."""
    from tokenizers import Tokenizer

    from trainer.outputs import RunDirectory
    from trainer.sidefiles import eos_token_id, stop_token_ids

    _, tmp = imported
    run = RunDirectory.at(str(tmp / "imported"))
    (tmp / "imported" / "hf" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [HARMONY["<|return|>"], 3, HARMONY["<|call|>"]], "pad_token_id": 3}))
    assert eos_token_id(run) == HARMONY["<|return|>"]
    assert stop_token_ids(run) == (3, HARMONY["<|call|>"])
    (tmp / "imported" / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    tokenizer = Tokenizer.from_file(str(tmp / "imported" / "hf" / "tokenizer.json"))
    assert stop_token_ids(run, tokenizer) == (HARMONY["<|return|>"], HARMONY["<|call|>"])


HARMONY_TEMPLATE = (
    "{%- set ns = namespace(system=none) -%}"
    "<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{%- set ns.system = message.content -%}{%- continue -%}{%- endif -%}"
    "{%- if message.role not in ['user', 'assistant'] -%}{{ raise_exception('unknown role ' + message.role) }}"
    "{%- endif -%}"
    "{%- if message.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ message.content }}"
    "{%- if loop.last -%}<|return|>{%- break -%}{%- endif -%}<|end|>"
    "{%- else -%}<|start|>user<|message|>{{ message.content | tojson }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}<|start|>developer<|message|>{{ ns.system }}<|end|>{%- endif -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


@pytest.mark.parametrize("conversation", [
    [{"role": "user", "content": "w1 w2 <é>"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "w3"},
     {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5"}]])
def test_a_harmony_style_chat_template_renders_as_transformers_renders_it(imported, conversation):
    """A template written as GPT-OSS's (strftime_now, namespace, loop controls, tojson) through the import's
    sandboxed renderer, and the rendered prompt through the import's tokenizer."""
    from types import SimpleNamespace

    from trainer.serve.chat import hub_chat_template, render

    _, tmp = imported
    side = str(tmp / "imported" / "hf")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{side}/tokenizer.json",
                                                     chat_template=HARMONY_TEMPLATE)
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    got = render(hub_chat_template(side), [SimpleNamespace(**m) for m in conversation])
    assert got == expected and "Current date: 2" in got
    ids = tokenizer(got)["input_ids"]
    assert ids[0] == HARMONY["<|start|>"] and ids.count(HARMONY["<|message|>"]) == got.count("<|message|>") >= 2


def test_bfloat16_import_then_export_gives_every_tensor_back_bit_for_bit(tmp_path):
    """bfloat16 both ways, gate_up_proj's interleaved halves and the sinks included; transformers reads the
    exported config.json as the original's."""
    model = hf_model("gpt_oss", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hub")
    import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))
    export_checkpoint(str(tmp_path / "imported"), str(tmp_path / "exported"))
    source, exported = safetensors_of(tmp_path / "hub"), safetensors_of(tmp_path / "exported")
    assert sorted(source) == sorted(exported) and any(k.endswith("sinks") for k in source)
    assert all(exported[k].dtype == source[k].dtype == np.dtype("bfloat16") for k in source)
    assert all(exported[k].tobytes() == source[k].tobytes() for k in source)
    back = transformers.AutoConfig.from_pretrained(tmp_path / "exported")
    for key in ("layer_types", "sliding_window", "num_local_experts", "num_experts_per_tok", "intermediate_size",
                "head_dim", "num_key_value_heads", "swiglu_limit", "attention_bias", "rms_norm_eps"):
        assert getattr(back, key) == getattr(model.config, key), key
    theirs = {k: v for k, v in model.config.rope_parameters.items()}
    assert back.rope_parameters == theirs


def test_a_fine_tune_from_the_hub_directory_exports_what_transformers_continues_as_sample_does(imported, tmp_path):
    """`train --init-from` the Hub directory (3 steps, the import's config, synthetic tokens asked for by name),
    `hf export` of the run: transformers loads the export, and its greedy continuation of a prompt longer than
    the window is the one `sample` draws from the run's checkpoint."""
    from click.testing import CliRunner

    from trainer.cli import train_command
    from trainer.hf.cli import hf_group
    from trainer.sample import sample_command

    _, tmp = imported
    run, exported = tmp_path / "tuned", tmp_path / "exported"
    trained = CliRunner().invoke(train_command, [
        "--config", str(tmp / "imported" / "config.json"), "--devices", "1", "--steps", "3", "--output-dir", str(run),
        "--init-from", str(tmp / "hub"), "--set", "data.source=synthetic", "--set", "data.seq_len=16",
        "--set", "data.global_batch_size=2", "--set", "optim.lr=0.01"])
    assert trained.exit_code == 0, trained.output
    done = CliRunner().invoke(hf_group, ["export", "--checkpoint", str(run), "-o", str(exported)])
    assert done.exit_code == 0, done.output
    ids = np.random.default_rng(6).integers(1, min(HARMONY.values()), 12).tolist()  # words w1.. of its tokenizer
    drawn = CliRunner().invoke(sample_command, ["--checkpoint", str(run), "--prompt", " ".join(f"w{i}" for i in ids),
                                                "--tokens", "10", "--temperature", "0", "--output", "json"])
    assert drawn.exit_code == 0, drawn.output
    ours = json.loads(drawn.stdout.splitlines()[-1])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                              do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(ids):].tolist()  # sample stops early only at an end token it draws
    assert ours["prompt_ids"] == ids and ours["ids"] == expected[:len(ours["ids"])]
    assert len(ours["ids"]) == 10 or ours["finish_reason"] == "stop"


def test_mxfp4_experts_import_as_transformers_dequantises_them(tmp_path):
    """A checkpoint laid out as the Hub's: each expert matrix as MXFP4 `_blocks` (uint8, two FP4 values a byte)
    and `_scales` (uint8, a power of two a block of 32), everything else bfloat16, config.json's
    quantization_config mxfp4. The import's experts are transformers' own dequantisation of those bytes, bit for
    bit (gate and up taken from the interleaved columns), and served with `--weights mxfp4` they are MXFP4 again:
    their FP4 values times their scales are that dequantisation, bit for bit."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from trainer import stacks
    from trainer.hf import mxfp4
    from trainer.hf.orbax_io import open_run
    from trainer.serve.weights import quantizer

    hf_model("gpt_oss", seed=7).to(torch.bfloat16).save_pretrained(tmp_path / "hub")
    tensors, expected = load_file(tmp_path / "hub" / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4.quantized(tensors.pop(name).astype(np.float32))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.bfloat16)
        expected[name] = dequantized.view(torch.int16).numpy()
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    assert import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))["layouts"] == ["mxfp4"]
    run = open_run(str(tmp_path / "imported"), None)
    params = run.read(set(run.shapes))
    for i in range(4):
        hub = f"model.layers.{i}.mlp.experts"
        got = {k: params[p][r].view(np.int16) for k in ("w_gate", "w_in", "w_out")
               for p, r in [stacks.locate(run.cfg.model, f"blocks.{i}.ffn.{k}")]}
        assert np.array_equal(got["w_gate"], expected[f"{hub}.gate_up_proj"][..., 0::2])
        assert np.array_equal(got["w_in"], expected[f"{hub}.gate_up_proj"][..., 1::2])
        assert np.array_equal(got["w_out"], expected[f"{hub}.down_proj"])
    # `serve --weights mxfp4` quantizes each array so as it reads it: the Hub's values come back exactly
    served = {p: quantizer("mxfp4")(p, jax.device_put(v)) for p, v in params.items()}  # placed: nothing compiled
    widen, widened = jax.jit(lambda w: w.dequantize()), {}  # each stacked array widened once, a layer read on the host
    for i in range(4):
        hub = f"model.layers.{i}.mlp.experts"
        for k, want in (("w_gate", expected[f"{hub}.gate_up_proj"][..., 0::2]),
                        ("w_in", expected[f"{hub}.gate_up_proj"][..., 1::2]), ("w_out", expected[f"{hub}.down_proj"])):
            p, r = stacks.locate(run.cfg.model, f"blocks.{i}.ffn.{k}")
            assert served[p].values.dtype == jnp.float4_e2m1fn and served[p].dtype == "bfloat16"
            widened[p] = widened[p] if p in widened else np.asarray(widen(served[p]))
            assert np.array_equal(widened[p][r].view(np.int16), want)
    export_checkpoint(str(tmp_path / "imported"), str(tmp_path / "exported"))  # bfloat16, not MXFP4
    assert "quantization_config" not in json.loads((tmp_path / "exported" / "config.json").read_text())
    exported = safetensors_of(tmp_path / "exported")
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].view(np.int16).tobytes() == \
        expected["model.layers.0.mlp.experts.gate_up_proj"].tobytes()


def test_mxfp4_experts_draw_the_float_models_greedy_tokens(imported):
    """The tiny GPT-OSS served with its routed experts in MXFP4 (every other weight as imported, float32)
    through the engine: 32 prompts of 8 tokens, 64 greedy tokens each; at least 80% of them are the float
    model's greedy choice after the same tokens (teacher forcing through the float forward pass)."""
    import jax
    import jax.numpy as jnp

    from trainer import sharding
    from trainer.hf.orbax_io import open_run
    from trainer.serve import mxfp4
    from trainer.serve.engine import Engine, Request, SamplingParams
    from trainer.serve.memory import memory_plan
    from trainer.serve.quant import weight_bytes
    from trainer.serve.weights import build_serving_model, restore_weights

    _, tmp = imported
    served = build_serving_model(open_run(str(tmp / "imported"), None).cfg,
                                 sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    checkpoints = str(tmp / "imported" / "checkpoints")
    (floats, _), (mx, _) = (restore_weights(served, checkpoints, q) for q in (None, "mxfp4"))  # `--weights`
    assert isinstance(mx["params"]["stacks.0.0.ffn.w_in"], mxfp4.Mxfp4Weight)
    assert memory_plan(served, 1, 1, "float32", "mxfp4")["weights"] == weight_bytes(mx["params"])
    prompts, new = np.random.default_rng(8).integers(0, VOCAB, (32, 8)), 64
    max_len = prompts.shape[1] + new
    engine = Engine(served, mx, slots=32, max_len=max_len, chunk=WINDOW, min_span=max_len)  # one span
    requests = [engine.submit(Request(p.tolist(), SamplingParams(max_tokens=new, temperature=0.0))) for p in prompts]
    engine.run()
    tokens_BxL = jnp.asarray([r.prompt + r.output for r in requests], jnp.int32)
    logits = jax.jit(lambda w, t: served.module(w)(t, train=False)[0])(floats, tokens_BxL)
    best_BxN = np.asarray(jnp.argmax(logits, -1))[:, prompts.shape[1] - 1:-1]
    agree = float(np.mean(best_BxN == np.asarray([r.output for r in requests])))
    assert agree >= 0.8, agree


def _saved_config(tmp_path, **changes) -> str:
    hf_model("gpt_oss").save_pretrained(tmp_path / "hub")
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    config.update(changes)
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "hub")


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "'layer_types' must name 4 layers"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'rope_parameters.rope_type'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                           "attention_factor": 2.0}), "'rope_parameters.attention_factor' is not supported"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "'quantization_config'"),
])
def test_a_gpt_oss_config_the_trainer_cannot_build_is_refused_naming_its_key(tmp_path, changes, message):
    with pytest.raises(HFError, match=message):
        import_checkpoint(_saved_config(tmp_path, **changes), str(tmp_path / "imported"))
    assert not (tmp_path / "imported").exists()


def test_biased_clamped_experts_give_the_same_outputs_and_gradients_on_every_path():
    """The tiled dropless path's hand-written backward pass (the CPU's) against autodiff of ragged_dot's and
    of the capacity buffers' (no token dropped), with the experts' biases, the clamped SwiGLU (its clamps
    reached) and the router's bias."""
    import jax
    import jax.numpy as jnp

    from trainer.moe.config import MoEConfig
    from trainer.moe.experts import Activation, ExpertWeights
    from trainer.moe.parallel import moe_apply

    jax.config.update("jax_default_matmul_precision", "highest")
    e, d, f = 4, 8, 6
    shapes = [(e, d, f), (e, d, f), (e, f, d), (e, f), (e, f), (e, d), (2, 16, d), (d, e), (e,)]

    @jax.jit  # one program draws them all (drawn eagerly, each draw and shape was a program compiled)
    def draws():
        return [jax.random.normal(k, s) for k, s in zip(jax.random.split(jax.random.key(0), 9), shapes, strict=True)]

    *experts, x, router, router_bias = draws()
    w = ExpertWeights(*experts, activation=Activation(clamped=True))

    def loss(impl, capacity, *args):
        cfg = MoEConfig(num_experts=e, top_k=2, d_ff=f, capacity_factor=capacity, eval_capacity_factor=capacity,
                        grouped_matmul=impl, activation="clamped_swiglu", router_bias=True, ffn_bias=True,
                        softmax_before_topk=False)
        y, _ = moe_apply(args[0], args[1], args[2], cfg, None, train=True, router_bias_E=args[3])
        return jnp.sum(jnp.sin(y))

    assert np.abs(np.asarray(x) @ np.asarray(w.w_gate_ExDxF[0])).max() > 7  # the gate's clamp is reached
    cases = (("tiled", 0.0), ("ragged_dot", 0.0), ("tiled", 16.0))
    value_and_grad = lambda case: jax.value_and_grad(lambda *a: loss(*case, *a), argnums=(0, 1, 2, 3))  # noqa: E731
    # the three paths in one program: one compilation, not three
    runs = jax.jit(lambda *args: [value_and_grad(c)(*args) for c in cases])(x, router, w, router_bias)
    (value, grads), others = runs[0], runs[1:]
    for other_value, other_grads in others:  # compared on the host: no program compiled for a comparison
        assert abs(float(value) - float(other_value)) <= 1e-4 * abs(float(value))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max() + 1e-6


def test_the_model_options_refuse_what_does_not_fit():
    from trainer.model_config import ModelConfig
    from trainer.moe.config import MoEConfig

    cases = [(dict(layer_types=("sliding", "full")), "model.sliding_window"),
             (dict(layer_types=("sliding",), sliding_window=4), "names 1 layers, but the model has 2"),
             (dict(sliding_window=4, layer_types=("full", "full")), "no layer of model.layer_types is 'sliding'"),
             (dict(attention_sinks=True, attention="splash"), "splash has no sliding windows nor attention sinks"),
             (dict(attention_sinks=True, mla={}), "model.attention_sinks"),
             (dict(yarn={"factor": 4, "original_max_position_embeddings": 8, "mscale_all_dim": 1.0}),
              "mscale_all_dim")]
    for keys, message in cases:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**keys)
    with pytest.raises(ValueError, match="apply to activation='clamped_swiglu' only"):
        MoEConfig(swiglu_limit=5.0)
    assert ModelConfig().layer_kind(1) == (True, 0) and ModelConfig(
        layer_types=("sliding", "full"), sliding_window=4).window(0) == 4
