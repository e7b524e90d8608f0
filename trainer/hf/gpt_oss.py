"""GPT-OSS checkpoints: config.json to the trainer's config and back, and each layer's tensors.

Sources (transformers 5.25's gpt_oss configuration and modeling files, ../shared/HF-FACTS.md): every layer is
MoE; the router is a linear layer with a bias whose top k logits are softmaxed; each expert computes
(up + 1) * gate * sigmoid(swiglu_alpha * gate) with gate clamped to at most swiglu_limit and up to
[-swiglu_limit, swiglu_limit], its products with biases. The Hub stores the experts fused and [in, out]:
`gate_up_proj` [E, D, 2F] with gate and up interleaved (even columns gate, odd up), `down_proj` [E, F, D], or
as MXFP4 blocks and scales (mxfp4.py), dequantised to bfloat16 on import. Attention has biases on q, k, v and
the output, a learned sink logit per head (`sinks`), and per layer a sliding window or full attention
(`layer_types`, `sliding_window`); its rotary positions are YaRN's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.config import Config
from trainer.hf import base, mxfp4
from trainer.hf.base import Spec, linear, same
from trainer.hf.errors import HFError

# transformers' GptOssConfig defaults where config.json leaves a key out
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "truncate")
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
# Keys written from the trainer's config on export (beside families' shared ones).
_STRUCTURAL = {"swiglu_alpha", "swiglu_limit", "quantization_config", "experts_per_token", "num_experts"}


def _rope(keys: base.Keys, theta_default: float) -> tuple[float, dict | None]:
    """(RoPE theta, YaRN's keys or None) from 5.x's rope_parameters or 4.x's rope_scaling (GptOssConfig's YaRN
    where neither is given)."""
    params = keys.get("rope_parameters", (dict, type(None)), None)
    scaling = keys.get("rope_scaling", (dict, type(None)), None)
    source, where = (params, "rope_parameters") if params else (scaling, "rope_scaling") if scaling else \
        (DEFAULT_YARN, "rope_parameters")
    theta = source.get("rope_theta", keys.get("rope_theta", (int, float), theta_default))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise HFError(f"{keys.where}: 'rope_theta' must be a positive number, got {theta!r:.80}")
    kind = source.get("rope_type", source.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise HFError(f"{keys.where}: '{where}.rope_type' = {kind!r} is not supported (plain RoPE or YaRN)")
    unknown = sorted(set(source) - set(_YARN_KEYS) - {"rope_type", "type", "rope_theta"})
    if unknown:
        raise HFError(f"{keys.where}: '{where}.{unknown[0]}' is not supported (YaRN takes {', '.join(_YARN_KEYS)})")
    if "factor" not in source or "original_max_position_embeddings" not in source:
        raise HFError(f"{keys.where}: '{where}' of type yarn needs 'factor' and 'original_max_position_embeddings'")
    yarn = {k: source[k] for k in _YARN_KEYS if source.get(k) is not None}
    yarn.setdefault("truncate", True)  # transformers' YaRN truncates unless told not to
    return float(theta), yarn


def _layer_types(keys: base.Keys, layers: int) -> list[str]:
    """config.json's layer_types as the trainer's ("sliding", "full"); GptOssConfig alternates, sliding first."""
    given = keys.get("layer_types", (list, type(None)), None)
    if given is None:
        return ["sliding" if i % 2 == 0 else "full" for i in range(layers)]
    if len(given) != layers or any(t not in _LAYER_TYPES for t in given):
        raise HFError(f"{keys.where}: 'layer_types' must name {layers} layers, each of {sorted(_LAYER_TYPES)}, "
                      f"got {given!r:.120}")
    return [_LAYER_TYPES[t] for t in given]


def _attention(keys: base.Keys, d_model: int, heads: int, layers: int) -> dict[str, Any]:
    """The model section's attention keys."""
    types = _layer_types(keys, layers)
    sliding = "sliding" in types
    window = keys.get("sliding_window", (int, type(None)), 128)
    if sliding and (window is None or window < 1):
        raise HFError(f"{keys.where}: 'layer_types' has sliding layers, but 'sliding_window' is {window!r}")
    theta, yarn = _rope(keys, 150000.0)
    biased = keys.get("attention_bias", bool, True)
    return {"num_heads": heads, "num_kv_heads": keys.positive("num_key_value_heads", heads),
            "head_dim": keys.get("head_dim", (int, type(None)), None) or 64, "qkv_bias": biased,
            "out_bias": biased, "attention_sinks": True, "layer_types": types, "sliding_window": window if sliding
            else 0, "rope_theta": theta, "yarn": yarn}


