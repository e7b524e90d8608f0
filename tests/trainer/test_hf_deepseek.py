"""DeepSeek-V3 and DeepSeek-V2(-Lite) held to transformers: tiny random models from transformers' config classes
(latent attention with and without q_lora_rank, a dense first layer, shared experts, V3's sigmoid routing with
its selection bias and groups by their top 2, V2's softmax with groups by their best) are imported and must
give transformers' logits and choose its experts; import then export gives back every tensor bit for bit."""

import json

import numpy as np
import pytest
from hf_models import (
    DEEPSEEK,
    VOCAB,
    hf_model,
    one_torch_thread,  # noqa: F401 - autouse: torch on one thread here
    routed_outputs,
    safetensors_of,
    trainer_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer import stacks  # noqa: E402
from trainer.hf.convert import export_checkpoint, import_checkpoint  # noqa: E402

# Every test compiles small programs and runs each briefly: the whole module without most of XLA's optimisations
# (tests/trainer/conftest.py). Measured with test_hf_deepseek.py beside it, one process, CPU seconds: 165 -> 155,
# the logits tests' own 60 -> 49.
pytestmark = pytest.mark.compile_bound

# Rows 0 and 1 are the 2 x 128-token batch continued to 256 tokens; the model is causal, so their first 128
# positions are the 2 x 128 batch's logits.
LENGTH, SHORT = 256, 128


@pytest.fixture(scope="module", params=sorted(DEEPSEEK))
def imported(request, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    model = hf_model(name)
    model.save_pretrained(tmp / "hub")
    done = import_checkpoint(str(tmp / "hub"), str(tmp / "imported"))
    assert done["family"] == name.split("-")[0]
    return name, model, tmp


def _hf_choices(model, tokens):
    """transformers' logits and each MoE layer's chosen experts (its router's own top-k indices), sorted."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: chosen.append(out[-1]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            logits = model(torch.tensor(tokens)).logits.numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, [np.sort(c.numpy(), -1) for c in chosen]


@pytest.fixture(scope="module")
def outputs(imported):
    import jax

    name, model, tmp = imported
    jax.config.update("jax_default_matmul_precision", "highest")
    tokens = np.random.default_rng(1).integers(0, VOCAB, (3, LENGTH))
    theirs, their_experts = _hf_choices(model, tokens)
    ours_model, _ = trainer_model(str(tmp / "imported"))
    logits, ours = routed_outputs(ours_model, tokens)
    return theirs, logits, their_experts, ours


def test_logits_equal_transformers(outputs):
    theirs, ours, _, _ = outputs
    short = np.abs(ours[:2, :SHORT] - theirs[:2, :SHORT]).max()
    assert short <= 1e-4, f"max |Δ| over 2 x {SHORT} tokens: {short}"
    assert np.abs(ours - theirs).max() <= 1e-4
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_each_layer_chooses_transformers_experts(outputs):
    _, _, theirs, ours = outputs
    assert len(ours) == len(theirs) == 2  # the first layer is dense (first_k_dense_replace)
    flips = sum(int(np.sum(np.any(a != b, axis=-1))) for a, b in zip(ours, theirs, strict=True))
    assert flips <= sum(len(a) for a in theirs) // 10_000


def test_import_then_export_gives_every_tensor_back_bit_for_bit(imported):
    name, model, tmp = imported
    export_checkpoint(str(tmp / "imported"), str(tmp / "exported"))
    source, exported = safetensors_of(tmp / "hub"), safetensors_of(tmp / "exported")
    assert sorted(exported) == sorted(source)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    back = transformers.AutoConfig.from_pretrained(tmp / "exported")
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "topk_method", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace",
                "norm_topk_prob", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if hasattr(model.config, key):  # V3's config class has no topk_method (noaux_tc, written as the Hub's)
            assert getattr(back, key) == getattr(model.config, key), key
    assert json.loads((tmp / "exported" / "config.json").read_text())["model_type"] == model.config.model_type


def _jitted_logits(model, tokens) -> np.ndarray:
    """The trainer model's logits in float32 at the highest matmul precision, compiled without XLA's
    optimisations (compiling, not running, is these tiny programs' cost)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    jax.config.update("jax_default_matmul_precision", "highest")
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, train=False)[0])(state, jnp.asarray(tokens)))


