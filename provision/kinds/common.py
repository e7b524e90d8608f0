"""What the kinds that serve share and no one kind owns: the server's start, estimated once for every
serving container's startup probe (a Vertex AI model's, a GKE Deployment's). A kind imports this module,
never another kind."""

from __future__ import annotations

from provision import planner
from trainer.serve.spans import DEFAULT_CHUNK, programs

# The serving container's start, for the startup probe: the weights read from Cloud Storage at about this
# rate per host, then the prefill step compiled at every span of the cache and the decode step at every span
# and row count (a few minutes a span on TPU for a large model: `serve --warm-up all`, the deployed default,
# compiles them all before the server is ready); the probe allows twice the estimate. Plausible figures, not
# measured.
LOAD_BYTES_PER_S = 200e6
COMPILE_S = 150.0  # one step at one span (and, the decode, one row count)
BYTES_PER_WEIGHT = {"auto": 2, "int8": 1, "int4": 0.5}


def startup_estimate_s(cfg) -> float:
    """Seconds the server needs to load its weights and compile, from the planner's parameter count (the
    compile time alone where the model's size is unknown)."""
    # The row counts of one device's mesh (two unless one slot): a mesh whose devices split the slots has no
    # more, so this is the most its server compiles.
    compile_s = COMPILE_S * programs(DEFAULT_CHUNK, cfg.serve.max_len, cfg.serve.slots)
    try:
        total = planner.plan_for(cfg).counts.total
    except Exception:  # noqa: BLE001 - no plan (a model the planner cannot read): the probe still gets its floor
        return 2 * compile_s
    return 2 * (total * BYTES_PER_WEIGHT[cfg.serve.weights] / LOAD_BYTES_PER_S + compile_s)
