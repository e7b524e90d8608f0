"""`hf import` / `hf export` held to transformers itself: for each family (Mixtral with GQA, Qwen2-MoE and
Qwen3-MoE with norm_topk_prob on and off and a dense layer, OLMoE) a tiny random model from transformers'
config classes is saved, imported, and must give transformers' logits and choose its experts; import then
export gives back every tensor bit for bit, and transformers reads the exported config.json alike."""

import json

import numpy as np
import pytest
from hf_models import (
    FAMILIES,
    VOCAB,
    hf_model,
    one_torch_thread,  # noqa: F401 - autouse: torch on one thread here
    routed_outputs,
    safetensors_of,
    tokenizer_json,
    trainer_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.hf.convert import export_checkpoint, import_checkpoint  # noqa: E402

# Every test compiles small programs and runs each briefly: the whole module without most of XLA's optimisations
# (tests/trainer/conftest.py). Measured with test_hf_deepseek.py beside it, one process, CPU seconds: 165 -> 155,
# the logits tests' own 60 -> 49.
pytestmark = pytest.mark.compile_bound

# Rows 0 and 1 are the 2 x 128-token batch, each continued to 512 tokens; row 2 a 512-token sequence. The
# model is causal, so the first 128 positions of rows 0 and 1 are exactly the 2 x 128 batch's logits: one
# program compiled per family, not two.
LENGTH, SHORT = 512, 128


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, the transformers model, its saved directory, the import of it)."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    model = hf_model(name)
    model.save_pretrained(tmp / "hub")
    tokenizer_json(tmp / "hub" / "tokenizer.json", VOCAB - 8)
    import_checkpoint(str(tmp / "hub"), str(tmp / "imported"))
    return name, model, tmp


@pytest.fixture(scope="module")
def outputs(imported):
    """Both models' logits [3, 512, V] and each MoE layer's chosen experts [tokens, k] on one batch."""
    import jax

    name, model, tmp = imported
    jax.config.update("jax_default_matmul_precision", "highest")
    tokens = np.random.default_rng(1).integers(0, VOCAB, (3, LENGTH))
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_router_logits=True)
    k = model.config.num_experts_per_tok
    theirs = [np.sort(torch.topk(r.float().softmax(-1), k).indices.numpy(), -1) for r in out.router_logits]
    ours_model, _ = trainer_model(str(tmp / "imported"))
    logits, ours = routed_outputs(ours_model, tokens)
    return out.logits.numpy(), logits, theirs, ours


def test_logits_equal_transformers(outputs):
    theirs, ours, _, _ = outputs
    short = np.abs(ours[:2, :SHORT] - theirs[:2, :SHORT]).max()
    assert short <= 1e-4, f"max |Δ| over 2 x {SHORT} tokens: {short}"
    assert np.abs(ours - theirs).max() <= 1e-4
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_each_layer_chooses_transformers_experts(outputs):
    _, _, theirs, ours = outputs
    assert len(ours) == len(theirs) >= 1
    flips = sum(int(np.sum(np.any(a != b, axis=-1))) for a, b in zip(ours, theirs, strict=True))
    token_layers = sum(len(a) for a in theirs)
    assert flips <= token_layers // 10_000, f"{flips} of {token_layers} token-layers chose other experts"


def test_import_then_export_gives_every_tensor_back_bit_for_bit(imported):
    name, _, tmp = imported
    export_checkpoint(str(tmp / "imported"), str(tmp / "exported"))
    source, exported = safetensors_of(tmp / "hub"), safetensors_of(tmp / "exported")
    assert sorted(exported) == sorted(source)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].shape == value.shape, key
        assert exported[key].tobytes() == value.tobytes(), key
    index = json.loads((tmp / "exported" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source)
    assert (tmp / "exported" / "tokenizer.json").read_bytes() == (tmp / "hub" / "tokenizer.json").read_bytes()
    assert (tmp / "exported" / "generation_config.json").exists()


def test_transformers_reads_the_exported_config_alike(imported):
    name, model, tmp = imported
    if not (tmp / "exported").exists():
        export_checkpoint(str(tmp / "imported"), str(tmp / "exported"))
    raw = json.loads((tmp / "exported" / "config.json").read_text())
    assert ("num_local_experts" if name == "mixtral" else "num_experts") in raw  # the Hub's key names
    assert raw["rope_theta"] == model.config.rope_parameters["rope_theta"]
    back = transformers.AutoConfig.from_pretrained(tmp / "exported")
    for key in ("num_experts_per_tok", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "shared_expert_intermediate_size", "num_key_value_heads", "norm_topk_prob", "decoder_sparse_step",
                "mlp_only_layers", "rms_norm_eps"):
        assert getattr(back, key, None) == getattr(model.config, key, None), key
    experts = "num_local_experts" if name == "mixtral" else "num_experts"
    assert getattr(back, experts) == getattr(model.config, experts)
    assert back.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]


