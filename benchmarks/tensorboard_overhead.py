"""What TensorBoard events add to the step time, measured side by side in one run.

    python benchmarks/tensorboard_overhead.py [--steps 60] [--rounds 2] [--json]

Runs `python -m trainer --config tiny` with an output directory, alternately with
train.tensorboard false and true (`--rounds` of each), and compares the median logged step time
(which includes the reporting of the step before). Also times TensorBoardWriter.write of one
metrics row on its own, as a share of that step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 5


def run(steps: int, tensorboard: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "trainer", "--config", "tiny", "--devices", "1", "--steps", str(steps),
               "--output-dir", work, "--metrics", os.path.join(work, "m.jsonl"),
               "--set", f"train.tensorboard={str(tensorboard).lower()}", "--set", f"train.checkpoint_every={steps}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        if tensorboard and not list(Path(work, "tensorboard").glob("events.*")):
            raise SystemExit("no event file written")
        return [json.loads(line) for line in open(os.path.join(work, "m.jsonl"))]


def write_cost(row: dict, writes: int = 2000) -> float:
    sys.path.insert(0, str(ROOT))
    from trainer.tensorboard import TensorBoardWriter

    with tempfile.TemporaryDirectory() as work:
        writer = TensorBoardWriter(work)
        started = time.perf_counter()
        for step in range(writes):
            writer.write({**row, "step": step})
        seconds = (time.perf_counter() - started) / writes
        writer.close()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    row = None
    for _ in range(args.rounds):
        for tensorboard in (False, True):
            rows = run(args.steps, tensorboard)
            times[tensorboard] += [r["step_time_s"] for r in rows[WARMUP:]]
            row = rows[-1]
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per_write = write_cost(row)
    result = {"step_time_s_without": off, "step_time_s_with": on, "ratio": on / off,
              "write_s": per_write, "write_share_of_step": per_write / off}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median step time: {off * 1e3:.2f} ms without TensorBoard, {on * 1e3:.2f} ms with "
              f"(ratio {on / off:.3f})")
        print(f"one row's events: {per_write * 1e6:.0f} us, {per_write / off:.2%} of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
