"""The model's section of the trainer's config (`model:`), its latent attention (`model.mla`) and YaRN; the
MoE section is trainer/moe/config.py, the rest and the loading trainer/config.py."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from trainer.schema import Flag, NonNegative, Number, Positive, Section


class YarnConfig(Section):
    """YaRN's extension of the rotary positions past the length a model was trained at (arXiv 2309.00071), as
    DeepSeek-V2/V3 (model.mla.yarn) and GPT-OSS (model.yarn) use it: the slow rotary frequencies divided by
    `factor`, the fast ones kept, a ramp between (beta_fast and beta_slow rotations over
    original_max_position_embeddings); the rotary values scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set (else mscale(factor, 1)), and the softmax scale by mscale(factor,
    mscale_all_dim)**2 when it is set, with mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1). 0 stands for
    a key the checkpoint leaves out."""

    factor: Number = Field(gt=0)
    original_max_position_embeddings: Positive
    beta_fast: Number = Field(32.0, gt=0)
    beta_slow: Number = Field(1.0, gt=0)
    mscale: Number = Field(0.0, ge=0)
    mscale_all_dim: Number = Field(0.0, ge=0)
    truncate: Flag = True  # the ramp's ends rounded out to whole dimensions


class MLAConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3; trainer/mla.py). Keys and values come from one latent of
    kv_lora_rank values per token (RMS-normalised) and one rotary key of qk_rope_head_dim values shared by all
    heads; each head's query and key have qk_nope_head_dim values without positions and qk_rope_head_dim with
    them, its value v_head_dim. The defaults are DeepSeek-V3's."""

    q_lora_rank: NonNegative = 1536  # 0: the query is one projection of x (DeepSeek-V2-Lite)
    kv_lora_rank: Positive = 512
    qk_nope_head_dim: Positive = 128
    qk_rope_head_dim: Positive = 64
    v_head_dim: Positive = 128
    yarn: YarnConfig | None = None  # YaRN rotary scaling of the rotary part (none: plain RoPE)

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim must be even for rotary positions, got "
                             f"{self.qk_rope_head_dim}")
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class ModelConfig(Section):
    vocab_size: Positive = 256
    d_model: Positive = 64
    num_layers: Positive = 2
    num_heads: Positive = 4
    num_kv_heads: NonNegative = 0  # 0: as many as num_heads (plain multi-head attention)
    head_dim: NonNegative = 0  # 0: d_model // num_heads
    d_ff: Positive = 256  # hidden size of the dense gated FFN layers
    # layer i is MoE when (i + 1) % moe_every == 0 and i is not in dense_layers; 0: no MoE layers
    moe_every: NonNegative = Field(2, description="0: no MoE layers")
    dense_layers: tuple[NonNegative, ...] = ()  # layers kept dense whatever moe_every says (Qwen's mlp_only_layers)
    rope_theta: Number = Field(10_000.0, gt=0)
    norm_eps: Number = Field(1e-6, gt=0)
    tie_embeddings: Flag = False
    # The tied head multiplies the embedding by d_model**-0.5 (unit-variance embeddings give unit-variance
    # logits); false: the embedding as it is, as Hugging Face's tied models use it.
    tied_head_scale: Flag = True
    qkv_bias: Flag = False  # a bias on the q, k and v projections (Qwen2-MoE)
    # RMSNorm of q and k before the rotary positions: over each head ("head", Qwen3-MoE), over all heads
    # together ("full", OLMoE), or none.
    qk_norm: Literal["none", "head", "full"] = "none"
    remat: Flag = False  # rematerialise each block in the backward pass
    # Causal attention over whole sequences (training, evaluation): "splash", jax's Pallas kernel for TPUs (on a
    # CPU through Pallas' interpreter, for tests); "xla", XLA's fused attention; "auto", splash on a TPU where
    # the length is a multiple of 128, else XLA's (trainer/attention.py).
    attention: Literal["auto", "xla", "splash"] = "auto"
    # With remat: what each block keeps from its forward pass: nothing ("full": the whole block again in the
    # backward pass), attention's inputs and output ("attention": its kernel does not run again; 130 MiB a
    # layer for moe-1b), those and the dense FFN's two hidden products ("attention_ffn"), those and the MoE
    # capacity path's slots, its tokens in them and the experts' outputs ("attention_moe": no sort, gather or
    # down projection again), every matmul's output ("dots"), or those without batch dimensions ("dots_no_batch").
    remat_policy: Literal["full", "attention", "attention_ffn", "attention_moe", "dots", "dots_no_batch"] = "full"
    # Scan over each repeating pattern of layers (one block compiled a pattern: trainer/stacks.py); false runs
    # the same stacked parameters a layer at a time (each layer compiled apart; the reference in tests).
    scan_layers: Flag = True
    # How a lone stream's decode step (one token, one row a device) runs the layers: "unrolled", one after
    # another in the program, each reading its slice of the stacked weights where it lies (a scan copies a
    # quantized layer's slices out of the stack first: on one v5e chip, moe-1b, one stream, unrolled gave int4
    # 1.31x, int8 1.10x, bf16 1.01x the tokens/s, benchmarks/serve_weights.py), at about 1.4x the compile time;
    # "scan": as scan_layers says; "auto": unrolled on an accelerator, as scan_layers says on a CPU (where the
    # tests and dry runs compile). Decode steps of more rows, prefill chunks and training keep scan_layers
    # (Transformer._scans says why).
    decode_layers: Literal["auto", "scan", "unrolled"] = "auto"
    # Multi-head latent attention in place of multi-head attention (DeepSeek); none: today's attention.
    mla: MLAConfig | None = None
    out_bias: Flag = False  # a bias on the attention's output projection (GPT-OSS)
    # A learned logit per head that joins the softmax's denominator as one more key with no value (GPT-OSS's
    # attention sinks): a head may then give its keys less than all of its attention.
    attention_sinks: Flag = False
    # Each layer's attention: "full" (causal over every earlier position) or "sliding" (the last sliding_window
    # positions, its own included); empty: every layer full.
    layer_types: tuple[Literal["full", "sliding"], ...] = ()
    sliding_window: NonNegative = 0  # positions a "sliding" layer attends to; 0: no sliding layer
    yarn: YarnConfig | None = None  # YaRN rotary scaling of multi-head attention (model.mla takes its own)

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.mla is not None:
            self._valid_mla()
        if self.mla is None and self.head_dim == 0 and self.d_model % self.num_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                             f"({self.num_heads}), or set model.head_dim")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.mla is None and self.head_size % 2:
            raise ValueError(f"the head size must be even for rotary positions, got {self.head_size}")
        self._valid_attention_kinds()
        beyond = [i for i in self.dense_layers if i >= self.num_layers]
        if beyond:
            raise ValueError(f"model.dense_layers names layer {beyond[0]}, but the model has {self.num_layers} "
                             f"(0 to {self.num_layers - 1})")
        return self

    def _valid_mla(self) -> None:
        clashes = [(self.num_kv_heads not in (0, self.num_heads), "model.num_kv_heads (every head has its own "
                    "keys and values)"), (self.head_dim != 0, "model.head_dim (model.mla sets the head sizes)"),
                   (self.qk_norm != "none", "model.qk_norm"), (self.qkv_bias, "model.qkv_bias"),
                   (self.out_bias, "model.out_bias"), (self.attention_sinks, "model.attention_sinks"),
                   (bool(self.layer_types), "model.layer_types (its attention is full)"),
                   (self.yarn is not None, "model.yarn (it takes model.mla.yarn)")]
        for bad, key in clashes:
            if bad:
                raise ValueError(f"model.mla (multi-head latent attention) does not take {key}")

    def _valid_attention_kinds(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"model.layer_types names {len(self.layer_types)} layers, but the model has "
                             f"{self.num_layers}")
        sliding = "sliding" in self.layer_types
        if sliding and not self.sliding_window:
            raise ValueError("model.layer_types has sliding layers: set model.sliding_window (the positions they "
                             "attend to)")
        if self.sliding_window and not sliding:
            raise ValueError(f"model.sliding_window = {self.sliding_window}, but no layer of model.layer_types is "
                             "'sliding'")
        if self.yarn is not None and self.yarn.mscale_all_dim:
            raise ValueError("model.yarn.mscale_all_dim scales latent attention's softmax (model.mla.yarn): "
                             "multi-head attention's YaRN takes factor, mscale and the ramp only")
        if self.attention == "splash" and (sliding or self.attention_sinks):
            raise ValueError("model.attention = splash has no sliding windows nor attention sinks: take 'auto' or "
                             "'xla' (their attention runs in XLA)")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.mla else self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        """The size of a head's keys and values in the key/value cache; with MLA the larger of the query/key and
        the value sizes (training's attention pads the smaller; the serving cache holds the latent instead)."""
        if self.mla:
            return max(self.mla.qk_head_dim, self.mla.v_head_dim)
        return self.head_dim or self.d_model // self.num_heads

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0 and i not in self.dense_layers

    def window(self, i: int) -> int:
        """The positions layer i attends to (its own included): sliding_window for a sliding layer, 0 (all
        earlier positions) for a full one."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "sliding" else 0

    def layer_kind(self, i: int) -> tuple[bool, int]:
        """What makes layer i's structure: MoE or dense, and its attention window (trainer/stacks.py scans
        layers of one kind together)."""
        return self.is_moe_layer(i), self.window(i)

    @property
    def num_moe_layers(self) -> int:
        """How many layers is_moe_layer counts, without asking each (the planner asks for every mesh it weighs)."""
        if self.moe_every <= 0:
            return 0
        dense = {i for i in self.dense_layers if 0 <= i < self.num_layers and (i + 1) % self.moe_every == 0}
        return self.num_layers // self.moe_every - len(dense)
