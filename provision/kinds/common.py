"""What the kinds that serve share and no one kind owns: the server's start, estimated once for every
serving container's startup probe (a Vertex AI model's, a GKE Deployment's). A kind imports this module,
never another kind."""

from __future__ import annotations

from provision import planner
from trainer.serve.spans import DEFAULT_CHUNK, DEFAULT_WARM_UP, programs_before_ready

# The serving container's start, for the startup probe: the weights read from Cloud Storage at about this
# rate per host, then the programs compiled before /health says ready (a few minutes each on TPU for a large
# model; `serve --warm-up background`, the deployed default: a short request's prefill and a lone stream's
# decode, the others compiling while it serves); the probe allows twice the estimate. Set long on purpose: a
# probe that gives up early kills a server that would have come up. Measured on one v5e chip (2026-12-08,
# `benchmarks/serve_ready.py --accelerator`, docs/performance.md): moe-1b's two programs compiled in 15-18 s
# each, side by side, and its 2.05 GB read from local disk onto the chip in 5.0-6.4 s; a slice's programs
# (partitioned over its chips) and a read from Cloud Storage are not measured.
LOAD_BYTES_PER_S = 200e6
COMPILE_S = 150.0  # one step at one span (and, the decode, one row count)
BYTES_PER_WEIGHT = {"auto": 2, "int8": 1, "int4": 0.5, "mxfp4": 0.5}  # mxfp4: the experts, most of an MoE


def startup_estimate_s(cfg) -> float:
    """Seconds the server needs to load its weights and compile, from the planner's parameter count (the
    compile time alone where the model's size is unknown)."""
    # The deployed argv leaves --warm-up and --chunk at their defaults (provision/container.py).
    compile_s = COMPILE_S * programs_before_ready(DEFAULT_CHUNK, cfg.serve.max_len, cfg.serve.slots,
                                                  warm_up=DEFAULT_WARM_UP)
    try:
        total = planner.plan_for(cfg).counts.total
    except Exception:  # noqa: BLE001 - no plan (a model the planner cannot read): the probe still gets its floor
        return 2 * compile_s
    return 2 * (total * BYTES_PER_WEIGHT[cfg.serve.weights] / LOAD_BYTES_PER_S + compile_s)
