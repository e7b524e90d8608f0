"""Multi-host start-up: jax.distributed on TPU VM slices and Vertex multi-host jobs, Pathways when in use.

Must run before anything touches a jax backend. Decisions are pure functions of the environment so that
tests can check them without a cluster.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping
from urllib.parse import urlparse

# How long the trainer waits for the Pathways proxy to answer before it gives up (seconds). Without
# it the IFRT proxy client keeps trying for minutes; the JobSet sets it from gke.pathways.proxy_timeout.
PROXY_TIMEOUT_ENV = "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS"
DEFAULT_PROXY_TIMEOUT_S = 5
PROXY_RETRY_S = 0.5


def wants_pathways(env: Mapping[str, str]) -> bool:
    """The Pathways proxy backend (JAX_PLATFORMS=proxy) needs pathwaysutils.initialize()."""
    return "proxy" in env.get("JAX_PLATFORMS", "").split(",")


def proxy_address(env: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) of the proxy from JAX_BACKEND_TARGET (grpc://HOST:PORT)."""
    target = env.get("JAX_BACKEND_TARGET", "")
    url = urlparse(target if "://" in target else f"grpc://{target}")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise RuntimeError(f"JAX_PLATFORMS=proxy needs JAX_BACKEND_TARGET=grpc://HOST:PORT (the Pathways proxy), "
                           f"got {target!r}")
    return url.hostname, port


def proxy_timeout(env: Mapping[str, str]) -> float:
    text = env.get(PROXY_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else float(DEFAULT_PROXY_TIMEOUT_S)
    except ValueError:
        raise RuntimeError(f"{PROXY_TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if value <= 0:
        raise RuntimeError(f"{PROXY_TIMEOUT_ENV} must be more than 0, got {text!r}")
    return value


def check_proxy(env: Mapping[str, str], connect: Callable = socket.create_connection,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until the proxy's address accepts a connection, at most its timeout; else a RuntimeError
    that names the address and what to check (never a silent hang in the backend's own retries)."""
    host, port = proxy_address(env)
    timeout = proxy_timeout(env)
    deadline = clock() + timeout
    while True:
        try:
            connect((host, port), timeout=max(0.1, min(2.0, deadline - clock()))).close()
            return
        except OSError as exc:
            if clock() + PROXY_RETRY_S >= deadline:
                raise RuntimeError(
                    f"the Pathways proxy at {host}:{port} (JAX_BACKEND_TARGET) did not answer within {timeout:g} s: "
                    f"{exc.strerror or exc}; check that the head pod's pathways-proxy sidecar runs and that "
                    f"{host} resolves from this pod (wait longer with {PROXY_TIMEOUT_ENV})") from None
            sleep(PROXY_RETRY_S)


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


def initialize(env: MutableMapping[str, str] | None = None, *, tpu_vm: bool | None = None) -> str:
    """Initialises what the environment asks for; returns "pathways", "multi-host" or "single-host".

    On a TPU VM without explicit settings jax.distributed.initialize() finds the slice's workers in the
    VM metadata; where it finds no cluster (ValueError) the VM trains alone. Under Pathways (one
    controller: no jax.distributed) the proxy must answer within PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS
    (set here when unset, so that the IFRT proxy client gives up as soon).
    """
    env = os.environ if env is None else env
    if wants_pathways(env):
        env.setdefault(PROXY_TIMEOUT_ENV, str(DEFAULT_PROXY_TIMEOUT_S))
        check_proxy(env)
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
