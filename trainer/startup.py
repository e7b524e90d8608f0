"""How this process came to its first step: the seconds since the process started at each stage of the
trainer's start-up, kept without jax (the first marks come before jax is imported) and reported in the first
logged row as `startup_<stage>_s`, so that a slow start names its stage (on one v5e chip the first step came
52 s after the start, of which 16 s passed before the model was built)."""

from __future__ import annotations

import os
import threading
import time

_marks: dict[str, float] = {}


def seconds_since_start() -> float | None:
    """Seconds since this process started (Linux's /proc: the kernel's start time in clock ticks since boot,
    the boot time to the second), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return max(0.0, time.time() - boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def elapsed() -> float | None:
    """seconds_since_start to the hundredth, as every start-up figure is reported: one rounding for the marks
    and the first step, so that a mark before the first step never reads after it."""
    t = seconds_since_start()
    return None if t is None else round(t, 2)


def mark(stage: str) -> None:
    """`stage` reached now; a stage already marked keeps its first time (a second run in one process, as the
    tests do, reports the first start-up's)."""
    if stage not in _marks and (t := elapsed()) is not None:
        _marks[stage] = t


def marks() -> dict[str, float]:
    """{"startup_<stage>_s": seconds since the process started} for each stage marked so far, in order."""
    return {f"startup_{stage}_s": t for stage, t in _marks.items()}


# The TPU runtime pins a host buffer for its transfers as it starts (TPU_PREMAPPED_BUFFER_SIZE), 4 GiB unless
# told otherwise. On a v5e host without transparent hugepages pinning it took 7.8 of the runtime's 8.2 s start
# and its release 3.6 s at the exit; at 256 MiB the start took 1.2-2.0 s (2026-12-07, benchmarks/
# startup_parts.py --variant, on the chip: docs/performance.md). The smaller buffer slows large copies to the
# device (1 GiB at once 0.30 against 5.5 GB/s there; a server's 2 GB restore took 6.0 s against 5.8), so it is
# taken only where the pinning is slow: where transparent hugepages are not always on.
PREMAPPED_BUFFER_BYTES = 256 * 2**20
HUGEPAGES = "/sys/kernel/mm/transparent_hugepage/enabled"


def hugepages_always() -> bool:
    """Whether the kernel backs large allocations with transparent hugepages always ("[always]" chosen)."""
    try:
        with open(HUGEPAGES) as f:
            return "[always]" in f.read()
    except OSError:
        return False


def runtime_defaults(env=None, hugepages: bool | None = None) -> None:
    """The accelerator runtime's settings this project chooses, each only where the environment does not set
    it already; before the backend starts (later they are not read)."""
    env = os.environ if env is None else env
    if not (hugepages_always() if hugepages is None else hugepages):
        env.setdefault("TPU_PREMAPPED_BUFFER_SIZE", str(PREMAPPED_BUFFER_BYTES))


def start_backend() -> threading.Thread:
    """jax's backend started on a thread of its own, while the caller goes on (importing its modules, reading
    its config and checkpoint): on one v5e chip the accelerator's runtime took 6.3 s to start and the trainer's
    imports 5 s, one after the other (the marks above, 2026-12-06). Call it after anything that must come
    before the backend (fake CPU devices in XLA_FLAGS, jax.distributed). Whatever the start raises is raised
    again where the caller first asks for the devices (jax keeps the backends' errors); benchmarks/
    startup_parts.py measures what the overlap buys."""
    runtime_defaults()
    import jax

    def start():
        try:
            jax.devices()
        except Exception:  # noqa: BLE001 - the caller's own jax.devices() raises it again, reported there
            pass

    thread = threading.Thread(target=start, name="start-backend", daemon=True)
    thread.start()
    return thread
