"""The families' config.json, read into the trainer's config and written back with the Hub's key names.

Sources (transformers 5.25's configuration and modeling files, ../shared/HF-FACTS.md): Mixtral routes every
layer, renormalises the top k and names its experts `num_local_experts`; Qwen2-MoE adds q/k/v biases and a
sigmoid-gated shared expert; Qwen3-MoE an RMSNorm of each head's q and k; OLMoE an RMSNorm over all of q and
of k. The Qwen families interleave dense layers (`decoder_sparse_step`, `mlp_only_layers`) and, with OLMoE,
renormalise the top k only with `norm_topk_prob`. A feature the trainer does not implement (a sliding window
in use, a RoPE scaling, `clip_qkv`, biases on the output projection) is refused naming its key. DeepSeek-V2
and V3 (latent attention, their routing) are described in deepseek.py and GPT-OSS (attention sinks, sliding
layers, expert biases, the clamped SwiGLU, MXFP4 experts) in gpt_oss.py, which the functions here hand them to.
Importing this module imports no jax.
"""

from __future__ import annotations

import os
from typing import Any

import pydantic

from trainer.config import Config
from trainer.hf.base import FAMILIES, STRUCTURAL, Family, Keys, family  # noqa: F401 (the families' API)
from trainer.hf.errors import HFError


def _rope_theta(keys: Keys, fam: Family) -> float:
    """The RoPE base, from 5.x's rope_parameters or 4.x's top-level rope_theta; any scaling is refused."""
    params = keys.get("rope_parameters", (dict, type(None)), None) or {}
    scaling = keys.get("rope_scaling", (dict, type(None)), None) or {}
    for name, where in ((params.get("rope_type"), "rope_parameters.rope_type"),
                        (scaling.get("rope_type", scaling.get("type")), "rope_scaling.rope_type")):
        if name not in (None, "default"):
            raise HFError(f"{keys.where}: '{where}' = {name!r} is not supported (the trainer's rotary positions "
                          "have no scaling); convert a checkpoint with the default RoPE")
    theta = params.get("rope_theta", keys.get("rope_theta", (int, float), fam.default_theta))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise HFError(f"{keys.where}: 'rope_theta' must be a positive number, got {theta!r:.80}")
    return float(theta)


def _refuse_unsupported(keys: Keys, fam: Family, max_positions: int) -> None:
    keys.refuse("hidden_act", "silu", "the experts and FFNs are SwiGLU (silu)")
    keys.refuse("clip_qkv", None, "q, k and v are not clipped")
    if fam.model_type != "qwen2_moe":  # Qwen3-MoE and OLMoE put it on the output projection too
        keys.refuse("attention_bias", False, "no bias on the attention's output projection")
    window = keys.hf.get("sliding_window")
    used = keys.hf.get("use_sliding_window", fam.model_type == "mixtral")
    if used and window is not None and window < max_positions:
        raise HFError(f"{keys.where}: 'sliding_window' = {window} is in use (under max_position_embeddings "
                      f"{max_positions}) and not supported: attention is full and causal")
    layer_types = keys.hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise HFError(f"{keys.where}: 'layer_types' names {sorted(set(layer_types) - {'full_attention'})}: only "
                      "full attention is supported")


