"""`moe-tpu plan`: will this MoE fit on this slice, how fast can it go, what will it cost.

Pure functions over typed inputs: the trainer's model config, the parameters the trainer instantiates
(listed from the config by trainer/arith/params.py, the jax-free arithmetic the trainer shares), a mesh and
a catalogue entry. Only `plan_for` and `verdict` read files. Nothing here imports jax: `plan` and
`plan --serve` run where only the control plane is installed.

The model behind the figures, per chip and per train step:
- memory: parameters and AdamW's mu and nu (param dtype, as optax keeps them), sharded as
  trainer.sharding shards them; gradients as the backward pass holds them (`gradient_bytes`) and FSDP's
  gathered weights (`gathered_weight_bytes`); activations from the shapes the trainer's layers create
  (`attention_activation_bytes`, `ffn_activation_bytes`, `head_activation_bytes`), at the later of two
  peaks: the head's forward, before any gradient, or the layers' backward beside the gradients; with
  remat only the block inputs are kept, plus one block recomputed at a time.
- time: lower bounds, each resource used at its peak and perfectly overlapped: matmul FLOPs over the
  bf16 peak, bytes that must cross HBM, bytes of the expert all-to-all and the data-parallel
  collectives over ICI, and over DCN between slices. The step can be no faster than the slowest.

Three modules: estimates.py (mesh, layout, memory, time bounds, cost), plan.py (the hardware a
config asks for, the mesh chosen, advice, warnings, the plan) and report.py (text, JSON and the
one-line verdict); for `plan --serve`, serving.py (the decode step's arithmetic), serve_plan.py (one
replica's chips, mesh and price) and serve_report.py. Everything is importable from here.
"""

from __future__ import annotations

from provision.planner.estimates import (  # noqa: F401 - the planner's API, one import away
    DCN_GBPS_PER_CHIP,
    DROP_WARNING,
    GIB,
    MAX_SLICES,
    Cost,
    Layout,
    Mesh,
    StepBounds,
    Traffic,
    all_to_all_bytes,
    chip_layout,
    collective_bytes,
    cost,
    hardware_flops_per_chip,
    mesh_options,
    mfu_ceiling,
    min_drop_fraction,
    routing_groups,
    step_bounds,
    target_mesh,
    tensor_parallel_bytes,
    traffic_per_chip,
)
from provision.planner.memory import (  # noqa: F401 - the planner's API, one import away
    Memory,
    activation_bytes,
    attention_activation_bytes,
    ffn_activation_bytes,
    gathered_weight_bytes,
    gradient_bytes,
    head_activation_bytes,
    head_kept_bytes,
    kept_bytes,
    logits_bytes,
    memory_per_chip,
    param_bytes_per_chip,
)
from provision.planner.plan import (  # noqa: F401 - the planner's API, one import away
    Advice,
    Hardware,
    Plan,
    advise,
    choose_mesh,
    fits_on,
    load_model_config,
    make_plan,
    mesh_choice,
    mesh_problems,
    plan_for,
    target_of,
    warnings_for,
)
from provision.planner.report import (  # noqa: F401 - the planner's API, one import away
    Verdict,
    advice_text,
    human_bytes,
    human_count,
    human_flops,
    human_seconds,
    mesh_source_text,
    plan_document,
    plan_lines,
    target_text,
    usd,
    verdict,
    verdict_line,
    verdict_of,
)
from provision.planner.serve_plan import Row, ServePlan, serve_plan_for  # noqa: F401 - plan --serve
from provision.planner.serve_report import claim_text, serve_document, serve_lines, serve_verdict  # noqa: F401
from provision.planner.serving import (  # noqa: F401 - the serving arithmetic
    PRECISIONS,
    ChipWeights,
    DecodeStep,
    KvLayout,
    Serving,
    chip_weights,
    cost_per_million_tokens,
    decode_step,
    decode_weight_bytes_per_chip,
    engine_kv_layout,
    experts_touched,
    kv_bytes_per_slot,
    kv_bytes_per_token,
    serving,
)
from trainer.arith.counts import ParamCounts, count_params  # noqa: F401 - the trainer's own count (trainer/arith/counts.py)
from trainer.arith.counts import model_flops_per_token as flops_per_token  # noqa: F401
