"""Train-step throughput of the trainer, measured through its own command line in one run.

    python benchmarks/train_step.py [--steps 30] [--json]            # tiny on 1 and 8 fake CPU devices
    python benchmarks/train_step.py --accelerator [--config moe-1b]  # a ~1B-parameter MoE on GPU/TPU
    ... --json-out FIGURES.json                                      # the figures also to a file
    ... --accelerator --paths capacity,dropless                      # each MoE path on the chip

Each case runs `python -m trainer` in a fresh process (fake device counts are fixed at jax start-up),
skips the first steps (warm-up), and reports the median step time, tokens/s and, where the device's
peak is known, MFU, the accelerator's peak memory, and the time to the first step with its parts (the
state's initialisation, the train step's compile; the rest is imports, the run's spec and the data): on
an accelerator from an empty compilation cache of the case's own, then again (a short run) from the cache
that filled (`warm_*`). The CPU table ends with the 8-device / 1-device throughput ratio. On an accelerator
the run takes the config as written (moe-1b is set for one v5e chip) and logs every LOG_EVERY steps, so that
the loop reads the device only there, as in training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 5  # steps left out of the medians (a row past them counts: a whole row of LOG_EVERY)
LOG_EVERY = 5  # on an accelerator: each row's step time is the mean of its LOG_EVERY steps
STARTUP = ("first_step_s", "init_s", "compile_s", "peak_hbm_gib", "compile_log")
# The MoE paths an accelerator run can measure (--paths): the config's own (capacity), and dropless through
# jax.lax.ragged_dot or the megablox kernel.
PATHS = {"capacity": [], "dropless": ["moe.capacity_factor=0", "moe.grouped_matmul=ragged_dot"],
         "megablox": ["moe.capacity_factor=0", "moe.grouped_matmul=megablox"]}

CPU_CASES = [
    ("tiny, 1 device", "tiny", ["--devices", "1", "--mesh", "data=1,expert=1"]),
    ("tiny, 8 devices (data=2, expert=4)", "tiny", ["--devices", "8", "--mesh", "data=2,expert=4"]),
    ("tiny, 8 devices (data=1, expert=8)", "tiny", ["--devices", "8", "--mesh", "data=1,expert=8"]),
]


def train(config: str, flags: list[str], steps: int, overrides: list[str], env: dict | None = None) -> list:
    """The metric rows of one `python -m trainer` run; with JAX_LOG_COMPILES=1 in `env`, the first row also
    holds `compile_log`: jax's lines on each program's tracing, compile or cache hit, with their seconds."""
    with tempfile.TemporaryDirectory() as work:
        metrics = os.path.join(work, "m.jsonl")
        cmd = [sys.executable, "-m", "trainer", "--config", config, "--steps", str(steps), "--metrics", metrics,
               *flags, *(x for o in overrides for x in ("--set", o))]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(metrics) if line.startswith("{")]
        if env and env.get("JAX_LOG_COMPILES") == "1" and rows:
            rows[0]["compile_log"] = [line.strip()[-240:] for line in proc.stderr.splitlines() if telling(line)]
        return rows


def telling(line: str) -> bool:
    """A compile-log line worth keeping: a cache hit or miss, or a step of 0.05 s or more."""
    if "cache" in line.lower():
        return True
    m = re.search(r"Finished .* in ([0-9.]+) sec", line)
    return bool(m) and float(m.group(1)) >= 0.05


def measure(config: str, flags: list[str], steps: int, overrides: list[str], warm: bool = False,
            log_compiles: bool = False) -> dict:
    """One case's figures. With `warm`, in a compilation cache of its own: the run, from an empty cache, then
    a short one from the cache it filled (warm_*: the start-up's figures then), and that one again with
    train.program_cache off (warm_traced_first_step_s: its programs traced and lowered, then found in jax's
    cache). With `log_compiles`, each run's compile log (`compile_log`, `warm_compile_log`)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache) if warm else None
        if log_compiles:
            env = dict(env or os.environ, JAX_LOG_COMPILES="1")
        rows = train(config, flags, steps, overrides, env)
        again = train(config, flags, LOG_EVERY, overrides, env)[0] if warm else {}
        # the same warm start with its programs looked up in jax's cache alone (traced and lowered first)
        traced = train(config, flags, LOG_EVERY, [*overrides, "train.program_cache=false"], env)[0] if warm else {}
    # past the warm-up, and no row with a step on the quick program (trainer/step.py TieredStep)
    timed = [r for r in rows if r["step"] > WARMUP and not r.get("quick_steps")] or rows
    step_time = statistics.median(r["step_time_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
    return {"step_time_s": step_time, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(mfus) if mfus else None, "final_loss": rows[-1]["loss"],
            "quick_steps": sum(r.get("quick_steps", 0) for r in rows),
            "overrides": overrides, **{k: rows[0].get(k) for k in STARTUP},
            **{f"warm_{k}": again[k] for k in STARTUP if k in again},
            **({"warm_traced_first_step_s": traced.get("first_step_s")} if traced else {}),
            **{k: v for k, v in rows[0].items() if k.startswith("startup_")},  # trainer/startup.py's marks
            **{f"warm_{k}": v for k, v in again.items() if k.startswith("startup_")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accelerator", action="store_true",
                        help="run --config on the default backend (GPU or TPU) instead of the CPU cases")
    parser.add_argument("--config", default="moe-1b", help="the config for --accelerator [moe-1b]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--json-out", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--log-compiles", action="store_true",
                        help="keep jax's log of each program's tracing, compile and cache hit, with seconds, in "
                             "the JSON (compile_log, warm_compile_log) and print it")
    parser.add_argument("--paths", default="capacity", help=f"with --accelerator, the MoE paths to run, "
                        f"comma-separated, of {', '.join(PATHS)} [capacity]")
    args = parser.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(PATHS)}")
    if args.accelerator:  # (name, config, flags, overrides)
        cases = [(f"{args.config}, {path}, default backend", args.config, [], PATHS[path]) for path in paths]
    else:
        cases = [(name, config, flags, []) for name, config, flags in CPU_CASES]
    # On an accelerator the warm run is a restart of the same run: its schedule (in the programs) decays over the
    # first run's steps, whatever the few steps it runs (a program kept by trainer/program_cache.py is then its).
    overrides = ([f"train.log_every={LOG_EVERY}", f"optim.decay_steps={args.steps}"] if args.accelerator else []
                 ) + args.overrides
    results = {name: measure(config, flags, args.steps, [*path, *overrides], warm=args.accelerator,
                             log_compiles=args.log_compiles)
               for name, config, flags, path in cases}
    for name, r in results.items():
        for prefix in ("", "warm_"):
            marks = {k[len(prefix) + 8:-2]: v for k, v in r.items() if k.startswith(f"{prefix}startup_")}
            if marks:
                print(f"-- {name}: {prefix}start-up (s since the process started): "
                      + ", ".join(f"{k} {v}" for k, v in marks.items()), file=sys.stderr)
        for key in ("compile_log", "warm_compile_log"):
            if r.get(key):
                print(f"-- {name}: {key}\n" + "\n".join(r[key]), file=sys.stderr)
    if not args.accelerator:
        base = results[CPU_CASES[0][0]]["tokens_per_s"]
        for r in results.values():
            r["throughput_vs_1_device"] = r["tokens_per_s"] / base
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(table(results))
    return 0


def table(results: dict) -> str:
    seconds = lambda v: f"{v:.1f}" if v is not None else "n/a"  # noqa: E731
    lines = [f"{'case':40s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>7s} {'vs 1 dev':>9s} {'1st step s':>10s} "
             f"{'init s':>7s} {'compile s':>9s} {'warm 1st s':>10s} {'traced':>7s} {'peak GiB':>8s}"]
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        ratio = f"{r['throughput_vs_1_device']:.2f}x" if "throughput_vs_1_device" in r else ""
        lines.append(f"{name:40s} {r['step_time_s'] * 1e3:9.1f} {r['tokens_per_s']:10,.0f} {mfu:>7s} {ratio:>9s} "
                     f"{seconds(r['first_step_s']):>10s} {seconds(r['init_s']):>7s} {seconds(r['compile_s']):>9s} "
                     f"{seconds(r.get('warm_first_step_s')):>10s} {seconds(r.get('warm_traced_first_step_s')):>7s} "
                     f"{seconds(r.get('peak_hbm_gib')):>8s}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
