"""DeepSeek-V3 and DeepSeek-V2(-Lite) held to transformers: tiny random models from transformers' config classes
(latent attention with and without q_lora_rank, a dense first layer, shared experts, V3's sigmoid routing with
its selection bias and groups by their top 2, V2's softmax with groups by their best) are imported and must
give transformers' logits and choose its experts; import then export gives back every tensor bit for bit."""

import json

import numpy as np
import pytest
from hf_models import DEEPSEEK, VOCAB, hf_model, safetensors_of, trainer_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.hf.convert import export_checkpoint, import_checkpoint  # noqa: E402

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


def _forward(model, tokens_BxL):
    """The logits, and each MoE layer's chosen experts as the trainer's routing chooses them (its config)."""
    import jax.numpy as jnp

    from trainer.moe.core import token_choice
    from trainer.moe.routing import router_logits

    x = jnp.take(model.embed[...], tokens_BxL, axis=0)
    chosen = []
    for block in model.blocks:
        if block.is_moe:
            h = x + block.attn(block.attn_norm(x))
            h_TxD = block.ffn_norm(h).reshape(-1, h.shape[-1])
            bias = block.ffn.expert_bias[...] if block.ffn.cfg.uses_bias else None
            experts = token_choice(router_logits(h_TxD, block.ffn.router[...])[None], block.ffn.cfg, bias)[0][0]
            chosen.append(jnp.sort(experts, -1))
        x, _, _ = block(x, train=False)
    return model._logits(x), chosen


@pytest.fixture(scope="module")
def outputs(imported):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    name, model, tmp = imported
    jax.config.update("jax_default_matmul_precision", "highest")
    tokens = np.random.default_rng(1).integers(0, VOCAB, (3, LENGTH))
    theirs, their_experts = _hf_choices(model, tokens)
    ours_model, _ = trainer_model(str(tmp / "imported"))
    graphdef, state = nnx.split(ours_model)
    logits, ours = jax.jit(lambda s, t: _forward(nnx.merge(graphdef, s), t))(state, jnp.asarray(tokens))
    return theirs, np.asarray(logits), their_experts, [np.asarray(o) for o in ours]


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
