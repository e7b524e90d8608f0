"""A process's start, taken apart: what the trainer's and the server's first seconds go to before their config,
each part in a fresh process of its own (this environment's, PYTHONPATH included, the checkout first).

    python benchmarks/startup_parts.py                  # the default backend (the chip, where libtpu is installed)
    python benchmarks/startup_parts.py --cpu --repeat 3 # on the CPU (the figures of a machine without a chip)

Parts, each a child process; seconds since that process started (its start time in /proc), and the parent's
wall time from launch to exit:
  python          `python -c pass`: the floor any start pays
  import_jax      `import jax`
  devices         `import jax; jax.devices()`: the accelerator's runtime started, nothing else
  trainer_imports the modules the trainer's command imports before its config (trainer.cli, trainer.train),
                  the backend untouched (the child checks that none started)
  server_imports  the server's (trainer.serve.cli, trainer.serve.startup, the engine, the weights' restore, the
                  HTTP server's packages), the backend untouched
  trainer_both    as `moe-train` does: the backend started on a thread (trainer/startup.py start_backend), the
                  trainer's modules imported meanwhile, then jax.devices()
  server_both     the same with the server's modules
`devices` starts the runtime as bare jax does, with the runtime's own settings; the `_both` parts start it
through trainer/startup.py start_backend, with the project's (runtime_defaults: a smaller pinned host buffer
where transparent hugepages are not always on).
With --transfer-mib, each `devices` part also times copies to the device and back (GB/s).
With --variant "LABEL K=V ...", the `devices` part once more under each environment given (the runtime's own
variables: TPU_SKIP_MDS_QUERY, TPU_ACCELERATOR_TYPE, ...), and with --runtime-log its libtpu log lines
(TPU_STDERR_LOG_LEVEL=0), stamped, in the row: what the runtime's start waits on.
The `_both` parts say whether the thread overlaps: `both` near the larger of `devices` and the imports is an
overlap; near their sum, the runtime's start holds the interpreter (the GIL) and the thread buys nothing.
With --importtime, the trainer's and the server's imports once more under `python -X importtime`: the modules
that took longest themselves (a slow disk shows there), not timed against the others.

One JSON line a part and repeat, then a table of the medians; --json writes them all. The parts run in
turn, so each `devices` waits for the runtime the part before released (the chip is one process's at a time).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_ready import since_start  # noqa: E402 - one clock for both benchmarks' marks

ROOT = Path(__file__).resolve().parent.parent
TRAINER_MODULES = ("trainer.cli", "trainer.train", "trainer.checkpoint", "trainer.metrics")
SERVER_MODULES = ("trainer.serve.cli", "trainer.serve.startup", "trainer.serve.engine", "trainer.serve.weights",
                  "trainer.run_loader", "trainer.serve.server", "orbax.checkpoint", "uvicorn")
PARTS = ("python", "import_jax", "devices", "trainer_imports", "server_imports", "trainer_both", "server_both")


def backend_started() -> bool:
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def child(part: str) -> dict:
    """One part, in this (fresh) process: its marks, seconds since the process started."""
    marks: dict = {"entered": since_start()}
    if part == "python":
        return marks
    import jax

    marks["jax_imported"] = since_start()
    if part == "import_jax":
        return marks
    if part == "devices":
        devices = jax.devices()
        marks["backend_up"] = since_start()
        marks["devices"] = f"{len(devices)} x {devices[0].device_kind}"
        marks["env"] = {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "LIBTPU", "JAX_", "XLA_"))}
        if os.environ.get("STARTUP_PARTS_TRANSFER_MIB"):
            marks.update(transfers(jax, int(os.environ["STARTUP_PARTS_TRANSFER_MIB"])))
        return marks
    modules = TRAINER_MODULES if part.startswith("trainer") else SERVER_MODULES
    if part.endswith("_both"):
        from trainer import startup

        startup.start_backend()
    for name in modules:
        importlib.import_module(name)
    marks["modules_imported"] = since_start()
    if part.endswith("_imports"):
        marks["backend_touched"] = backend_started()  # the imports alone must not start it
        return marks
    devices = jax.devices()
    marks["backend_up"] = since_start()
    marks["devices"] = f"{len(devices)} x {devices[0].device_kind}"
    return marks


def transfers(jax, mib: int) -> dict:
    """GB/s of host-to-device and device-to-host copies of `mib` MiB, as one array and as 8 (a checkpoint's
    restore puts many), the best of 3 each: what the runtime's premapped host buffer's size costs them."""
    import numpy as np

    out = {}
    for pieces in (1, 8):
        hosts = [np.full(mib * 2**20 // pieces, i, np.uint8) for i in range(pieces)]
        up = down = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            on = jax.block_until_ready([jax.device_put(h) for h in hosts])
            up = min(up, time.perf_counter() - t)
            t = time.perf_counter()
            [np.asarray(x) for x in on]
            down = min(down, time.perf_counter() - t)
            del on
        out[f"h2d_{pieces}_gbps"] = round(mib * 2**20 / up / 1e9, 2)
        out[f"d2h_{pieces}_gbps"] = round(mib * 2**20 / down / 1e9, 2)
    return out


def run_part(part: str, env: dict, variant: str | None = None, log_lines: int = 0) -> dict:
    launched = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", part], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    wall = time.perf_counter() - launched
    head = {"part": part, **({"variant": variant} if variant else {}), "wall_s": round(wall, 2)}
    if done.returncode:
        return {**head, "error": done.stderr.strip().splitlines()[-1:]}
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    row = {**head, **{k: round(v, 2) if isinstance(v, float) else v for k, v in marks.items()}}
    if log_lines:
        row["log"] = done.stderr.strip().splitlines()[-log_lines:]
    return row


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """"LABEL K=V K=V" -> (LABEL, {K: V}); a bare LABEL is the environment as it is."""
    label, *pairs = text.split()
    bad = [x for x in pairs if "=" not in x]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad[0]!r} is not KEY=VALUE")
    return label, dict(x.split("=", 1) for x in pairs)


def import_times(modules: tuple[str, ...], env: dict, top: int = 12) -> list[tuple[str, float]]:
    """[(module, seconds its own import took)], the longest `top`, from `python -X importtime`."""
    code = "import jax\n" + "".join(f"import {m}\n" for m in modules)
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if done.returncode:  # the imports failed: its last line says why
        return [(f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}", 0.0)]
    rows = []
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            own, _, name = (field.strip() for field in line[len("import time:"):].split("|"))
            if own.isdigit():
                rows.append((name, int(own) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def environment(cpu: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def on_cpu(args) -> bool:
    """--cpu; else the CPU where no accelerator's runtime is installed (libtpu), or JAX_PLATFORMS says cpu."""
    if args.cpu:
        return True
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"] == "cpu"
    return importlib.util.find_spec("libtpu") is None