def trainer_config(hf: dict, where: str, dtype: str) -> Config:
    """The trainer's config of the checkpoint described by `hf` (config.json's contents, read from `where`),
    with its parameters kept in `dtype`. Dropless MoE: a trained model must not lose tokens at capacity."""
    keys = Keys(hf, where)
    fam = family(hf.get("model_type"), where)
    if fam.mla:
        from trainer.hf import deepseek

        return deepseek.trainer_config(keys, fam, dtype)
    if fam.gpt_oss:
        from trainer.hf import gpt_oss

        return gpt_oss.trainer_config(keys, fam, dtype)
    d_model, heads = keys.positive("hidden_size"), keys.positive("num_attention_heads")
    max_positions = keys.get("max_position_embeddings", int, 4096)
    _refuse_unsupported(keys, fam, max_positions)
    experts = keys.positive(fam.experts_key, alt="num_local_experts" if fam.experts_key == "num_experts" else
                            "num_experts")
    layers = keys.positive("num_hidden_layers")
    head_dim = keys.get("head_dim", (int, type(None)), None) or d_model // heads
    model = {"vocab_size": keys.positive("vocab_size"), "d_model": d_model, "num_layers": layers,
             "num_heads": heads, "num_kv_heads": keys.get("num_key_value_heads", (int, type(None)), None) or heads,
             "head_dim": head_dim, "d_ff": keys.positive("intermediate_size"), "moe_every": 1,
             "rope_theta": _rope_theta(keys, fam),
             "norm_eps": float(keys.get("rms_norm_eps", (int, float), fam.default_eps)),
             "tie_embeddings": keys.get("tie_word_embeddings", bool, False), "tied_head_scale": False,
             "qk_norm": fam.qk_norm,
             "qkv_bias": keys.get(fam.qkv_bias_key, bool, True) if fam.qkv_bias_key else False}
    moe = {"num_experts": experts, "top_k": keys.positive("num_experts_per_tok"),
           "d_ff": keys.positive(fam.expert_width_key), "capacity_factor": 0.0, "eval_capacity_factor": 0.0,
           "renormalize": keys.get(fam.norm_topk_key, bool, False) if fam.norm_topk_key else True,
           "aux_loss_coef": float(keys.get("router_aux_loss_coef", (int, float), 0.001)), "z_loss_coef": 0.0,
           "jitter": float(keys.get("router_jitter_noise", (int, float), 0.0))}
    if fam.sparse_pattern:
        model["moe_every"] = keys.positive("decoder_sparse_step", 1)
        dense = keys.get("mlp_only_layers", (list, type(None)), None) or []
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in dense):
            raise HFError(f"{where}: 'mlp_only_layers' must list layers in [0, {layers}), got {dense!r:.80}")
        model["dense_layers"] = sorted(set(dense))
    if fam.shared_expert:
        moe.update(num_shared_experts=1, shared_gate=True, shared_d_ff=keys.positive("shared_expert_intermediate_size"))
    try:
        return Config.model_validate({"name": f"hf-{fam.model_type}", "dtype": dtype, "param_dtype": dtype,
                                      "model": model, "moe": moe})
    except ValueError as e:
        raise HFError(f"{where}: the model it describes is not one the trainer builds: {e}") from None


def family_of(cfg: Config, hinted: str | None = None) -> Family:
    """The family a trainer model exports as (`hinted`, the imported one, when it still fits), or HFError
    naming the feature that no family has."""
    m, e = cfg.model, cfg.moe
    if m.mla is not None or hinted in ("deepseek_v2", "deepseek_v3"):
        from trainer.hf import deepseek

        return deepseek.family_of(cfg)
    from trainer.hf import gpt_oss

    if hinted == "gpt_oss" or gpt_oss.is_gpt_oss(cfg):
        return gpt_oss.family_of(cfg)
    beyond = [(e.routing != "token_choice", f"moe.routing={e.routing}"), (e.score != "softmax", f"moe.score={e.score}"),
              (not e.softmax_before_topk, "moe.softmax_before_topk=false"), (e.route_scale != 1, "moe.route_scale"),
              (e.uses_bias, f"moe.balance={e.balance}"), (e.routing_groups_limit > 0, "moe.routing_groups_limit"),
              (m.tie_embeddings and m.tied_head_scale, "model.tied_head_scale=true (the tied head scaled by "
               "d_model**-0.5)"), (m.moe_every == 0, "model.moe_every=0 (no MoE layer)"),
              (e.num_shared_experts > 0 and not e.shared_gate, "shared experts without a gate (moe.shared_gate)")]
    for bad, what in beyond:
        if bad:
            raise HFError(f"the model has {what}, which none of the families (Mixtral, Qwen2-MoE, Qwen3-MoE, "
                          "OLMoE, DeepSeek, GPT-OSS) has: it cannot be exported")
    fits = [f for f in FAMILIES.values() if _fits(f, cfg)]
    if not fits:
        raise HFError(f"no family has this combination: q/k norm {m.qk_norm!r}, q/k/v bias {m.qkv_bias}, "
                      f"{e.num_shared_experts} shared experts, top-k renormalised {e.renormalize}, MoE every "
                      f"{m.moe_every} layers with dense layers {list(m.dense_layers)}")
    return next((f for f in fits if f.model_type == hinted), fits[0])


