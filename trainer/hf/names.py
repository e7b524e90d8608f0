"""Each trainer parameter and the Hub tensors it is made of: names, shapes and the exact transforms.

The Hub stores PyTorch's `[out, in]`; the trainer `[in, out]` with heads apart (wq [D, N, H], wo [N, H, D])
and experts stacked (w_gate [E, D, F]). Every transform is a transpose or a reshape, so values cross
unchanged, bit for bit, both ways. Routed experts are read from either layout on disk: one tensor per
expert (Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`, the others' `mlp.experts.N.gate/up/down_proj`),
or fused 3-D tensors (`mlp.experts.gate_up_proj` [E, 2F, D] with gate first, `down_proj` [E, D, F]), which
transformers 5 writes with `save_original_format=False`, Mixtral's router then as `mlp.gate` too.
Both rotary layouts are the half-split one (pairs (i, i + H/2): trainer/layers.py's rotary and
transformers' rotate_half), so q and k need no permutation; DeepSeek's interleaved rotary rows are permuted
(deepseek.py, whose latent attention's specs layer_specs takes for a model with model.mla).
"""

from __future__ import annotations

import numpy as np

from trainer.config import Config
from trainer.hf.base import Family, Spec, attention_specs, heads_in, heads_out, linear, same, transposed  # noqa: F401 (names' API)

PER_EXPERT, FUSED, MXFP4 = "per-expert", "fused", "mxfp4"


def _experts(param: str, hubs: list[str], e: int, d_in: int, d_out: int) -> Spec:
    """[E, d_in, d_out] stacked from E Hub tensors [d_out, d_in], one per expert."""
    return Spec(param, (e, d_in, d_out), {h: (d_out, d_in) for h in hubs}, _stacked_t,
                lambda w: [transposed(w[i]) for i in range(e)])


def _stacked_t(tensors) -> np.ndarray:
    """np.stack([t.T for t in tensors]), each tensor transposed into its place as it is read (convert.Tensors
    reads one when indexed), so that the stack and one tensor are held, not every tensor as well."""
    out = None
    for i in range(len(tensors)):
        t = tensors[i]
        if out is None:
            out = np.empty((len(tensors), *t.T.shape), t.dtype)
        out[i] = t.T
    return out


def _fused_half(param: str, hub: str, e: int, d: int, f: int, half: int) -> Spec:
    """w_gate (half 0) or w_in (half 1) [E, D, F] from gate_up_proj [E, 2F, D]; exporting writes the pair
    with the other half (see fused_gate_up)."""
    part = slice(half * f, (half + 1) * f)
    return Spec(param, (e, d, f), {hub: (e, 2 * f, d)},
                lambda ts: np.ascontiguousarray(ts[0][:, part, :].transpose(0, 2, 1)),
                lambda w: [np.ascontiguousarray(w.transpose(0, 2, 1))])


def fused_gate_up(w_gate_ExDxF: np.ndarray, w_in_ExDxF: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate([w_gate_ExDxF, w_in_ExDxF], axis=2).transpose(0, 2, 1))


