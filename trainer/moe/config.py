"""The MoE block's configuration: one frozen pydantic model, validated where it is built.

Frozen models hash by value, so a config is a static argument of jitted functions. Errors raise
`pydantic.ValidationError` (a ValueError); trainer/config.py turns them into messages naming the key.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from trainer.schema import Flag, NonNegative, Number, Positive, Section


def expert_capacity(num_tokens: int, top_k: int, capacity_factor: float, num_experts: int, min_capacity: int) -> int:
    """Slots per expert: ceil(tokens * k * capacity_factor / num_experts), at least
    min_capacity, at most num_tokens (an expert sees a token at most once). Here, without jax,
    so that the planner counts the slots the trainer's routing (trainer/moe/capacity.py) keeps."""
    capacity = math.ceil(num_tokens * top_k * capacity_factor / num_experts)
    return max(1, min(num_tokens, max(min_capacity, capacity)))


class MoEConfig(Section):
    """Routing, capacity and expert sizes of one MoE feed-forward block.

    capacity_factor <= 0 selects the dropless mode (every assignment is computed).
    Capacity is counted per routing group of tokens, as in GShard: with a mesh a
    group is one device's token shard, so a sharded and an unsharded block with the
    same `routing_groups` drop exactly the same assignments.
    """

    num_experts: Positive = 8
    top_k: Positive = 2
    d_ff: Positive = 512
    capacity_factor: Number = 1.25
    eval_capacity_factor: Number = 2.0
    min_capacity: NonNegative = 4
    routing: Literal["token_choice", "expert_choice"] = "token_choice"
    softmax_before_topk: Flag = True
    renormalize: Flag = True
    jitter: Number = Field(0.0, ge=0, lt=1)
    drop_priority: Literal["probability", "position"] = "probability"
    aux_loss_coef: Number = Field(0.01, ge=0)
    z_loss_coef: Number = Field(0.001, ge=0)
    num_shared_experts: NonNegative = 0
    # Hidden size of each shared expert; 0 means d_ff.
    shared_d_ff: NonNegative = 0
    # The shared experts' output times sigmoid(x . w) of a learned [d_model] gate (Qwen2-MoE); false: added as is.
    shared_gate: Flag = False
    # Token groups that capacity is counted in; 0 means one per token shard of the
    # mesh (data * expert devices), or 1 without a mesh.
    routing_groups: NonNegative = 0
    # "einsum" is the GShard one-hot dispatch, kept as a baseline for tests and benchmarks.
    dispatch: Literal["sort", "einsum"] = "sort"
    # Dropless token exchange: ragged_all_to_all ("ragged") or a padded all_to_all
    # ("padded"); "auto" picks ragged on TPU/GPU and padded on CPU.
    exchange: Literal["auto", "ragged", "padded"] = "auto"
    # Dropless grouped matmul: jax.lax.ragged_dot, token blocks per expert ("tiled"), or jax's megablox
    # kernel on a TPU; "auto" picks tiled on CPU, where ragged_dot is a masked dense product, and ragged_dot
    # elsewhere. (tokamax's Mosaic kernel, which serving uses, ran the moe-1b train step in 1,100 ms against
    # megablox's 417 on a v5e chip: its backward kernels with these tiles.)
    grouped_matmul: Literal["auto", "ragged_dot", "tiled", "megablox"] = "auto"
    # Rows per block of the grouped matmul; each expert's rows are padded to a multiple.
    # 0 picks half the expected rows per expert, a power of two in [8, 512]: bigger blocks
    # run faster matmuls, smaller ones waste less padding.
    block_rows: NonNegative = 0
    # Rows of the dropless exchange under expert parallelism: one per assignment, or one per
    # (token, device holding any of its experts), expanded to those experts there and their
    # outputs summed there. "auto" takes "device" with the ragged exchange (TPU/GPU) when a token
    # can reach fewer devices than it has experts (routing_groups_limit over groups that tile the
    # devices, or k > devices), and "assignment" with the padded one (CPU), where it is faster.
    exchange_rows: Literal["auto", "assignment", "device"] = "auto"
    # A serving step of at most this many assignments (tokens x top_k) on one device's experts reads each one's
    # expert weights directly instead of sorting them for the grouped matmul (trainer/moe/direct.py): a decode
    # step of a slot or a few. 0: always grouped.
    direct_assignments: NonNegative = 8
    # Those products of an int8 or int4 expert stack, and a serving step's dense FFN products from an int8 or
    # int4 stack (direct.layer_product, up to 64 rows on one device): "kernel", a Pallas kernel that reads each
    # assignment's expert, or the layer, from the stack (direct.stacked_rows_product); "xla", XLA's product of
    # the slice; "auto": the kernel on a TPU (for int4 XLA copies the slice first; int8's bursts ran faster
    # through it: direct.kernel_operands), XLA's elsewhere.
    direct_products: Literal["auto", "xla", "kernel"] = "auto"
    # Router scores: softmax over the experts, or each expert's own sigmoid (DeepSeek-V3). With
    # sigmoid and top_k > 1 the k chosen scores are normalised to sum to 1 (with renormalize).
    score: Literal["softmax", "sigmoid"] = "softmax"
    # The combine weights are multiplied by this after any normalisation.
    route_scale: Number = Field(1.0, gt=0)
    # Load balancing: the auxiliary loss, a per-expert bias on the selection scores that follows
    # the load (auxiliary-loss-free balancing, DeepSeek-V3), or both.
    balance: Literal["aux_loss", "bias", "both"] = "aux_loss"
    # Step of the bias: after every training step each expert's bias moves by this towards the
    # mean load (up when under it, down when over it).
    bias_rate: Number = Field(0.001, ge=0)
    # Group-limited routing: the experts form expert_groups groups of num_experts / expert_groups
    # consecutive experts (0: no groups); each token picks its experts from its
    # routing_groups_limit best groups (0: all groups).
    expert_groups: NonNegative = 0
    routing_groups_limit: NonNegative = 0
    # A group's score when routing_groups_limit keeps the best groups: the sum of its two best selection
    # scores (DeepSeek-V3), or its best one ("max", DeepSeek-V2's group_limited_greedy).
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    router_bias: Flag = False  # a learned bias on the router logits (GPT-OSS)
    ffn_bias: Flag = False  # a bias on each routed expert's gate, up and down products (GPT-OSS)
    # The routed experts' gating: "swiglu", silu(gate) * up; "clamped_swiglu" (GPT-OSS), with gate clamped to at
    # most swiglu_limit and up to [-swiglu_limit, swiglu_limit], (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    swiglu_alpha: Number = Field(1.702, gt=0)
    swiglu_limit: Number = Field(7.0, gt=0)

    @model_validator(mode="after")
    def _valid(self) -> MoEConfig:
        _check(self.top_k <= self.num_experts,
               f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.expert_groups:
            _check(
                self.num_experts % self.expert_groups == 0,
                f"expert_groups ({self.expert_groups}) must divide num_experts ({self.num_experts})",
            )
        if self.routing_groups_limit:
            _check(self.expert_groups > 0, "routing_groups_limit needs expert_groups (the groups it limits)")
            _check(
                self.routing_groups_limit <= self.expert_groups,
                f"routing_groups_limit ({self.routing_groups_limit}) must be <= expert_groups ({self.expert_groups})",
            )
            per_group = self.num_experts // self.expert_groups
            _check(
                self.routing_groups_limit * per_group >= self.top_k,
                f"routing_groups_limit ({self.routing_groups_limit}) must be >= top_k / (num_experts / "
                f"expert_groups) = {self.top_k}/{per_group}: the kept groups must hold top_k experts",
            )
        _check(self.activation == "clamped_swiglu" or (self.swiglu_alpha, self.swiglu_limit) == (1.702, 7.0),
               "swiglu_alpha and swiglu_limit apply to activation='clamped_swiglu' only")
        _check(self.num_shared_experts or not self.shared_gate, "shared_gate needs num_shared_experts >= 1 "
               "(the shared experts it gates)")
        if self.score == "sigmoid":
            _check(self.softmax_before_topk, "softmax_before_topk=false applies to score='softmax' only")
        if self.routing == "expert_choice":
            _check(
                self.capacity_factor > 0 and self.eval_capacity_factor > 0,
                "expert_choice routing needs capacity_factor > 0 and eval_capacity_factor > 0 "
                "(each expert takes its top-C tokens; there is no dropless expert choice)",
            )
            _check(self.dispatch == "sort", "dispatch='einsum' is only a baseline for token_choice routing")
            _check(
                self.score == "softmax" and self.balance == "aux_loss" and not self.routing_groups_limit,
                "expert_choice routing takes score='softmax', balance='aux_loss' and no routing_groups_limit "
                "(it is balanced by construction)",
            )
        return self

    @property
    def uses_bias(self) -> bool:
        return self.balance in ("bias", "both")

    @property
    def uses_aux_loss(self) -> bool:
        return self.balance in ("aux_loss", "both")

    def capacity_factor_for(self, train: bool) -> float:
        return self.capacity_factor if train else self.eval_capacity_factor

    def is_dropless(self, train: bool) -> bool:
        # A dropless model stays dropless in evaluation whatever eval_capacity_factor says.
        if self.routing != "token_choice":
            return False
        return self.capacity_factor <= 0 or self.capacity_factor_for(train) <= 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"MoEConfig: {message}")