def _saved(tmp_path, name="deepseek_v3"):
    hf_model(name, seed=2).save_pretrained(tmp_path / "hub")
    return tmp_path / "hub"


def test_the_multi_token_prediction_layer_is_skipped_with_a_note(tmp_path, capsys):
    """A V3 file's layer num_hidden_layers (the MTP module) is no part of the model: the import skips it and
    says so; the parameters are those of the file without it."""
    from safetensors.numpy import load_file, save_file

    from trainer.hf.cli import main

    hub = _saved(tmp_path)
    tensors = load_file(hub / "model.safetensors")
    mtp = {"model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
           "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": np.ones((16, 32), np.float32)}
    save_file({**tensors, **mtp}, hub / "model.safetensors", metadata={"format": "pt"})
    main(["import", str(hub), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "skipped 2 tensors of the multi-token-prediction layer" in out
    export_checkpoint(str(tmp_path / "out"), str(tmp_path / "exported"))
    assert sorted(safetensors_of(tmp_path / "exported")) == sorted(tensors)


@pytest.mark.parametrize("key, value, message", [
    ("rope_interleave", False, "'rope_interleave' = False is not supported"),
    ("topk_method", "greedy", "'topk_method' = 'greedy' is not DeepSeek-V3's"),
    ("rope_scaling", {"type": "longrope", "factor": 4}, "'rope_scaling.rope_type' = 'longrope' is not supported"),
    ("rope_scaling", {"type": "yarn", "factor": 4}, "'rope_scaling' of type yarn needs 'factor' and 'original_max"),
    ("num_key_value_heads", 2, "'num_key_value_heads' = 2 must equal 'num_attention_heads' = 4"),
    ("first_k_dense_replace", 9, "'first_k_dense_replace' must be in [0, 3], got 9"),
    ("num_experts_per_tok", 1, "'num_experts_per_tok' = 1 with 'norm_topk_prob' is not supported"),
])
def test_a_deepseek_feature_the_trainer_lacks_exits_2_naming_its_key(tmp_path, capsys, key, value, message):
    from trainer.hf.cli import main

    hub = _saved(tmp_path)
    config = json.loads((hub / "config.json").read_text())
    config.pop("rope_parameters") if key == "rope_scaling" else None
    (hub / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(SystemExit) as exit_info:
        main(["import", str(hub), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "config.json" in err and message in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_latent_attention_refuses_the_keys_it_does_not_take():
    from trainer.config import ConfigError, load_config

    for override, key in (("model.num_kv_heads=2", "model.num_kv_heads"), ("model.head_dim=16", "model.head_dim"),
                          ("model.mla.qk_rope_head_dim=7", "model.mla.qk_rope_head_dim")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("deepseek-tiny", [override])


def test_a_checkpoint_of_the_old_deepseek_tiny_is_refused_naming_model_mla():
    """deepseek-tiny became latent attention: a checkpoint written before (no model.mla recorded) is another
    model, refused on resume naming the key."""
    from trainer.config import ConfigError, load_config
    from trainer.resume import check_resumable, model_identity

    cfg = load_config("deepseek-tiny")
    old = {k: v for k, v in model_identity(cfg).items() if k != "model.mla"}
    check_resumable({"model": model_identity(cfg)}, cfg, None, 10, None)  # today's resumes
    with pytest.raises(ConfigError, match=r"model\.mla is None in the checkpoint"):
        check_resumable({"model": old}, cfg, None, 10, None)


def test_deepseek_tiny_exports_as_deepseek_v3_and_transformers_gives_its_logits(tmp_path):
    """The named config (latent attention, sigmoid routing with the selection bias, 2 of 4 groups, a shared
    expert), at random: export, transformers reads it and computes the trainer's logits."""
    import jax
    from flax import nnx

    from trainer.config import load_config
    from trainer.hf.families import family_of
    from trainer.hf.orbax_io import save_params
    from trainer.model import ParamCodec, build_model
    from trainer.moe.layer import ExpertBias

    cfg = load_config("deepseek-tiny")
    assert family_of(cfg).model_type == "deepseek_v3"
    model = nnx.jit(lambda: build_model(cfg, seed=3))()  # one program draws it (eagerly, each draw was one)
    for i, block in enumerate(b for period in model.stacks for b in period if b.is_moe):  # a bias that moves
        block.ffn.expert_bias[...] = jax.random.normal(jax.random.key(i), block.ffn.expert_bias.shape) * 0.05
    _, params, biases, _ = nnx.split(model, nnx.Param, ExpertBias, ...)
    values = {**ParamCodec(params).flatten(params), **ParamCodec(biases).flatten(biases)}
    run = tmp_path / "run"
    save_params(str(run / "checkpoints"), ((n, np.asarray(v)) for n, v in values.items()), cfg, source="test",
                names=list(values))
    (run / "config.json").write_text(cfg.model_dump_json())
    export_checkpoint(str(run), str(tmp_path / "exported"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager",
                                                               experts_implementation="eager").eval()
    tokens = np.random.default_rng(2).integers(0, cfg.model.vocab_size, (2, 48))
    with torch.no_grad():
        expected = theirs(torch.tensor(tokens)).logits.numpy()
    got = _jitted_logits(model, tokens)
    assert np.abs(got - expected).max() <= 1e-4 and np.array_equal(got.argmax(-1), expected.argmax(-1))


PROMPTS, NEW = (8, 12), 32


@pytest.fixture(scope="module")
def v3_generated(imported):
    """(the V3 import's directory, 8 prompts, transformers' greedy continuations); V2-Lite skipped: it differs
    from V3 in routing and q only, and its logits are held above."""
    name, model, tmp = imported
    if name != "deepseek_v3":
        pytest.skip("V2-Lite's logits are held above")
    prompts = np.random.default_rng(5).integers(0, VOCAB, PROMPTS)
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                  do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    return tmp / "imported", prompts, expected[:, prompts.shape[1]:].tolist()


MESHES = {"1 device": {"data": 1, "expert": 1}, "expert=4": {"data": 2, "expert": 4},
          "expert=2,model=2": {"data": 2, "expert": 2, "model": 2}}


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_greedy_generation_through_the_serving_engine_equals_transformers(v3_generated, mesh):
    """8 prompts, 32 greedy tokens each, through the engine's prefill and decode over the latent cache (the
    latent and the rotary key a token, the heads' up-projections absorbed; V3's selection bias restored with
    the weights) against transformers' generate(do_sample=False); on one device and on 8 with the experts
    split over `expert`, then the heads over `model` too (the latent's positions split over it). One engine a
    mesh: the prefill and a decode a row count compiled each."""
    import math

    import jax

    from trainer import sharding
    from trainer.hf.orbax_io import open_run
    from trainer.serve.engine import Engine, Request, SamplingParams
    from trainer.serve.weights import build_serving_model, restore_weights

    run, prompts, expected = v3_generated
    devices = jax.devices()[:math.prod(mesh.values())]
    served = build_serving_model(open_run(str(run), None).cfg, sharding.make_mesh(mesh, devices))
    weights, _ = restore_weights(served, str(run / "checkpoints"))
    bias, layer = stacks.locate(served.cfg.model, "blocks.1.ffn.expert_bias")
    assert np.abs(np.asarray(weights["moe_bias"][bias][layer])).max() > 0  # the file's bias
    engine = Engine(served, weights, slots=8, max_len=prompts.shape[1] + NEW, chunk=16)
    assert sorted(vars(engine.cache)) == ["latent", "latent_scale", "rope", "rope_scale"]
    positions = "model" if "model" in mesh else None  # the latent's positions split over `model`
    assert engine.cache.latent.sharding.spec == jax.sharding.PartitionSpec(None, None, positions, None)
    requests = [engine.submit(Request(p.tolist(), SamplingParams(max_tokens=NEW, temperature=0.0))) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == expected
    assert engine.compilations() == 1 + len(engine.runner.rows())  # the first decodes alone a few steps


def test_fp8_weights_with_block_scales_import_dequantised_to_bfloat16(tmp_path):
    """A V3 file as the Hub's: every projection in float8 e4m3 with a float32 multiplier per block of 4 x 8
    (weight_block_size; the Hub's is 128 x 128), quantised here. Each imports as fp8 x its block's multiplier
    rounded once to bfloat16, within bfloat16 rounding of the float32 product."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from trainer.hf.orbax_io import open_run

    hf_model("deepseek_v3", seed=4).to(torch.bfloat16).save_pretrained(tmp_path / "hub")
    tensors, block, expected = load_file(tmp_path / "hub" / "model.safetensors"), (4, 8), {}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name].astype(np.float32)
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = np.abs(padded.reshape(rows, block[0], cols, block[1])).max(axis=(1, 3))
        scale = np.maximum(amax, 1e-12).astype(np.float32) / 448.0
        full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:w.shape[0], :w.shape[1]]
        tensors[name] = (w / full).astype(ml_dtypes.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        expected[name] = tensors[name].astype(np.float32) * full
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))
    run = open_run(str(tmp_path / "imported"), None)
    params = run.read(set(run.shapes))
    assert run.cfg.param_dtype == "bfloat16"
    export_checkpoint(str(tmp_path / "imported"), str(tmp_path / "exported"))
    exported = safetensors_of(tmp_path / "exported")  # written back as bfloat16, the file's layout otherwise
    assert "quantization_config" not in json.loads((tmp_path / "exported" / "config.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in exported) and len(expected) > 20
    for name, product in expected.items():
        got = exported[name]
        assert got.dtype == np.dtype("bfloat16"), name
        assert got.tobytes() == product.astype(ml_dtypes.bfloat16).tobytes(), name
        assert np.all(np.abs(got.astype(np.float32) - product) <= np.abs(product) * 2.0 ** -8), name
    assert params[stacks.locate(run.cfg.model, "blocks.1.attn.kv_norm.scale")[0]].dtype == np.dtype("bfloat16")


def test_init_from_the_hub_directory_reads_parameters_and_selection_bias_onto_the_mesh(imported):
    """--init-from the Hub directory itself, on expert=2,model=2: the imported parameters (latent attention's
    heads split over `model`) and V3's selection bias, bit for bit."""
    import jax

    from trainer import init_from, sharding
    from trainer.hf.orbax_io import open_run
    from trainer.step import build_trainer

    name, _, tmp = imported
    run = open_run(str(tmp / "imported"), None)
    trainer = build_trainer(run.cfg, sharding.make_mesh({"data": 1, "expert": 2, "model": 2}, jax.devices()[:4]), 10)
    state, _ = init_from.initial_state(trainer, str(tmp / "hub"))
    saved = run.read(set(run.shapes))
    got = {**state["params"], **state.get("moe_bias", {})}
    assert sorted(got) == sorted(saved) and any(n.endswith("expert_bias") for n in got) == (name == "deepseek_v3")
    assert all(np.asarray(got[n]).tobytes() == saved[n].tobytes() for n in saved)
    assert state["params"][stacks.locate(run.cfg.model, "blocks.1.attn.wkv_b")[0]].sharding.spec[2] == "model"


def test_at_initializer_range_0_2_the_logits_stay_within_1e_3(tmp_path):
    """Weights ten times larger (sharper attention, routing and logits): a tiny V3 still gives transformers'
    logits within 1e-3 over 2 x 128 tokens, with the same top-1."""
    model = hf_model("deepseek_v3", seed=6, initializer_range=0.2)
    model.save_pretrained(tmp_path / "hub")
    import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, SHORT))
    theirs, _ = _hf_choices(model, tokens)
    ours = _jitted_logits(trainer_model(str(tmp_path / "imported"))[0], tokens)
    assert np.abs(ours - theirs).max() <= 1e-3 and np.array_equal(ours.argmax(-1), theirs.argmax(-1))
