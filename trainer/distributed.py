"""Multi-host start-up: jax.distributed on TPU VM slices and Vertex multi-host jobs, Pathways when in use.

Must run before anything touches a jax backend. Decisions are pure functions of the environment (and, on a
TPU VM that says nothing, of its metadata server's list of workers) so that tests can check them without a
cluster. Also where a trainer on an accelerator keeps its compiled programs (use_compilation_cache).
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


METADATA_TIMEOUT_S = 2.0  # a TPU VM's metadata server answers in milliseconds; a machine without one never


def _count(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


def _hosts(text: str | None) -> int:
    return len([h for h in (text or "").split(",") if h.strip()])


def _cluster_spec_workers(text: str | None) -> int:
    try:
        spec = json.loads(text or "{}").get("cluster", {})
    except (ValueError, AttributeError):
        return 0
    return sum(len(v) for v in spec.values() if isinstance(v, list)) if isinstance(spec, dict) else 0


def cluster_evidence(env: Mapping[str, str]) -> str | None:
    """What in the environment says this process is one of several hosts (words for a message), else None.
    MOE_TRAIN_DISTRIBUTED=0 says it is alone, whatever else is set."""
    forced = env.get("MOE_TRAIN_DISTRIBUTED")
    if forced in ("0", "1"):
        return "MOE_TRAIN_DISTRIBUTED=1" if forced == "1" else None
    for name in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS"):
        if env.get(name):
            return f"{name}={env[name]}"
    if _count(env.get("MEGASCALE_NUM_SLICES")) > 1:
        return f"MEGASCALE_NUM_SLICES={env['MEGASCALE_NUM_SLICES']}"
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        if _hosts(env.get(name)) > 1:
            return f"{name} lists {_hosts(env.get(name))} hosts"
    if _count(env.get("JAX_NUM_PROCESSES")) > 1:
        return f"JAX_NUM_PROCESSES={env['JAX_NUM_PROCESSES']}"
    if _cluster_spec_workers(env.get("CLUSTER_SPEC")) > 1:
        return f"CLUSTER_SPEC (Vertex AI) lists {_cluster_spec_workers(env.get('CLUSTER_SPEC'))} workers"
    return None


def wants_distributed(env: Mapping[str, str]) -> bool:
    """Whether this process is one of several hosts that must call jax.distributed.initialize()."""
    return cluster_evidence(env) is not None


def on_tpu_vm(exists=os.path.exists) -> bool:
    """A Cloud TPU VM (chips under /dev and libtpu installed): jax can find its slice from metadata."""
    return any(exists(p) for p in ("/dev/accel0", "/dev/vfio/0")) and importlib.util.find_spec("libtpu") is not None


def read_metadata(env: Mapping[str, str], key: str) -> str | None:
    """The TPU VM's metadata attribute `key`, or None where no metadata server answers it within
    METADATA_TIMEOUT_S (a container, a TPU workstation) or it has no such attribute."""
    import http.client
    import urllib.request

    host = env.get("GCE_METADATA_IP") or "169.254.169.254"  # the link-local address: no name to resolve
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT_S) as answer:
            return answer.read().decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException):
        return None


def tpu_vm_evidence(env: Mapping[str, str], read: Callable[[Mapping[str, str], str], str | None] = read_metadata
                    ) -> str | None:
    """On a TPU VM whose environment says nothing: whether its metadata lists several workers (a multi-host
    slice made with `gcloud compute tpus`), as jax.distributed would find them. None where the metadata
    server does not answer (no slice to join) or lists one worker; GKE's pods say so in their environment
    (TPU_SKIP_MDS_QUERY), so none is asked there."""
    if env.get("MOE_TRAIN_DISTRIBUTED") == "0" or env.get("TPU_SKIP_MDS_QUERY") is not None:
        return None
    workers = _hosts(read(env, "worker-network-endpoints"))
    return f"the TPU VM's metadata lists {workers} workers" if workers > 1 else None


def initialize(env: MutableMapping[str, str] | None = None, *, tpu_vm: bool | None = None,
               read: Callable[[Mapping[str, str], str], str | None] = read_metadata) -> str:
    """Initialises what the environment asks for; returns "pathways", "multi-host" or "single-host".

    jax.distributed starts only where something says there are several hosts (cluster_evidence, else on a
    TPU VM its metadata: tpu_vm_evidence): one host (a single-host TPU VM, a container with a chip, a
    workstation) trains alone with nothing set and no metadata server. Where it fails, the RuntimeError
    names what made it try. Under Pathways (one controller: no
    jax.distributed) the proxy must answer within PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS (set here when
    unset, so that the IFRT proxy client gives up as soon).
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
    evidence = cluster_evidence(env)
    if evidence is None and (on_tpu_vm() if tpu_vm is None else tpu_vm):
        evidence = tpu_vm_evidence(env, read)
    if evidence is None:
        return "single-host"
    import jax

    try:
        jax.distributed.initialize()
    except Exception as e:  # noqa: BLE001 - whatever jax raises, the message says why it was tried
        raise RuntimeError(f"jax.distributed.initialize() failed ({evidence}, so this is taken for one of several "
                           f"hosts): {e}. Set MOE_TRAIN_DISTRIBUTED=0 to train on this host alone") from None
    return "multi-host" if jax.process_count() > 1 else "single-host"


def compilation_cache_dir(env: Mapping[str, str]) -> str:
    """Where a trainer keeps jax's compiled programs when the environment names no place: the dry run's
    ($XDG_CACHE_HOME/moe-tpu/jax, ~/.cache by default; provision/emulator/local_trainer.py)."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moe-tpu", "jax")


# jax keeps only programs that took a second or more to compile unless told otherwise; on a v5e chip a warm
# start compiled its small ones again each time: the trainer's and the server's RNG streams (0.47 s), the
# server's prefix-cache copies (0.26-0.54 s each), about 1.4 s of a warm server's 17.5 s (2026-12-07,
# benchmarks/serve_ready.py --log-compiles). A cache hit of such a program reads a few kilobytes.
MIN_COMPILE_TIME_VARIABLE = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def use_compilation_cache(platform: str, env: Mapping[str, str] | None = None, *, cpu: bool = False) -> str | None:
    """On an accelerator (and with `cpu` on a CPU too: the server's), jax's persistent compilation cache, as the
    dry run has it, where none is set: a restarted trainer (a preemption, the next run of the same model) or
    server loads its programs instead of compiling them again, the quick ones too (MIN_COMPILE_TIME_VARIABLE
    unless set). Call it before the first compile. Returns the
    directory, or None where the environment or jax's config chose already, or on a CPU without `cpu` (the dry
    run sets its own)."""
    import jax

    env = os.environ if env is None else env
    if platform == "cpu" and not cpu:
        return None
    if MIN_COMPILE_TIME_VARIABLE not in env:  # every program kept, however quickly it compiles
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if env.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    path = compilation_cache_dir(env)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
