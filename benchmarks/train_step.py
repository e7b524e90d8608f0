"""Train-step throughput of the trainer, measured through its own command line in one run.

    python benchmarks/train_step.py [--steps 30] [--json]            # tiny on 1 and 8 fake CPU devices
    python benchmarks/train_step.py --accelerator [--config moe-1b]  # a ~1B-parameter MoE on GPU/TPU

Each case runs `python -m trainer` in a fresh process (fake device counts are fixed at jax start-up),
skips the first steps (warm-up), and reports the median step time, tokens/s and, where the device's
peak is known, MFU; the CPU table ends with the 8-device / 1-device throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3

CPU_CASES = [
    ("tiny, 1 device", "tiny", ["--devices", "1", "--mesh", "data=1,expert=1"]),
    ("tiny, 8 devices (data=2, expert=4)", "tiny", ["--devices", "8", "--mesh", "data=2,expert=4"]),
    ("tiny, 8 devices (data=1, expert=8)", "tiny", ["--devices", "8", "--mesh", "data=1,expert=8"]),
]


def measure(config: str, flags: list[str], steps: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as work:
        metrics = os.path.join(work, "m.jsonl")
        cmd = [sys.executable, "-m", "trainer", "--config", config, "--steps", str(steps), "--metrics", metrics,
               *flags, *(x for o in overrides for x in ("--set", o))]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(metrics) if line.startswith("{")]
    timed = rows[WARMUP:] or rows
    step_time = statistics.median(r["step_time_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
    return {"step_time_s": step_time, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(mfus) if mfus else None, "final_loss": rows[-1]["loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accelerator", action="store_true",
                        help="run --config on the default backend (GPU or TPU) instead of the CPU cases")
    parser.add_argument("--config", default="moe-1b", help="the config for --accelerator [moe-1b]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    if args.accelerator:
        cases = [(f"{args.config}, default backend", args.config, [])]
    else:
        cases = CPU_CASES
    overrides = (["train.log_every=1"] if args.accelerator else []) + args.overrides
    results = {name: measure(config, flags, args.steps, overrides) for name, config, flags in cases}
    if not args.accelerator:
        base = results[CPU_CASES[0][0]]["tokens_per_s"]
        for r in results.values():
            r["throughput_vs_1_device"] = r["tokens_per_s"] / base
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'case':40s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>7s} {'vs 1 dev':>9s}")
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        ratio = f"{r['throughput_vs_1_device']:.2f}x" if "throughput_vs_1_device" in r else ""
        print(f"{name:40s} {r['step_time_s'] * 1e3:9.1f} {r['tokens_per_s']:10,.0f} {mfu:>7s} {ratio:>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
