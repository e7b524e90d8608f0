"""Compile time against depth: the train step and the serving decode step of a 32-layer model against the same
model with 2 layers, scanned over its layers (model.scan_layers, the default) and, for comparison, a layer at a
time (each layer traced and compiled apart, as before the layers were stacked), side by side in one run.

    python benchmarks/compile_layers.py [--config tiny] [--layers 2 32] [--set KEY=VALUE ...] [--no-unrolled] [--json]

The issue's target: with the scan, 32 layers compile in at most 1.5x the time of 2. One process, one device;
each program is lowered and compiled once, nothing is run; the figures are the process's CPU seconds (all its
threads: on a shared machine wall time measures the neighbours), after one warm-up compile of each step that
is not counted (jax's first trace and lowering of each primitive would otherwise fall on the first case).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


STEPS = ("train", "decode", "build")
TARGET = "  (target <= 1.5x)"


def compile_seconds(config: str, layers: int, scan: bool, overrides: list[str]) -> dict[str, float]:
    """{"build": s, "train": s, "decode": s}: CPU seconds to build the trainer (the model traced abstractly, its
    initialisation's random streams), and to lower and compile each step of the config at `layers`."""
    import jax
    import jax.numpy as jnp

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve.kvcache import KVCache
    from trainer.serve.weights import build_serving_model
    from trainer.step import build_trainer, compile_step

    cfg = load_config(config, [*overrides, f"model.num_layers={layers}", f"model.scan_layers={str(scan).lower()}",
                               "train.program_cache=false"])  # compiled, never a kept program loaded
    mesh = sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1])
    begun = time.process_time()
    trainer = build_trainer(cfg, mesh, 100)
    built = time.process_time()
    compile_step(trainer)
    train = time.process_time() - built

    served, slots, max_len, m = build_serving_model(cfg, mesh), 8, 256, cfg.model
    cache = jax.eval_shape(lambda: KVCache.empty(m.num_layers, slots, max_len, m.kv_heads, m.head_size, cfg.dtype))
    step = jax.jit(lambda w, c, t, p: served.module(w).decode(t[:, None], c, p))
    int_S = jax.ShapeDtypeStruct((slots,), jnp.int32)
    start = time.process_time()
    step.lower(served.abstract(), cache, int_S, int_S).compile()
    return {"build": built - begun, "train": train, "decode": time.process_time() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--layers", type=int, nargs=2, default=(2, 32), metavar=("FEW", "MANY"))
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--no-unrolled", action="store_true", help="only the scanned model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    few, many = args.layers
    result = {}
    compile_seconds(args.config, few, True, args.overrides)  # the warm-up, not counted
    for scan in (True,) if args.no_unrolled else (True, False):
        mode = "scanned" if scan else "unrolled"
        times = {n: compile_seconds(args.config, n, scan, args.overrides) for n in (few, many)}
        result[mode] = {**{f"{step}_{n}_layers_s": round(times[n][step], 2) for n in (few, many)
                           for step in STEPS},
                        **{f"{step}_ratio": round(times[many][step] / times[few][step], 2) for step in STEPS}}
    if args.json:
        print(json.dumps({"config": args.config, "layers": [few, many], **result}))
        return 0
    print(f"compile time, {args.config}, {few} against {many} layers (CPU seconds of one process)")
    for mode, r in result.items():
        for step in STEPS:
            print(f"  {mode:8} {step:6} {r[f'{step}_{few}_layers_s']:7.2f} s -> {r[f'{step}_{many}_layers_s']:7.2f} s"
                  f"   ratio {r[f'{step}_ratio']:.2f}x{TARGET if mode == 'scanned' and step != 'build' else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