def _fits(fam: Family, cfg: Config) -> bool:
    m, e = cfg.model, cfg.moe
    patterned = m.moe_every != 1 or bool(m.dense_layers)
    return (not fam.mla and not fam.gpt_oss and fam.qk_norm == m.qk_norm
            and (m.qkv_bias <= (fam.qkv_bias_key is not None))
            and (e.num_shared_experts > 0) == fam.shared_expert and (not patterned or fam.sparse_pattern)
            and (fam.norm_topk_key is not None or e.renormalize) and (e.num_shared_experts <= 1)
            and (fam.qk_norm != "full" or m.head_size * m.num_heads == m.d_model))  # OLMoE derives the head size


def hub_config(cfg: Config, fam: Family, carried: dict | None = None) -> dict[str, Any]:
    """config.json for `cfg` as `fam`, with the Hub's key names (a top-level rope_theta, the expert count
    under the family's own key) so that transformers 4.x and 5.x read it alike; `carried` (the imported
    config.json) gives the keys that are no part of the model's shape."""
    m, e = cfg.model, cfg.moe
    if fam.mla:
        from trainer.hf import deepseek

        return deepseek.hub_config(cfg, fam, carried)
    if fam.gpt_oss:
        from trainer.hf import gpt_oss

        return gpt_oss.hub_config(cfg, fam, carried)
    out = {k: v for k, v in (carried or {}).items() if k not in STRUCTURAL}
    out.update({"architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": m.vocab_size,
                "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
                "num_key_value_heads": m.kv_heads, "head_dim": m.head_size, "hidden_act": "silu",
                fam.experts_key: e.num_experts, "num_experts_per_tok": e.top_k, "rms_norm_eps": m.norm_eps,
                "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings,
                "router_aux_loss_coef": e.aux_loss_coef, "torch_dtype": cfg.param_dtype})
    out.setdefault("max_position_embeddings", cfg.data.seq_len)  # the context it was trained on, unless imported
    out["intermediate_size"] = e.d_ff if fam.expert_width_key == "intermediate_size" else m.d_ff
    if fam.expert_width_key != "intermediate_size":
        out[fam.expert_width_key] = e.d_ff
    if fam.norm_topk_key:
        out[fam.norm_topk_key] = e.renormalize
    if fam.sparse_pattern:
        out.update(decoder_sparse_step=m.moe_every, mlp_only_layers=list(m.dense_layers), use_sliding_window=False)
    if fam.qkv_bias_key:
        out[fam.qkv_bias_key] = m.qkv_bias
    if fam.shared_expert:
        out["shared_expert_intermediate_size"] = e.num_shared_experts * (e.shared_d_ff or e.d_ff)
    if fam.model_type == "mixtral":
        out.update(router_jitter_noise=e.jitter, sliding_window=None)
    if fam.model_type in ("qwen3_moe", "olmoe"):
        out["attention_bias"] = False
    return out


def load_trainer_config(path: str) -> Config:
    """A run's config.json (the trainer's config, as train and import write it)."""
    import json

    from trainer.config import describe

    if not os.path.isfile(path):
        raise HFError(f"{path} does not exist: the run's config is needed to know its model")
    try:
        with open(path, encoding="utf-8") as f:
            return Config.model_validate(json.load(f))
    except pydantic.ValidationError as e:
        raise HFError(f"{path}: {describe(e.errors()[0])}") from None
    except (ValueError, OSError) as e:
        raise HFError(f"{path} is not a trainer config: {e}") from None
