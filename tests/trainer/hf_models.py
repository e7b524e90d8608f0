"""Tiny random models of the four Hugging Face families, built with transformers' own config classes and
`from_config` (nothing downloaded), and the trainer's model read back from an import."""

from __future__ import annotations

import numpy as np
import pytest

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024)

# name -> (config class name, its keys); each Qwen family with norm_topk_prob on and off, and a layer pattern
# (a dense layer by decoder_sparse_step or by mlp_only_layers) in one of the two.
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe-norm": ("Qwen2MoeConfig", dict(moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                                              num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                              norm_topk_prob=True)),
    "qwen2_moe-sparse-step": ("Qwen2MoeConfig", dict(moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                                                     num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                                     norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen3_moe-norm-dense0": ("Qwen3MoeConfig", dict(moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                                                     num_experts_per_tok=2, head_dim=16, norm_topk_prob=True,
                                                     mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                                         num_experts_per_tok=2, head_dim=16, norm_topk_prob=False)),
    "olmoe-tied": ("OlmoeConfig", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                       tie_word_embeddings=True)),
}


# DeepSeek: latent attention (q through a rank or not), a dense first layer, shared experts; V3 with sigmoid
# scores, a selection bias and groups by their top 2; V2-Lite's shape (no q rank, YaRN) with groups by their best.
_MLA = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_key_value_heads=4,
            num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=2)
# YaRN as DeepSeek uses it, over an original length of 64 that the tests' 256 tokens pass (mscale and
# mscale_all_dim apart, so that both the rotary values and the softmax scale are scaled)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
             beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
DEEPSEEK = {
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek_v2-lite": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, topk_method="group_limited_greedy",
                                                  n_group=4, topk_group=2, n_shared_experts=2,
                                                  routed_scaling_factor=1.5, rope_parameters=_YARN)),
}


# GPT-OSS: four layers alternating sliding (a window of 8) and full attention, YaRN over an original length of
# 32 that the tests' sequences pass; widths multiples of 32 (MXFP4's blocks).
GPT_OSS = {
    "gpt_oss": ("GptOssConfig", dict(hidden_size=64, num_hidden_layers=4, head_dim=16, intermediate_size=32,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                     max_position_embeddings=256,
                                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                          beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                          original_max_position_embeddings=32))),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """torch on one thread for the module that imports this fixture, its module fixtures included: its models are
    tiny, and with the suite's workers busy on every core a second thread waits more than it works (transformers'
    greedy generation of 8 x 32 tokens: 5-6 CPU s on two threads, 0.2 on one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_model(name: str, seed: int = 0, initializer_range: float = 0.02, **extra):
    """A random model of family `name` in float32 with eager attention and eager experts."""
    import torch
    import transformers

    cls, keys = {**FAMILIES, **DEEPSEEK, **GPT_OSS}[name]
    config = getattr(transformers, cls)(**{**COMMON, **keys}, initializer_range=initializer_range, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1, which would hide a bias or a norm lost
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's selection bias, to be used for choosing only
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    return model.eval()


def trainer_model(run_dir: str, cfg=None):
    """(the trainer's Transformer with the parameters of the import or run at `run_dir`, its parameters);
    `cfg` replaces the run's config (the same shapes)."""
    import jax
    from flax import nnx

    from trainer.hf.orbax_io import open_run
    from trainer.model import ParamCodec, abstract_split, build_model

    run = open_run(run_dir, None)
    cfg = cfg or run.cfg
    # Built for its structure only, as the serving engine builds it (trainer/serve/weights.py): every parameter
    # is the run's. Built eagerly, each random draw was a program compiled (up to 256 a model, seconds of CPU).
    graphdef, params, biases, rest = abstract_split(lambda: build_model(cfg))
    codec, bias_codec = ParamCodec(params), ParamCodec(biases)  # DeepSeek-V3's selection biases, if any
    values = run.read(set(codec.names) | set(bias_codec.names))
    state = [c.unflatten({n: jax.device_put(values[n]) for n in c.names}) for c in (codec, bias_codec)]
    return nnx.merge(graphdef, *state, rest), values


def tokenizer_json(path, size: int) -> None:
    """A word-level tokenizer.json of `size` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def safetensors_of(directory) -> dict[str, np.ndarray]:
    """Every tensor of a directory's *.safetensors files, as numpy (bfloat16 through ml_dtypes); read
    as numpy, not through jax, which compiled a program for each shape and dtype it placed on the device."""
    import pathlib

    from safetensors import safe_open

    out = {}
    for path in sorted(pathlib.Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def routed_outputs(model, tokens_BxL) -> tuple[np.ndarray, list[np.ndarray]]:
    """routed_forward's logits and chosen experts on the host (its callers' modules compile without most of
    XLA's optimisations: tests/trainer/conftest.py)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    logits, chosen = jax.jit(lambda s, t: routed_forward(nnx.merge(graphdef, s), t))(state, jnp.asarray(tokens_BxL))
    return np.asarray(logits), [np.asarray(c) for c in chosen]


def routed_forward(model, tokens_BxL):
    """The trainer model's logits, and each MoE layer's chosen experts [tokens, k], sorted, as its routing
    chooses them (its config: softmax or sigmoid scores, groups, the selection bias), for the oracle tests."""
    import jax.numpy as jnp

    from trainer.moe.core import token_choice
    from trainer.moe.routing import router_logits

    x = jnp.take(model.embed[...], tokens_BxL, axis=0)
    chosen = []
    for block in model.layers():
        if block.is_moe:
            h = x + block.attn(block.attn_norm(x))
            h_TxD = block.ffn_norm(h).reshape(-1, h.shape[-1])
            bias = block.ffn.expert_bias[...] if block.ffn.cfg.uses_bias else None
            experts = token_choice(router_logits(h_TxD, block.ffn.router[...])[None], block.ffn.cfg, bias)[0][0]
            chosen.append(jnp.sort(experts, -1))
        x, _, _ = block(x, train=False)
    return model._logits(x), chosen