def _moe(cfg: Config, fam: Family, i: int, layout: str) -> list[Spec]:
    m, moe = cfg.model, cfg.moe
    d, e, f = m.d_model, moe.num_experts, moe.d_ff
    # transformers 5 names a fused MoE block `mlp` in every family (Mixtral's per-expert files say block_sparse_moe)
    ffn, hub = f"blocks.{i}.ffn", f"model.layers.{i}.{'mlp' if layout == FUSED else fam.moe_prefix}"
    specs = [linear(f"{ffn}.router", f"{hub}.gate.weight", d, e)]
    if layout == FUSED:
        fused = f"{hub}.experts"
        specs += [_fused_half(f"{ffn}.w_gate", f"{fused}.gate_up_proj", e, d, f, 0),
                  _fused_half(f"{ffn}.w_in", f"{fused}.gate_up_proj", e, d, f, 1),
                  Spec(f"{ffn}.w_out", (e, f, d), {f"{fused}.down_proj": (e, d, f)},
                       lambda ts: np.ascontiguousarray(ts[0].transpose(0, 2, 1)),
                       lambda w: [np.ascontiguousarray(w.transpose(0, 2, 1))])]
    else:
        gate, up, down = fam.expert_names
        name = lambda j, which: f"{hub}.experts.{j}.{which}.weight"  # noqa: E731
        specs += [_experts(f"{ffn}.w_gate", [name(j, gate) for j in range(e)], e, d, f),
                  _experts(f"{ffn}.w_in", [name(j, up) for j in range(e)], e, d, f),
                  _experts(f"{ffn}.w_out", [name(j, down) for j in range(e)], e, f, d)]
    if moe.num_shared_experts:
        fs = moe.num_shared_experts * (moe.shared_d_ff or moe.d_ff)
        shared = f"{hub}.{fam.shared_name}"
        specs += [linear(f"{ffn}.shared_w_gate", f"{shared}.gate_proj.weight", d, fs),
                  linear(f"{ffn}.shared_w_in", f"{shared}.up_proj.weight", d, fs),
                  linear(f"{ffn}.shared_w_out", f"{shared}.down_proj.weight", fs, d)]
        if moe.shared_gate:
            specs.append(linear(f"{ffn}.shared_gate", f"{hub}.shared_expert_gate.weight", d, 1))
    if moe.uses_bias:  # DeepSeek-V3's selection bias: float32 state beside the parameters (orbax_io.BIAS)
        specs.append(same(f"{ffn}.expert_bias", f"{hub}.gate.e_score_correction_bias", (e,)))
    return specs


def _dense(cfg: Config, i: int) -> list[Spec]:
    d, f = cfg.model.d_model, cfg.model.d_ff
    ffn, hub = f"blocks.{i}.ffn", f"model.layers.{i}.mlp"
    return [linear(f"{ffn}.w_gate", f"{hub}.gate_proj.weight", d, f),
            linear(f"{ffn}.w_in", f"{hub}.up_proj.weight", d, f),
            linear(f"{ffn}.w_out", f"{hub}.down_proj.weight", f, d)]


def layer_specs(cfg: Config, fam: Family, i: int, layout: str = PER_EXPERT) -> list[Spec]:
    """Layer i's parameters, with routed experts in `layout` (PER_EXPERT, FUSED, or GPT-OSS's MXFP4)."""
    if fam.gpt_oss:
        from trainer.hf.gpt_oss import layer_specs as gpt_oss_specs

        return gpt_oss_specs(cfg, i, packed=layout == MXFP4)
    d = cfg.model.d_model
    hub = f"model.layers.{i}"
    ffn = _moe(cfg, fam, i, layout) if cfg.model.is_moe_layer(i) else _dense(cfg, i)
    if cfg.model.mla is not None:
        from trainer.hf.deepseek import mla_specs

        attention = mla_specs(cfg, i)
    else:
        attention = attention_specs(cfg, i)
    return [same(f"blocks.{i}.attn_norm.scale", f"{hub}.input_layernorm.weight", (d,)), *attention,
            same(f"blocks.{i}.ffn_norm.scale", f"{hub}.post_attention_layernorm.weight", (d,)), *ffn]


def outer_specs(cfg: Config) -> list[Spec]:
    """The parameters outside the layers: embedding, final norm, head (none when tied)."""
    m = cfg.model
    specs = [same("embed", "model.embed_tokens.weight", (m.vocab_size, m.d_model)),
             same("final_norm.scale", "model.norm.weight", (m.d_model,))]
    if not m.tie_embeddings:
        specs.append(linear("head", "lm_head.weight", m.d_model, m.vocab_size))
    return specs


def all_specs(cfg: Config, fam: Family, layouts: list[str] | None = None) -> list[list[Spec]]:
    """Every parameter, in groups read or written together: the outer ones, then one group per layer."""
    layouts = layouts or [PER_EXPERT] * cfg.model.num_layers
    return [outer_specs(cfg), *(layer_specs(cfg, fam, i, layouts[i]) for i in range(cfg.model.num_layers))]