def _params(run_dir) -> dict:
    from trainer.hf.orbax_io import open_run

    run = open_run(str(run_dir), None)
    return run.read(set(run.shapes))


def test_both_expert_layouts_give_the_same_parameters(tmp_path):
    """transformers 5 saves fused 3-D experts with save_original_format=False (Mixtral's router then under `mlp`
    too); they import as the per-expert files do, and the fused import exports to the Hub's per-expert tensors
    of the original, bit for bit. (Every family's fused tensors are read by the same transforms; which tensors
    each family's layouts hold is the next test's.)"""
    model = hf_model("mixtral", seed=3)
    model.save_pretrained(tmp_path / "per-expert")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert any(k.endswith("experts.gate_up_proj") for k in safetensors_of(tmp_path / "fused"))
    import_checkpoint(str(tmp_path / "per-expert"), str(tmp_path / "a"))
    import_checkpoint(str(tmp_path / "fused"), str(tmp_path / "b"))
    a, b = _params(tmp_path / "a"), _params(tmp_path / "b")
    assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
    export_checkpoint(str(tmp_path / "b"), str(tmp_path / "exported"))
    source, exported = safetensors_of(tmp_path / "per-expert"), safetensors_of(tmp_path / "exported")
    assert sorted(exported) == sorted(source) and all(exported[k].tobytes() == source[k].tobytes() for k in source)


def test_every_layout_transformers_writes_is_read_whole(tmp_path):
    """For each family (DeepSeek's too), the Hub's per-expert files (transformers 4.x's save and 5.x's default)
    and 5.x's fused ones: the tensors the import reads are the files' tensors, none missing and none left over,
    and every MoE layer is read in the layout written."""
    from hf_models import DEEPSEEK

    from trainer.hf import names
    from trainer.hf.convert import IGNORED, open_hub

    for name in [*FAMILIES, *DEEPSEEK]:
        model = hf_model(name)
        for layout, fused in ((names.PER_EXPERT, False), (names.FUSED, True)):
            where = tmp_path / name / layout
            model.save_pretrained(where, save_original_format=not fused)
            hub = open_hub(str(where))
            moe = [i for i in range(hub.cfg.model.num_layers) if hub.cfg.model.is_moe_layer(i)]
            assert moe and {hub.layouts[i] for i in moe} == {layout}, (name, layout)
            specs = [spec for group in names.all_specs(hub.cfg, hub.family, hub.layouts) for spec in group]
            read = {tensor for spec in specs for tensor in spec.hub}
            on_disk = {t for t in hub.reader.names() if not t.endswith(IGNORED)}
            assert read == on_disk, (name, layout, sorted(read ^ on_disk)[:4])


def test_bfloat16_keeps_its_dtype_and_bits_both_ways(tmp_path):
    """bfloat16 in, bfloat16 out, bit for bit; and export then import reads the same parameters again."""
    model = hf_model("qwen2_moe-norm", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hub")
    import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))
    export_checkpoint(str(tmp_path / "imported"), str(tmp_path / "exported"))
    source, exported = safetensors_of(tmp_path / "hub"), safetensors_of(tmp_path / "exported")
    assert sorted(source) == sorted(exported)
    assert all(exported[k].dtype == source[k].dtype == np.dtype("bfloat16") for k in source)
    assert all(exported[k].tobytes() == source[k].tobytes() for k in source)
    import_checkpoint(str(tmp_path / "exported"), str(tmp_path / "again"))
    first, again = _params(tmp_path / "imported"), _params(tmp_path / "again")
    assert all(first[n].dtype == np.dtype("bfloat16") and first[n].tobytes() == again[n].tobytes() for n in first)


