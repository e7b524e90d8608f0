"""What every family's description shares: the families' table (Family), typed reads of a config.json
(Keys), and a trainer parameter's Hub tensors with their transforms (Spec and its common shapes).

families.py and names.py describe Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE with these, and hand DeepSeek's
models to deepseek.py and GPT-OSS's to gpt_oss.py, which build on this module alone: none of them imports
another that imports it.
Importing this module imports no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from trainer.hf.errors import HFError


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    experts_key: str  # the Hub's name of the routed expert count
    moe_prefix: str  # the MoE block's module in a layer: "block_sparse_moe" or "mlp"
    expert_names: tuple[str, str, str]  # one expert's (gate, up, down) modules on disk
    default_theta: float
    default_eps: float
    expert_width_key: str  # the per-expert hidden size's key
    qk_norm: str = "none"
    qkv_bias_key: str | None = None  # the key of q/k/v biases, where the family has them
    shared_expert: bool = False
    sparse_pattern: bool = False  # decoder_sparse_step and mlp_only_layers
    norm_topk_key: str | None = "norm_topk_prob"  # None: always renormalised
    shared_name: str = "shared_expert"  # the shared expert's module in the MoE block
    mla: bool = False  # multi-head latent attention and DeepSeek's routing (trainer/hf/deepseek.py)
    gpt_oss: bool = False  # attention sinks, expert biases, the clamped SwiGLU (trainer/hf/gpt_oss.py)


FAMILIES = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM", "num_local_experts", "block_sparse_moe", ("w1", "w3", "w2"), 1e6, 1e-5,
           "intermediate_size", norm_topk_key=None),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "num_experts", "mlp", ("gate_proj", "up_proj", "down_proj"), 1e4,
           1e-6, "moe_intermediate_size", qkv_bias_key="qkv_bias", shared_expert=True, sparse_pattern=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "num_experts", "mlp", ("gate_proj", "up_proj", "down_proj"), 1e4,
           1e-6, "moe_intermediate_size", qk_norm="head", sparse_pattern=True),
    Family("olmoe", "OlmoeForCausalLM", "num_experts", "mlp", ("gate_proj", "up_proj", "down_proj"), 1e4, 1e-5,
           "intermediate_size", qk_norm="full"),
    *(Family(t, a, "n_routed_experts", "mlp", ("gate_proj", "up_proj", "down_proj"), 1e4, 1e-6, "moe_intermediate_size",
             shared_expert=True, shared_name="shared_experts", mla=True)
      for t, a in (("deepseek_v2", "DeepseekV2ForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM"))),
    Family("gpt_oss", "GptOssForCausalLM", "num_local_experts", "mlp", ("gate_up_proj", "gate_up_proj", "down_proj"),
           150000.0, 1e-5, "intermediate_size", gpt_oss=True),
)}

# Keys written from the trainer's config on export; every other key of the imported config.json (token ids,
# max_position_embeddings, initializer_range, ...) is carried over as it was.
STRUCTURAL = {"architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
               "num_local_experts", "num_experts_per_tok", "shared_expert_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "attention_bias", "rms_norm_eps", "rope_theta",
               "rope_parameters", "rope_scaling", "tie_word_embeddings", "hidden_act", "torch_dtype", "dtype",
               "router_aux_loss_coef", "router_jitter_noise", "layer_types", "use_sliding_window", "sliding_window",
               "clip_qkv"}


def family(model_type: Any, where: str) -> Family:
    if model_type not in FAMILIES:
        raise HFError(f"{where}: model_type {model_type!r} is none of the families this tool converts "
                      f"({', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type]


class Keys:
    """Typed reads of config.json's keys, each error naming the file and the key."""

    def __init__(self, hf: dict, where: str):
        self.hf, self.where = hf, where

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, alt: str | None = None) -> Any:
        value = self.hf.get(key, self.hf.get(alt, default) if alt else default)
        if value is ...:
            raise HFError(f"{self.where}: the key '{key}' is missing")
        wanted = (kind,) if isinstance(kind, type) else kind
        ok = isinstance(value, wanted) and not (isinstance(value, bool) and bool not in wanted)
        if int in wanted and float in wanted and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise HFError(f"{self.where}: '{key}' must be {' or '.join(t.__name__ for t in wanted)}, got {value!r:.80}")
        return value

    def positive(self, key: str, default: Any = ..., *, alt: str | None = None) -> int:
        value = self.get(key, int, default, alt=alt)
        if value < 1:
            raise HFError(f"{self.where}: '{key}' must be at least 1, got {value}")
        return value

    def refuse(self, key: str, unused: Any, why: str) -> None:
        if self.hf.get(key, unused) not in (unused, None):
            raise HFError(f"{self.where}: '{key}' = {self.hf[key]!r:.80} is not supported ({why}); convert a "
                          "checkpoint without it")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One trainer parameter: its name and shape, the Hub tensors (name -> shape) that make it, and how."""

    param: str
    shape: tuple[int, ...]
    hub: dict[str, tuple[int, ...]]
    to_trainer: Callable[[list[np.ndarray]], np.ndarray]  # the hub tensors, in `hub`'s order
    to_hub: Callable[..., list[np.ndarray]]  # the parameter's value, then those of `needs`
    # Where two parameters make one Hub tensor (GPT-OSS's interleaved gate_up_proj): the other parameters whose
    # values the export's to_hub takes too, and the Hub tensors it writes (None: all of `hub`; a spec whose
    # partner writes the shared tensor writes none).
    needs: tuple[str, ...] = ()
    written: tuple[str, ...] | None = None

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(self.hub) if self.written is None else self.written


def transposed(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def linear(param: str, hub: str, d_in: int, d_out: int) -> Spec:
    """A [d_in, d_out] trainer matrix that is a Hub [d_out, d_in] Linear weight."""
    return Spec(param, (d_in, d_out), {hub: (d_out, d_in)}, lambda ts: transposed(ts[0]), lambda w: [transposed(w)])


def same(param: str, hub: str, shape: tuple[int, ...], hub_shape: tuple[int, ...] | None = None) -> Spec:
    hub_shape = hub_shape or shape
    return Spec(param, shape, {hub: hub_shape}, lambda ts: np.ascontiguousarray(ts[0].reshape(shape)),
                lambda w: [np.ascontiguousarray(w.reshape(hub_shape))])


def heads_in(param: str, hub: str, d: int, n: int, h: int) -> Spec:
    """q/k/v: the Hub's [n*h, d] as [d, n, h]."""
    return Spec(param, (d, n, h), {hub: (n * h, d)}, lambda ts: transposed(ts[0]).reshape(d, n, h),
                lambda w: [transposed(w.reshape(d, n * h))])


