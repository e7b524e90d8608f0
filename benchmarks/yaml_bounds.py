"""`moe-tpu validate` on hostile YAML against the same command on the example config, side by side.

    python benchmarks/yaml_bounds.py [--repeat 5] [--json]

Each case is a config file given to `moe-tpu validate` in a new process (start-up included):
the example config (the baseline, exit 0) and the shapes that used to be slow (200,000 `[`,
200,000 `{`, 10,000 nested block mappings, a 10,000-link alias chain), each of which must exit 2
with its message. Prints the median wall time of each and its ratio to the baseline. Target:
every hostile case under 2 s on a 2-core machine, that is about the baseline's cost.
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

CASES = {
    "example": ((ROOT / "examples" / "v5e-64.yaml").read_text(), 0),
    "flow_sequences": ("region: " + "[" * 200_000 + "\n", 2),
    "flow_mappings": ("region: " + "{" * 200_000 + "\n", 2),
    "block_mappings": ("".join(" " * i + f"k{i}:\n" for i in range(10_000)), 2),
    "alias_chain": ("a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 10_000)), 2),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    moe = shutil.which("moe-tpu")
    if moe is None:
        print("moe-tpu is not installed: pip install -e '.[control]'", file=sys.stderr)
        return 2
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as work:
        for name, (text, _) in CASES.items():
            Path(work, f"{name}.yaml").write_text(text)
        for _ in range(args.repeat):  # interleaved, so load on the machine hits every case alike
            for name, (_, code) in CASES.items():
                start = time.perf_counter()
                done = subprocess.run([moe, "validate", "--config", f"{name}.yaml"], cwd=work,
                                      capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1"))
                samples[name].append(time.perf_counter() - start)
                if done.returncode != code:
                    print(f"{name}: exit {done.returncode}, expected {code}\n{done.stderr[-2000:]}", file=sys.stderr)
                    return 1
    median = {name: statistics.median(values) for name, values in samples.items()}
    result = {"repeat": args.repeat, **{f"{name}_s": round(value, 3) for name, value in median.items()},
              **{f"{name}_over_example": round(value / median["example"], 2)
                 for name, value in median.items() if name != "example"}}
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in median.items():
            ratio = "" if name == "example" else f"  {value / median['example']:.2f}x the example"
            print(f"{name:16s} {value:6.3f} s{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