def test_a_trained_model_exports_as_mixtral_and_transformers_gives_its_logits(trained_tiny, tmp_path):
    """`tiny` (every layer MoE, top-2 renormalised, no q/k norm) trained by the trainer is a Mixtral:
    transformers loads the export and computes the trainer's logits (MoE dropless in both)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from trainer.hf.orbax_io import open_run

    done = export_checkpoint(str(trained_tiny.output_dir), str(tmp_path / "exported"))
    assert done["family"] == "mixtral" and done["step"] == 120
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager",
                                                               experts_implementation="eager").eval()
    cfg = open_run(str(trained_tiny.output_dir), None).cfg
    dropless = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"eval_capacity_factor": 0.0})})
    ours, values = trainer_model(str(trained_tiny.output_dir), dropless)
    tokens = np.random.default_rng(2).integers(0, cfg.model.vocab_size, (2, 64))
    with torch.no_grad():
        expected = theirs(torch.tensor(tokens)).logits.numpy()
    graphdef, state = nnx.split(ours)
    got = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, train=False)[0])(state, jnp.asarray(tokens)))
    assert np.abs(got - expected).max() <= 1e-4 and np.array_equal(got.argmax(-1), expected.argmax(-1))


# One case of each family (and of each layer pattern) decodes; the others differ in routing only.
GENERATES = ("mixtral", "qwen2_moe-sparse-step", "qwen3_moe-norm-dense0", "olmoe-tied")
# 8 devices with the experts over expert=4 and the heads (4, and 2 of keys and values) over model=2 for every
# family, and one device for the first (the suite's 10 minutes: an engine a mesh; `sample` decodes every family
# on one device against transformers in test_hf_use.py's way).
MESHES = ({"data": 1, "expert": 4, "model": 2},)
ONE_DEVICE = {"data": 1, "expert": 1}


def test_greedy_generation_through_the_serving_engine_equals_transformers(imported):
    """8 prompts, 32 greedy tokens each, through the engine's prefill and key/value-cache decode (8 slots, one
    batch) on each mesh of MESHES (and one device for the first family) against transformers'
    generate(do_sample=False); neither stops at an end-of-sequence token."""
    import jax

    from trainer import sharding
    from trainer.hf.orbax_io import open_run
    from trainer.serve.engine import Engine, Request, SamplingParams
    from trainer.serve.weights import build_serving_model, restore_weights

    name, model, tmp = imported
    if name not in GENERATES:
        pytest.skip("one case a family decodes")
    prompts = np.random.default_rng(5).integers(0, VOCAB, (8, 16))  # a chunk of 16: a multiple of 8 devices
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                  do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    expected = expected[:, prompts.shape[1]:].tolist()
    cfg = open_run(str(tmp / "imported"), None).cfg
    for shape in (ONE_DEVICE, *MESHES) if name == GENERATES[0] else MESHES:
        devices = jax.devices()[:shape["expert"] * shape.get("model", 1)]
        served = build_serving_model(cfg, sharding.make_mesh(shape, devices))
        weights, _ = restore_weights(served, str(tmp / "imported" / "checkpoints"))
        engine = Engine(served, weights, slots=8, max_len=prompts.shape[1] + 32, chunk=prompts.shape[1])
        requests = [engine.submit(Request(p.tolist(), SamplingParams(max_tokens=32, temperature=0.0)))
                    for p in prompts]
        engine.run()
        assert [r.output for r in requests] == expected, shape


def test_logits_equal_transformers_at_a_wider_initialisation(tmp_path):
    """initializer_range 0.2 (logits ten times larger, routing far from uniform): within 1e-3."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    jax.config.update("jax_default_matmul_precision", "highest")
    model = hf_model("qwen3_moe", seed=9, initializer_range=0.2)
    model.save_pretrained(tmp_path / "hub")
    import_checkpoint(str(tmp_path / "hub"), str(tmp_path / "imported"))
    ours, _ = trainer_model(str(tmp_path / "imported"))
    tokens = np.random.default_rng(10).integers(0, VOCAB, (2, SHORT))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    graphdef, state = nnx.split(ours)
    got = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, train=False)[0])(state, jnp.asarray(tokens)))
    assert np.abs(got - theirs).max() <= 1e-3 and np.array_equal(got.argmax(-1), theirs.argmax(-1))


def test_the_rotary_positions_and_their_gradient_are_transformers_own():
    """trainer.layers.rotary (its backward pass written out, trainer/rope.py) against transformers' rotary
    positions and torch's autograd of them, in float32: the same rotated values and the same gradient, for one
    offset and for one start a batch row (decoding)."""
    import jax
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from trainer.layers import rotary

    x_BxLxNxH = np.asarray(jax.random.normal(jax.random.key(0), (2, 6, 3, 16)), np.float32)
    g_BxLxNxH = np.asarray(jax.random.normal(jax.random.key(1), x_BxLxNxH.shape), np.float32)

    def rotated_and_grad(offset):
        """The rotated values and their gradient at `offset`, one program (run eagerly, each op compiled one)."""
        def run(x, g):
            got, vjp = jax.vjp(lambda x: rotary(x, 100.0, offset), x)
            return got, vjp(g)[0]

        return jax.jit(run)

    for offset in (5, np.array([0, 9])):
        got, grad = rotated_and_grad(offset)(x_BxLxNxH, g_BxLxNxH)
        inv_freq = 100.0 ** (-torch.arange(8, dtype=torch.float32) / 8)
        positions = torch.arange(6, dtype=torch.float32) + torch.as_tensor(offset, dtype=torch.float32).reshape(-1, 1)
        angle = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1).expand(2, 6, 16)
        x = torch.tensor(x_BxLxNxH).transpose(1, 2).requires_grad_()  # transformers' [B, N, L, H]
        want, _ = apply_rotary_pos_emb(x, x, angle.cos(), angle.sin())
        want.backward(torch.tensor(g_BxLxNxH).transpose(1, 2))
        np.testing.assert_allclose(np.asarray(got), want.detach().transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grad), x.grad.transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)