def trainer_config(keys: base.Keys, fam: base.Family, dtype: str) -> Config:
    """The trainer's config of a GPT-OSS config.json (read by families.trainer_config)."""
    d_model, layers = keys.positive("hidden_size"), keys.positive("num_hidden_layers")
    try:
        mxfp4.is_mxfp4(keys.hf)
    except HFError as e:
        raise HFError(f"{keys.where}: {e}") from None
    width = keys.positive("intermediate_size")
    model = {"vocab_size": keys.positive("vocab_size"), "d_model": d_model, "num_layers": layers, "d_ff": width,
             "moe_every": 1, "norm_eps": float(keys.get("rms_norm_eps", (int, float), fam.default_eps)),
             "tie_embeddings": keys.get("tie_word_embeddings", bool, False), "tied_head_scale": False,
             **_attention(keys, d_model, keys.positive("num_attention_heads"), layers)}
    moe = {"num_experts": keys.positive("num_local_experts", alt="num_experts"),
           "top_k": keys.positive("num_experts_per_tok"), "d_ff": width, "capacity_factor": 0.0,
           "eval_capacity_factor": 0.0, "softmax_before_topk": False, "z_loss_coef": 0.0,
           "aux_loss_coef": float(keys.get("router_aux_loss_coef", (int, float), 0.001)),
           "router_bias": True, "ffn_bias": True, "activation": "clamped_swiglu",
           "swiglu_alpha": float(keys.get("swiglu_alpha", (int, float), 1.702)),
           "swiglu_limit": float(keys.get("swiglu_limit", (int, float), 7.0))}
    try:
        return Config.model_validate({"name": f"hf-{fam.model_type}", "dtype": dtype, "param_dtype": dtype,
                                      "model": model, "moe": moe})
    except ValueError as e:
        raise HFError(f"{keys.where}: the model it describes is not one the trainer builds: {e}") from None


def is_gpt_oss(cfg: Config) -> bool:
    """Whether the model has any of GPT-OSS's own features (which no other family has)."""
    m, e = cfg.model, cfg.moe
    return (m.attention_sinks or m.out_bias or bool(m.layer_types) or m.yarn is not None or e.router_bias
            or e.ffn_bias or e.activation != "swiglu")


def family_of(cfg: Config) -> base.Family:
    """gpt_oss, or HFError naming what of the model GPT-OSS does not have."""
    m, e = cfg.model, cfg.moe
    beyond = [(m.mla is not None, "model.mla"), (m.qk_norm != "none", "model.qk_norm"),
              (m.qkv_bias != m.out_bias, "model.qkv_bias without model.out_bias, or the other way round"),
              (not m.attention_sinks, "no model.attention_sinks"), (not e.router_bias, "no moe.router_bias"),
              (not e.ffn_bias, "no moe.ffn_bias"), (e.activation != "clamped_swiglu", f"moe.activation={e.activation}"),
              (e.softmax_before_topk, "moe.softmax_before_topk=true (GPT-OSS softmaxes the top k logits)"),
              (m.moe_every != 1 or bool(m.dense_layers), "dense layers (model.moe_every, model.dense_layers)"),
              (e.num_shared_experts > 0, "shared experts"), (e.routing != "token_choice", f"moe.routing={e.routing}"),
              (e.score != "softmax" or e.uses_bias or e.routing_groups_limit > 0 or e.route_scale != 1,
               "moe.score, moe.balance, moe.routing_groups_limit or moe.route_scale"),
              (m.tie_embeddings and m.tied_head_scale, "model.tied_head_scale=true")]
    for bad, what in beyond:
        if bad:
            raise HFError(f"the model has {what}, which GPT-OSS (the only family with attention sinks, expert "
                          "biases and the clamped SwiGLU) has not: it cannot be exported")
    return base.FAMILIES["gpt_oss"]


