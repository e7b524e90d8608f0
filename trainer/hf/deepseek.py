"""DeepSeek-V2 and DeepSeek-V3 checkpoints: config.json to the trainer's config and back, and the attention's
tensors (multi-head latent attention, trainer/mla.py).

Sources (transformers 5.25's deepseek_v2 and deepseek_v3 configuration and modeling files,
../shared/HF-FACTS.md): the first `first_k_dense_replace` layers are dense; every other layer routes
`num_experts_per_tok` of `n_routed_experts` and adds `n_shared_experts` shared experts without a gate. V3 scores
with sigmoids, chooses with `e_score_correction_bias` added (the trainer's selection bias, moe.balance=bias),
keeps the `topk_group` best of `n_group` groups by the sum of their two best, renormalises with
`norm_topk_prob` and scales by `routed_scaling_factor`. V2 scores with a softmax, keeps groups by their best
score (`topk_method` group_limited_greedy) and scales without renormalising. Both lay the rotary part of q and
k out in interleaved pairs (V2's complex product, V3's `rope_interleave`); the trainer's rotary pairs are
(i, i + R/2), so import permutes those rows and export permutes them back, bit for bit. A V3 file's
multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is skipped, as transformers skips it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.config import Config
from trainer.hf import base, fp8
from trainer.hf.base import Spec, heads_in, heads_out, linear, same
from trainer.hf.errors import HFError

# transformers' defaults where config.json leaves a key out (its configuration classes)
DEFAULTS = {
    "deepseek_v2": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0,
                        topk_method="greedy", n_routed_experts=64, moe_intermediate_size=1407),
    "deepseek_v3": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5,
                        topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                        n_routed_experts=256, moe_intermediate_size=2048),
}
_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Keys written from the trainer's config on export (beside families' shared ones).
_STRUCTURAL = {"q_lora_rank", *_MLA_KEYS, "first_k_dense_replace", "n_shared_experts", "n_routed_experts",
               "routed_scaling_factor", "topk_method", "n_group", "topk_group", "rope_interleave", "mlp_bias",
               "moe_layer_freq", "aux_loss_alpha", "qk_head_dim", "quantization_config"}


def _refuse(keys: base.Keys, fam: base.Family, heads: int) -> None:
    keys.refuse("hidden_act", "silu", "the experts and FFNs are SwiGLU (silu)")
    keys.refuse("attention_bias", False, "no biases in the attention")
    keys.refuse("mlp_bias", False, "no biases in the FFNs")
    keys.refuse("moe_layer_freq", 1, "after the first_k_dense_replace dense layers every layer is MoE")
    keys.refuse("rope_interleave", True, "the rotary pairs are permuted from the interleaved layout")
    fp8.block_size(keys.hf, keys.where)  # FP8 with block scales, dequantised on import; another is refused
    if keys.get("num_key_value_heads", (int, type(None)), None) not in (None, heads):
        raise HFError(f"{keys.where}: 'num_key_value_heads' = {keys.hf['num_key_value_heads']} must equal "
                      f"'num_attention_heads' = {heads}: latent attention expands keys and values for every head")


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")


def _rope(keys: base.Keys, fam: base.Family) -> tuple[float, dict | None]:
    """(RoPE theta, YaRN's keys or None) from 5.x's rope_parameters or 4.x's rope_scaling; another scaling
    is refused naming its key."""
    params = keys.get("rope_parameters", (dict, type(None)), None) or {}
    scaling = keys.get("rope_scaling", (dict, type(None)), None) or {}
    source, where = (params, "rope_parameters") if params.get("rope_type", "default") != "default" else \
        (scaling, "rope_scaling")
    kind = source.get("rope_type", source.get("type"))
    if kind not in (None, "default", "yarn"):
        raise HFError(f"{keys.where}: '{where}.rope_type' = {kind!r} is not supported (plain RoPE or YaRN)")
    theta = params.get("rope_theta", keys.get("rope_theta", (int, float), fam.default_theta))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise HFError(f"{keys.where}: 'rope_theta' must be a positive number, got {theta!r:.80}")
    if kind != "yarn":
        return float(theta), None
    yarn = {k: source[k] for k in _YARN_KEYS if source.get(k) is not None}
    if "factor" not in yarn or "original_max_position_embeddings" not in yarn:
        raise HFError(f"{keys.where}: '{where}' of type yarn needs 'factor' and 'original_max_position_embeddings'")
    unknown = sorted(set(source) - set(_YARN_KEYS) - {"rope_type", "type", "rope_theta"})
    if unknown:
        raise HFError(f"{keys.where}: '{where}.{unknown[0]}' is not supported (YaRN takes {', '.join(_YARN_KEYS)})")
    return float(theta), yarn


def _routing(keys: base.Keys, fam: base.Family, get) -> dict[str, Any]:
    """The MoE section's routing keys: V3's sigmoid with its selection bias, or V2's softmax."""
    scale = float(get("routed_scaling_factor", (int, float)))
    if scale <= 0:
        raise HFError(f"{keys.where}: 'routed_scaling_factor' must be positive, got {scale}")
    method = get("topk_method", str)
    common = {"route_scale": scale, "capacity_factor": 0.0, "eval_capacity_factor": 0.0, "z_loss_coef": 0.0}
    if fam.model_type == "deepseek_v3":
        if method != "noaux_tc":
            raise HFError(f"{keys.where}: 'topk_method' = {method!r} is not DeepSeek-V3's (noaux_tc)")
        if get("norm_topk_prob", bool) and keys.positive("num_experts_per_tok") == 1:
            raise HFError(f"{keys.where}: 'num_experts_per_tok' = 1 with 'norm_topk_prob' is not supported (one "
                          "normalised sigmoid weight is 1: the trainer keeps the score)")
        groups = keys.positive("n_group", DEFAULTS["deepseek_v3"]["n_group"])
        return {**common, "score": "sigmoid", "balance": "bias", "aux_loss_coef": 0.0, "expert_groups": groups,
                "routing_groups_limit": keys.positive("topk_group", DEFAULTS["deepseek_v3"]["topk_group"]),
                "renormalize": get("norm_topk_prob", bool)}
    out = {**common, "score": "softmax", "renormalize": False,
           "aux_loss_coef": float(keys.get("aux_loss_alpha", (int, float), 0.001))}
    if method == "group_limited_greedy":
        return {**out, "expert_groups": keys.positive("n_group"), "routing_groups_limit": keys.positive("topk_group"),
                "group_score": "max"}
    if method != "greedy":
        raise HFError(f"{keys.where}: 'topk_method' = {method!r} is not supported (greedy or group_limited_greedy)")
    return out


def trainer_config(keys: base.Keys, fam: base.Family, dtype: str) -> Config:
    """The trainer's config of a DeepSeek-V2 or V3 config.json (read by families.trainer_config)."""
    defaults = DEFAULTS[fam.model_type]
    get = lambda key, kind: keys.get(key, kind, defaults.get(key, ...))  # noqa: E731
    d_model, heads, layers = keys.positive("hidden_size"), keys.positive("num_attention_heads"), \
        keys.positive("num_hidden_layers")
    _refuse(keys, fam, heads)
    dense = get("first_k_dense_replace", int)
    if not 0 <= dense <= layers:
        raise HFError(f"{keys.where}: 'first_k_dense_replace' must be in [0, {layers}], got {dense}")
    mla = {key: keys.positive(key, defaults[key]) for key in _MLA_KEYS}
    mla["q_lora_rank"] = keys.get("q_lora_rank", (int, type(None)), defaults["q_lora_rank"]) or 0
    rope_theta, mla["yarn"] = _rope(keys, fam)
    model = {"vocab_size": keys.positive("vocab_size"), "d_model": d_model, "num_layers": layers, "num_heads": heads,
             "d_ff": keys.positive("intermediate_size"), "moe_every": 1, "dense_layers": list(range(dense)),
             "rope_theta": rope_theta,
             "norm_eps": float(keys.get("rms_norm_eps", (int, float), fam.default_eps)),
             "tie_embeddings": keys.get("tie_word_embeddings", bool, False), "tied_head_scale": False, "mla": mla}
    width = keys.positive("moe_intermediate_size", defaults["moe_intermediate_size"])
    moe = {"num_experts": keys.positive("n_routed_experts", defaults["n_routed_experts"],
                                        alt="num_local_experts" if fam.model_type == "deepseek_v3" else "num_experts"),
           "top_k": keys.positive("num_experts_per_tok"), "d_ff": width, "jitter": 0.0,
           "num_shared_experts": keys.positive("n_shared_experts", defaults["n_shared_experts"]),
           **_routing(keys, fam, get)}
    try:
        return Config.model_validate({"name": f"hf-{fam.model_type}", "dtype": dtype, "param_dtype": dtype,
                                      "model": model, "moe": moe})
    except ValueError as e:
        raise HFError(f"{keys.where}: the model it describes is not one the trainer builds: {e}") from None


def family_of(cfg: Config) -> base.Family:
    """deepseek_v3 for sigmoid routing with a selection bias, deepseek_v2 for softmax routing; HFError naming
    the key that neither has."""
    m, e = cfg.model, cfg.moe
    v3 = e.score == "sigmoid"
    beyond = [(m.mla is None, "no model.mla (DeepSeek's attention is latent)"),
              (m.moe_every != 1 or list(m.dense_layers) != list(range(len(m.dense_layers))),
               "a layer pattern other than its first layers dense (model.moe_every, model.dense_layers)"),
              (e.routing != "token_choice" or not e.softmax_before_topk, "moe.routing / moe.softmax_before_topk"),
              (e.num_shared_experts < 1 or e.shared_gate, "no ungated shared expert (moe.num_shared_experts, "
               "moe.shared_gate)"), (e.shared_d_ff not in (0, e.d_ff), "moe.shared_d_ff other than moe.d_ff"),
              (m.tie_embeddings and m.tied_head_scale, "model.tied_head_scale=true"),
              (v3 and not e.uses_bias, "sigmoid scores without the selection bias (moe.balance=aux_loss)"),
              (v3 and e.renormalize and e.top_k == 1, "one sigmoid-scored expert a token kept unnormalised"),
              (v3 and e.routing_groups_limit and e.group_score != "top2_sum", "moe.group_score=max with sigmoid"),
              (not v3 and (e.renormalize or e.uses_bias), "softmax scores renormalised or with a selection bias "
               "(moe.renormalize, moe.balance)"),
              (not v3 and e.routing_groups_limit and e.group_score != "max", "moe.group_score=top2_sum with softmax")]
    for bad, what in beyond:
        if bad:
            raise HFError(f"the model has {what}, which neither DeepSeek-V2 nor DeepSeek-V3 has: it cannot be exported")
    return base.FAMILIES["deepseek_v3" if v3 else "deepseek_v2"]


def hub_config(cfg: Config, fam: base.Family, carried: dict | None = None) -> dict[str, Any]:
    """config.json of `cfg` as DeepSeek-V2 or V3, with the Hub's key names; `carried` as families.hub_config."""
    m, e, a = cfg.model, cfg.moe, cfg.model.mla
    out = {k: v for k, v in (carried or {}).items() if k not in base.STRUCTURAL | _STRUCTURAL}
    out.update({"architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": m.vocab_size,
                "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
                "num_key_value_heads": m.num_heads, "intermediate_size": m.d_ff, "hidden_act": "silu",
                "moe_intermediate_size": e.d_ff, "n_routed_experts": e.num_experts, "num_experts_per_tok": e.top_k,
                "n_shared_experts": e.num_shared_experts, "first_k_dense_replace": len(m.dense_layers),
                "routed_scaling_factor": e.route_scale, "q_lora_rank": a.q_lora_rank or None,
                **{key: getattr(a, key) for key in _MLA_KEYS}, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
                "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "torch_dtype": cfg.param_dtype})
    if a.yarn is not None:  # the Hub's (4.x) key, which 5.x reads too
        yarn = {k: v for k, v in a.yarn.model_dump().items() if v or k == "truncate"}
        out["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", **yarn}
    out.setdefault("max_position_embeddings", cfg.data.seq_len)  # the context it was trained on, unless imported
    groups = e.expert_groups or 1
    if fam.model_type == "deepseek_v3":
        out.update(topk_method="noaux_tc", n_group=groups, topk_group=e.routing_groups_limit or groups,
                   norm_topk_prob=e.renormalize, rope_interleave=True)
    else:
        limited = e.routing_groups_limit > 0
        out.update(topk_method="group_limited_greedy" if limited else "greedy", mlp_bias=False,
                   n_group=groups if limited else None, topk_group=e.routing_groups_limit if limited else None,
                   aux_loss_alpha=e.aux_loss_coef)
    return out


def rope_order(groups: int, size: int, start: int) -> np.ndarray:
    """Row order that takes each of `groups` blocks of `size` rows from the Hub's layout to the trainer's: the
    first `start` rows as they are, then the rotary rows' pairs (start + 2t, start + 2t + 1) split into
    evens then odds, so that the trainer's pairs (t, t + R/2) are the Hub's."""
    rope = np.arange(start, size)
    block = np.concatenate([np.arange(start), rope[0::2], rope[1::2]])
    return np.concatenate([g * size + block for g in range(groups)])


def _rows(spec: Spec, order: np.ndarray) -> Spec:
    """`spec` with its one Hub tensor's rows (its output features) taken in `order` on import, put back on
    export."""
    back = np.argsort(order)
    return Spec(spec.param, spec.shape, spec.hub, lambda ts: spec.to_trainer([ts[0][order]]),
                lambda w: [np.ascontiguousarray(spec.to_hub(w)[0][back])])


def mla_specs(cfg: Config, i: int) -> list[Spec]:
    """Layer i's latent attention: q (through q_lora_rank or not), the joint key/value latent with the shared
    rotary key, their norms, the expansion to heads and the output projection."""
    m, a = cfg.model, cfg.model.mla
    d, n, c, q = m.d_model, m.num_heads, a.kv_lora_rank, a.qk_head_dim
    at, hub = f"blocks.{i}.attn", f"model.layers.{i}.self_attn"
    q_order = rope_order(n, q, a.qk_nope_head_dim)
    if a.q_lora_rank:
        specs = [linear(f"{at}.wq_a", f"{hub}.q_a_proj.weight", d, a.q_lora_rank),
                 same(f"{at}.q_norm.scale", f"{hub}.q_a_layernorm.weight", (a.q_lora_rank,)),
                 _rows(heads_in(f"{at}.wq_b", f"{hub}.q_b_proj.weight", a.q_lora_rank, n, q), q_order)]
    else:
        specs = [_rows(heads_in(f"{at}.wq", f"{hub}.q_proj.weight", d, n, q), q_order)]
    return specs + [
        _rows(linear(f"{at}.wkv_a", f"{hub}.kv_a_proj_with_mqa.weight", d, c + a.qk_rope_head_dim),
              rope_order(1, c + a.qk_rope_head_dim, c)),
        same(f"{at}.kv_norm.scale", f"{hub}.kv_a_layernorm.weight", (c,)),
        heads_in(f"{at}.wkv_b", f"{hub}.kv_b_proj.weight", c, n, a.qk_nope_head_dim + a.v_head_dim),
        heads_out(f"{at}.wo", f"{hub}.o_proj.weight", d, n, a.v_head_dim)]


def skipped(hub: dict, name: str) -> bool:
    """A V3 file's multi-token-prediction layers (model.layers.{num_hidden_layers}.* and on), which transformers
    does not load either."""
    if hub.get("model_type") != "deepseek_v3" or not name.startswith("model.layers."):
        return False
    layer = name.split(".")[2]
    return layer.isdigit() and int(layer) >= hub.get("num_hidden_layers", 0)
