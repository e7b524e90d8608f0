"""The planner's decode-step constants (provision/planner/serving.py DECODE_LAYER_S, DECODE_HBM_SHARE) fitted to
a chip's measured steps, and the planner's expected step against each of them:

    python benchmarks/fit_decode.py SERVE_WEIGHTS.json [MORE.json ...] [--span 88]

SERVE_WEIGHTS.json: `benchmarks/serve_weights.py --accelerator --json` (moe-1b on one v5e chip), or its JSON lines
(its standard output); the single steps of the config as it is (no --variant other than the first), a later file's
row for a format and slot count in place of an earlier one's (one chip call may time only some). The model:
step = layers x a fixed cost + the bytes the planner counts for the step (its weights and the KV cache over
--span positions, the span the measured steps attended over) / (the HBM's bandwidth x the format's share),
fitted by least squares of the relative error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--span", type=int, default=88, help="positions the measured steps attended over")
    args = p.parse_args()
    import numpy as np

    from provision import catalogue
    from provision.planner.estimates import Mesh
    from trainer.arith.params import inventory
    from trainer.config import load_config

    serving = importlib.import_module("provision.planner.serving")  # the module, not the package's function
    measured = {}
    for path in args.results:
        for r in measured_rows(Path(path).read_text()):
            measured[r["weights"], r["slots"]] = r
    cfg = load_config("moe-1b", ["dtype=bfloat16", "param_dtype=bfloat16"])
    params, acc, layers = inventory(cfg), catalogue.accelerator("v5litepod-1"), cfg.model.num_layers
    rows = []
    for r in measured.values():
        precision = r["weights"].split("-")[0]
        s = serving.serving(params, cfg, Mesh(1, 1), acc, precision, max_len=args.span)
        step = serving.decode_step(s, r["slots"])
        rows.append((precision, r["slots"], r["decode_step_ms"] / 1e3, step.hbm_s, step.expected_s))
    formats = sorted({row[0] for row in rows})
    a = np.zeros((len(rows), 1 + len(formats)))
    for i, (precision, _, measured, hbm_s, _) in enumerate(rows):
        a[i, 0], a[i, 1 + formats.index(precision)] = layers / measured, hbm_s / measured
    x = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)[0]
    shares = {f: 1 / x[1 + j] for j, f in enumerate(formats)}
    print(f"DECODE_LAYER_S = {x[0] * layers * 1e3:.3f}e-3 / {layers}; shares "
          + ", ".join(f"{f} {v:.2f}" for f, v in shares.items()))
    for precision, slots, measured, hbm_s, expected in rows:
        fitted = layers * x[0] + hbm_s / shares[precision]
        print(f"{precision:5} {slots:3} slots: measured {measured * 1e3:.3f} ms, planner {expected * 1e3:.3f} "
              f"({expected / measured:.2f}x), fitted {fitted * 1e3:.3f} ({fitted / measured:.2f}x)")
    return 0


def measured_rows(text: str) -> list[dict]:
    """The single steps of the config as it is (the first variant's, if any) in a serve_weights output."""
    try:
        rows = json.loads(text)["results"]
    except json.JSONDecodeError:  # its JSON lines
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    first = next((r.get("variant") for r in rows if r.get("variant")), None)
    return [r for r in rows if r.get("decode_steps", 1) == 1 and r.get("direct_assignments") != 0
            and r.get("variant") in (None, "", first) and "decode_step_ms" in r]


if __name__ == "__main__":
    sys.exit(main())