def hub_config(cfg: Config, fam: base.Family, carried: dict | None = None) -> dict[str, Any]:
    """config.json of `cfg` as GPT-OSS, with the Hub's key names (4.x's rope_scaling, which 5.x reads too);
    `carried` as families.hub_config. The experts are written in bfloat16 or float32, never MXFP4."""
    m, e = cfg.model, cfg.moe
    out = {k: v for k, v in (carried or {}).items() if k not in base.STRUCTURAL | _STRUCTURAL}
    types = [{"sliding": "sliding_attention", "full": "full_attention"}[t] for t in m.layer_types] or \
        ["full_attention"] * m.num_layers
    out.update({"architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": m.vocab_size,
                "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
                "num_key_value_heads": m.kv_heads, "head_dim": m.head_size, "intermediate_size": e.d_ff,
                "num_local_experts": e.num_experts, "num_experts_per_tok": e.top_k, "rms_norm_eps": m.norm_eps,
                "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings, "attention_bias": m.qkv_bias,
                "layer_types": types, "sliding_window": m.sliding_window or None, "swiglu_alpha": e.swiglu_alpha,
                "swiglu_limit": e.swiglu_limit, "router_aux_loss_coef": e.aux_loss_coef, "hidden_act": "silu",
                "torch_dtype": cfg.param_dtype})
    if m.yarn is not None:
        yarn = {k: v for k, v in m.yarn.model_dump().items() if k in _YARN_KEYS and (v or k == "truncate")}
        out["rope_scaling"] = {"rope_type": "yarn", **yarn}
    out.setdefault("max_position_embeddings", cfg.data.seq_len)  # the context it was trained on, unless imported
    return out


def _interleaved(param: str, partner: str, hub: dict[str, tuple[int, ...]], read, half: int, shape) -> Spec:
    """One half (0: even columns, gate; 1: odd, up) of an interleaved Hub tensor, read by `read` from the
    tensors of `hub`; half 0 writes the tensor back with its partner's values in the odd columns."""
    def take(ts):
        return np.ascontiguousarray(read(ts)[..., half::2])

    if half:
        return Spec(param, shape, hub, take, lambda w: [], written=())
    name = next(iter(hub))

    def both(gate, up):
        out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
        out[..., 0::2], out[..., 1::2] = gate, up
        return [out]

    return Spec(param, shape, hub, take, both, needs=(partner,), written=(name,))


def _moe_specs(cfg: Config, i: int, packed: bool) -> list[Spec]:
    m, moe = cfg.model, cfg.moe
    d, e, f = m.d_model, moe.num_experts, moe.d_ff
    ffn, hub = f"blocks.{i}.ffn", f"model.layers.{i}.mlp"
    experts = f"{hub}.experts"
    if packed:
        gate_up = {f"{experts}.gate_up_proj{s}": shape for s, shape in mxfp4.packed_shapes(e, 2 * f, d).items()}
        down = {f"{experts}.down_proj{s}": shape for s, shape in mxfp4.packed_shapes(e, d, f).items()}
        read = lambda ts: mxfp4.dequantized(ts[0], ts[1])  # noqa: E731
        down_spec = Spec(f"{ffn}.w_out", (e, f, d), down, read, lambda w: [], written=())  # export: bfloat16
    else:
        gate_up, read = {f"{experts}.gate_up_proj": (e, d, 2 * f)}, (lambda ts: ts[0])
        down_spec = same(f"{ffn}.w_out", f"{experts}.down_proj", (e, f, d))
    bias = {f"{experts}.gate_up_proj_bias": (e, 2 * f)}
    return [linear(f"{ffn}.router", f"{hub}.router.weight", d, e),
            same(f"{ffn}.router_bias", f"{hub}.router.bias", (e,)),
            _interleaved(f"{ffn}.w_gate", f"{ffn}.w_in", gate_up, read, 0, (e, d, f)),
            _interleaved(f"{ffn}.w_in", f"{ffn}.w_gate", gate_up, read, 1, (e, d, f)),
            _interleaved(f"{ffn}.b_gate", f"{ffn}.b_in", bias, lambda ts: ts[0], 0, (e, f)),
            _interleaved(f"{ffn}.b_in", f"{ffn}.b_gate", bias, lambda ts: ts[0], 1, (e, f)),
            down_spec, same(f"{ffn}.b_out", f"{experts}.down_proj_bias", (e, d))]


def layer_specs(cfg: Config, i: int, packed: bool = False) -> list[Spec]:
    """Layer i's parameters; with `packed` its experts' matrices are read from MXFP4 blocks and scales."""
    d, hub = cfg.model.d_model, f"model.layers.{i}"
    return [same(f"blocks.{i}.attn_norm.scale", f"{hub}.input_layernorm.weight", (d,)), *base.attention_specs(cfg, i),
            same(f"blocks.{i}.ffn_norm.scale", f"{hub}.post_attention_layernorm.weight", (d,)),
            *_moe_specs(cfg, i, packed)]


def is_packed(name: str) -> bool:
    """An MXFP4 tensor's name (its uint8 blocks or scales)."""
    return name.endswith((mxfp4.BLOCKS, mxfp4.SCALES))