def summary(rows: list[dict]) -> dict[str, dict]:
    """Each part's medians: wall, and the child's marks (seconds since its start)."""
    out: dict[str, dict] = {}
    for part in PARTS:
        mine = [r for r in rows if r["part"] == part and "error" not in r and "variant" not in r]
        if not mine:
            continue
        keys = [k for k, v in mine[0].items() if isinstance(v, float)]
        out[part] = {k: round(statistics.median(r[k] for r in mine), 2) for k in keys}
        out[part]["devices"] = mine[0].get("devices")
    for label in dict.fromkeys(r["variant"] for r in rows if "variant" in r and "error" not in r):
        mine = [r for r in rows if r.get("variant") == label and "error" not in r]
        out[f"devices {label}"] = {k: round(statistics.median(r[k] for r in mine), 2)
                                   for k in ("wall_s", "jax_imported", "backend_up")}
    return out


def table(med: dict[str, dict]) -> str:
    lines = [f"{'part':<16} {'wall':>6} {'jax':>6} {'modules':>8} {'backend':>8}   (s; the last three since the "
             "child started)"]
    for part, m in med.items():
        cells = [m.get(k) for k in ("wall_s", "jax_imported", "modules_imported", "backend_up")]
        lines.append(f"{part[:16]:<16} " + " ".join(f"{c:>{w}.2f}" if c is not None else f"{'':>{w}}"
                                               for c, w in zip(cells, (6, 6, 8, 8), strict=True)))
    verdicts = []
    for who in ("trainer", "server"):
        alone, both, runtime = med.get(f"{who}_imports"), med.get(f"{who}_both"), med.get("devices")
        if alone and both and runtime:
            start = runtime["backend_up"] - runtime["jax_imported"]  # the runtime's own start
            serial = alone["modules_imported"] + start
            ideal = max(alone["modules_imported"], runtime["backend_up"])
            verdicts.append(f"{who}: imports {alone['modules_imported']:.2f} s, runtime {start:.2f} s after jax; "
                            f"one after the other {serial:.2f}, side by side at best {ideal:.2f}, on a thread "
                            f"{both['backend_up']:.2f} (the thread saves {serial - both['backend_up']:.2f} of "
                            f"{serial - ideal:.2f} s)")
    return "\n".join(lines + verdicts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", default=None, choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--cpu", action="store_true", help="JAX_PLATFORMS=cpu in every part [auto: where no libtpu]")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every part, interleaved [1]")
    p.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--importtime", action="store_true", help="also the slowest modules under -X importtime")
    p.add_argument("--variant", action="append", default=[], metavar='"LABEL K=V ..."',
                   help="the devices part once more with these variables set (repeatable)")
    p.add_argument("--runtime-log", type=int, default=0, metavar="LINES",
                   help="the variants' runtime log (TPU_STDERR_LOG_LEVEL=0): its last LINES lines in each row")
    p.add_argument("--transfer-mib", type=int, default=0, metavar="MIB",
                   help="the devices parts also time copies of MIB MiB to the device and back")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)), flush=True)
        return 0
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    cpu = on_cpu(args)
    env = environment(cpu)
    if args.transfer_mib:
        env["STARTUP_PARTS_TRANSFER_MIB"] = str(args.transfer_mib)
    rows = []
    for _ in range(args.repeat):
        for part in parts:
            rows.append(run_part(part, env))
            print(json.dumps(rows[-1]), flush=True)
        for label, extra in variants:
            logged = {"TPU_STDERR_LOG_LEVEL": "0", "TPU_MIN_LOG_LEVEL": "0"} if args.runtime_log else {}
            rows.append(run_part("devices", {**env, **logged, **extra}, label, args.runtime_log))
            print(json.dumps(rows[-1]), flush=True)
    result = {"backend": "cpu" if cpu else "default", "rows": rows, "medians": summary(rows)}
    if args.importtime:
        result["importtime"] = {who: import_times(modules, env) for who, modules in
                                (("trainer", TRAINER_MODULES), ("server", SERVER_MODULES))}
        for who, top in result["importtime"].items():
            print(json.dumps({"importtime": who, "top": [[m, round(s, 3)] for m, s in top]}), flush=True)
    print(table(result["medians"]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