def heads_out(param: str, hub: str, d: int, n: int, h: int) -> Spec:
    """o: the Hub's [d, n*h] as [n, h, d]."""
    return Spec(param, (n, h, d), {hub: (d, n * h)}, lambda ts: transposed(ts[0]).reshape(n, h, d),
                lambda w: [transposed(w.reshape(n * h, d))])


def attention_specs(cfg, i: int) -> list[Spec]:
    """Layer i's attention tensors in the Hub's q/k/v/o layout, with whichever of the model's options it has:
    q/k/v biases, an output bias, attention sinks (GPT-OSS), q/k norms."""
    m = cfg.model
    d, n, k, h = m.d_model, m.num_heads, m.kv_heads, m.head_size
    at, hub = f"blocks.{i}.attn", f"model.layers.{i}.self_attn"
    specs = [heads_in(f"{at}.wq", f"{hub}.q_proj.weight", d, n, h),
             heads_in(f"{at}.wk", f"{hub}.k_proj.weight", d, k, h),
             heads_in(f"{at}.wv", f"{hub}.v_proj.weight", d, k, h),
             heads_out(f"{at}.wo", f"{hub}.o_proj.weight", d, n, h)]
    if m.qkv_bias:
        specs += [same(f"{at}.b{x}", f"{hub}.{x}_proj.bias", (heads, h), (heads * h,))
                  for x, heads in (("q", n), ("k", k), ("v", k))]
    if m.out_bias:
        specs.append(same(f"{at}.bo", f"{hub}.o_proj.bias", (d,)))
    if m.attention_sinks:
        specs.append(same(f"{at}.sinks", f"{hub}.sinks", (n,)))
    if m.qk_norm == "head":
        specs += [same(f"{at}.{x}_norm.scale", f"{hub}.{x}_norm.weight", (h,)) for x in "qk"]
    elif m.qk_norm == "full":
        specs += [same(f"{at}.{x}_norm.scale", f"{hub}.{x}_norm.weight", (heads, h), (heads * h,))
                  for x, heads in (("q", n), ("k", k))]
    return specs
