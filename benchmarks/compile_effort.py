"""The train step's compile time against its step time, for XLA's effort settings side by side in one process:
what a program compiled for speed of compilation costs a step (`exec_time_optimization_effort` -1.0, and the
optimisation levels O0 and O1) against the default.

    python benchmarks/compile_effort.py                      # on the chip: compile and run each variant
    /tmp/aotvenv/bin/python benchmarks/compile_effort.py     # no chip: compiled for one v5e ahead of time only
    python benchmarks/compile_effort.py --variants base,effort-1 --steps 10 --json-out effort.json

One process: the step is traced and lowered once; each variant compiles it with its own compiler options
(jax caches compiled programs by them, and no persistent cache is set here, so each is a real compile), then,
where a chip is present, runs 2 unmeasured steps and `--steps` measured ones from the state the last variant
left (the same shapes; the values differ, the work does not). `quick` is the trainer's own quick program
(trainer/step.py QUICK_STEP_OPTIONS, TieredStep). The initial state's program is compiled and timed too.
Seconds are wall and the process's CPU seconds (the compiler's threads included).

On one v5e chip, 2026-12-07 (moe-1b): base 21.1 s to compile, 310.7 ms a step; effort-1 and O0 12.1-12.6 s,
817.8 ms; O1 13.6 s, 468.9 ms; the initial state's program 13.3 s at the default effort and at -1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def variants() -> dict[str, dict]:
    from jax._src.config import EffortLevel

    from trainer.step import QUICK_STEP_OPTIONS

    return {"base": {}, "effort-1": {"exec_time_optimization_effort": -1.0},
            "effort-0.5": {"exec_time_optimization_effort": -0.5},
            "O1": {"optimization_level": EffortLevel.O1.value}, "O0": {"optimization_level": EffortLevel.O0.value},
            "quick": QUICK_STEP_OPTIONS}


def timed_compile(lowered, options: dict) -> tuple:
    started, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    return compiled, round(time.perf_counter() - started, 2), round(time.process_time() - cpu, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default="moe-1b")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--variants", default="base,effort-1,O0,O1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--init-quick", action="store_true",
                        help="also compile the initial state's program at effort -1.0 (not run)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    import importlib.util

    aot = importlib.util.find_spec("libtpu") is not None and os.environ.get("JAX_PLATFORMS") == "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer import flops, sharding
    from trainer.config import load_config
    from trainer.step import build_trainer

    known = variants()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {','.join(known)}")
    cfg = load_config(args.config, args.overrides)
    on_chip = jax.devices()[0].platform == "tpu"
    if on_chip:
        devices = jax.devices()[:1]
    elif aot:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu",
                                               chips_per_host_bounds=(1, 1, 1)).devices
    else:
        sys.exit("no chip, and no TPU compiler to compile for one: run on the chip, or with JAX_PLATFORMS=cpu in "
                 "benchmarks/aot_topology.py's venv")
    mesh = sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, devices)
    tr = build_trainer(cfg, mesh, 1000)
    batch_shape = (cfg.data.global_batch_size, cfg.data.seq_len + 1)
    t = time.perf_counter()
    lowered = tr.step_fn.lower(tr.abstract_state, jax.ShapeDtypeStruct(batch_shape, jnp.int32,
                                                                        sharding=tr.batch_sharding))
    result = {"config": cfg.name, "chip": on_chip, "lower_s": round(time.perf_counter() - t, 2), "rows": []}
    init, s, cpu = timed_compile(tr.init_fn.lower(), {})
    result["init_compile_s"], result["init_compile_cpu_s"] = s, cpu
    if args.init_quick:  # the same program at effort -1, compiled only
        _, s, cpu = timed_compile(tr.init_fn.lower(), known["effort-1"])
        result.update(init_quick_compile_s=s, init_quick_compile_cpu_s=cpu)
    state = tokens = None
    if on_chip:
        t = time.perf_counter()
        state = jax.block_until_ready(init())
        result["init_run_s"] = round(time.perf_counter() - t, 2)
        rng = np.random.default_rng(0)
        tokens = jax.device_put(rng.integers(0, cfg.data.synthetic_vocab, batch_shape, np.int32), tr.batch_sharding)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for name in chosen:
        compiled, s, cpu = timed_compile(lowered, known[name])
        mem = compiled.memory_analysis()
        row = {"variant": name, "compile_s": s, "compile_cpu_s": cpu,
               "temp_gib": round(mem.temp_size_in_bytes / 2**30, 2) if mem is not None else None}
        if on_chip:
            for _ in range(2):
                state, metrics = compiled(state, tokens)
            float(metrics["loss"])
            t = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = compiled(state, tokens)
            row["loss"] = float(metrics["loss"])
            step_s = (time.perf_counter() - t) / args.steps
            row.update(step_ms=round(step_s * 1e3, 1),
                       mfu=round(flops.mfu(cfg, step_s, 1, jax.devices()[0].device_kind), 4))
        del compiled
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in result["rows"] if r["variant"] == "base"), None)
    for r in result["rows"]:
        if base and r is not base:
            r["compile_vs_base"] = round(r["compile_s"] / base["compile_s"], 3)
            if "step_ms" in r:
                r["step_vs_base"] = round(r["step_ms"] / base["step_ms"], 3)
        print(f"{r['variant']:<11} compile {r['compile_s']:6.1f} s ({r['compile_cpu_s']:6.1f} CPU s)  "
              + (f"step {r['step_ms']:7.1f} ms  MFU {100 * r['mfu']:.1f}%  " if "step_ms" in r else "")
              + (f"compile x{r.get('compile_vs_base')} step x{r.get('step_vs_base')}" if r is not base else ""))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
