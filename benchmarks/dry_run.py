"""The README's main job (`moe-tpu --dry-run run`) against the trainer it runs, side by side in one run.

    python benchmarks/dry_run.py [--repeat 3] [--config examples/v5e-64.yaml] [--scenario happy] [--json]

Each round times, interleaved: the whole dry run (plan, emulated provisioning, the trainer
really training on this CPU, teardown) and the trainer alone with the very argv the dry run
gives it (same model, steps, fake devices and mesh). The ratio is what the control plane,
the emulator and the following cost on top of training; the target for the whole job is
under 120 s on a 2-core machine.
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
sys.path.insert(0, str(ROOT))


def timed(cmd: list[str], cwd: str) -> float:
    """Seconds `cmd` takes in `cwd`, with a JAX compilation cache of its own there (a first run's, empty:
    the dry run's trainer keeps one, and neither side may find what an earlier round compiled)."""
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True,
                   env=dict(os.environ, NO_COLOR="1", JAX_COMPILATION_CACHE_DIR=str(Path(cwd) / "jax-cache")))
    return time.perf_counter() - start


def trainer_argv(config: Path, output_dir: Path) -> list[str]:
    """The argv `run --dry-run` gives the local trainer, from the same code."""
    from provision.config import load_config
    from provision.emulator.local_trainer import local_argv
    from provision.rendering import trainer_argv as container_argv

    cfg = load_config(config)
    return local_argv(container_argv(cfg), cfg, output_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "v5e-64.yaml")
    parser.add_argument("--scenario", default="happy")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    moe = shutil.which("moe-tpu")
    if moe is None:
        print("moe-tpu is not installed (pip install -e '.[control,trainer]')", file=sys.stderr)
        return 2
    config = args.config.resolve()
    runs, trains = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as work:
            runs.append(timed([moe, "--dry-run", "--scenario", args.scenario, "run", "-c", str(config)], work))
        with tempfile.TemporaryDirectory() as work:
            trains.append(timed(trainer_argv(config, Path(work) / "output"), work))
    result = {"config": str(args.config), "scenario": args.scenario, "repeat": args.repeat,
              "run_s": round(statistics.median(runs), 2), "trainer_alone_s": round(statistics.median(trains), 2)}
    result["ratio"] = round(result["run_s"] / result["trainer_alone_s"], 2)
    result["overhead_s"] = round(result["run_s"] - result["trainer_alone_s"], 2)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"dry-run run: {result['run_s']} s (median of {args.repeat}); the trainer alone, same argv: "
              f"{result['trainer_alone_s']} s; ratio {result['ratio']}x, overhead {result['overhead_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
