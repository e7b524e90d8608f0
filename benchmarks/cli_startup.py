"""CLI start-up and the dry-run lifecycle, measured side by side in one run.

    python benchmarks/cli_startup.py [--repeat 7] [--json]

Prints the median wall time of `python -c pass` (the floor any Python CLI pays),
`moe-tpu --help`, and a whole dry-run `slice up` + `down` of examples/v5e-64.yaml on
the emulator, with the ratios to the floor. Targets: --help under 0.3 s, the dry-run
lifecycle under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmds: list[list[str]], cwd: str) -> float:
    start = time.perf_counter()
    for cmd in cmds:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True,
                       env=dict(os.environ, NO_COLOR="1"))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    moe = shutil.which("moe-tpu")
    if moe is None:
        print("moe-tpu is not installed: pip install -e '.[control,trainer]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as work:
        shutil.copy(ROOT / "examples" / "v5e-64.yaml", Path(work) / "moe-tpu.yaml")
        cases = {
            "python_pass": [[sys.executable, "-c", "pass"]],
            "help": [[moe, "--help"]],
            "dry_run_up_down": [[moe, "--dry-run", "slice", "up"], [moe, "--dry-run", "down"]],
        }
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeat):  # interleaved, so load on the machine hits every case alike
            for name, cmds in cases.items():
                samples[name].append(timed(cmds, work))
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "repeat": args.repeat,
        "python_pass_s": round(med["python_pass"], 4),
        "help_s": round(med["help"], 4),
        "help_over_python": round(med["help"] / med["python_pass"], 2),
        "dry_run_up_down_s": round(med["dry_run_up_down"], 4),
        "dry_run_over_python": round(med["dry_run_up_down"] / med["python_pass"], 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:22} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
