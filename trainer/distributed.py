"""Multi-host start-up: jax.distributed on TPU VM slices and Vertex multi-host jobs, Pathways when in use.

Must run before anything touches a jax backend. Decisions are pure functions of the environment so that
tests can check them without a cluster.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping


def wants_pathways(env: Mapping[str, str]) -> bool:
    """The Pathways proxy backend (JAX_PLATFORMS=proxy) needs pathwaysutils.initialize()."""
    return "proxy" in env.get("JAX_PLATFORMS", "").split(",")


def wants_distributed(env: Mapping[str, str]) -> bool:
    """Whether this process is one of several hosts that must call jax.distributed.initialize()."""
    forced = env.get("MOE_TRAIN_DISTRIBUTED")
    if forced in ("0", "1"):
        return forced == "1"
    if env.get("JAX_COORDINATOR_ADDRESS") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return True
    cluster = env.get("CLUSTER_SPEC")  # Vertex AI multi-worker jobs
    if cluster:
        try:
            spec = json.loads(cluster).get("cluster", {})
        except (ValueError, AttributeError):
            return False
        return sum(len(v) for v in spec.values() if isinstance(v, list)) > 1
    return False


def on_tpu_vm(exists=os.path.exists) -> bool:
    """A Cloud TPU VM (chips under /dev and libtpu installed): jax can find its slice from metadata."""
    return any(exists(p) for p in ("/dev/accel0", "/dev/vfio/0")) and importlib.util.find_spec("libtpu") is not None


def initialize(env: Mapping[str, str] | None = None, *, tpu_vm: bool | None = None) -> str:
    """Initialises what the environment asks for; returns "pathways", "multi-host" or "single-host".

    On a TPU VM without explicit settings jax.distributed.initialize() finds the slice's workers in the
    VM metadata; where it finds no cluster (ValueError) the VM trains alone.
    """
    env = os.environ if env is None else env
    if wants_pathways(env):
        try:
            import pathwaysutils
        except ImportError:
            raise RuntimeError("JAX_PLATFORMS=proxy needs the pathwaysutils package (pip install "
                               "pathwaysutils)") from None
        pathwaysutils.initialize()
        return "pathways"
    if wants_distributed(env):
        import jax

        jax.distributed.initialize()
        return "multi-host"
    if env.get("MOE_TRAIN_DISTRIBUTED") != "0" and (on_tpu_vm() if tpu_vm is None else tpu_vm):
        import jax

        try:
            jax.distributed.initialize()
        except ValueError:  # no cluster detected: a single-host TPU VM
            return "single-host"
        return "multi-host" if jax.process_count() > 1 else "single-host"
    return "single-host"
