"""The initial state's programs compiled ahead of time for one TPU v5e chip, on this CPU: the trainer's
(Trainer.init_fn: parameters and Adam's zeros) and the serving engine's (trainer/serve/weights.py
init_program), against a program drawn as before trainer/initializers.py (jax.random in each parameter's own
shape, a stack's layers in one jax.lax.map).

    /tmp/aotvenv/bin/python benchmarks/init_compile.py                 # moe-1b
    /tmp/aotvenv/bin/python benchmarks/init_compile.py -c tiny --json-out init.json

The venv is benchmarks/aot_topology.py's (jax with libtpu, which holds the TPU compiler). Nothing is run or
allocated: each program is lowered from the config and compiled for a v5e:1x1 topology. Seconds are wall
and the process's CPU (the compiler's threads included); on a busy machine trust the CPU figure.

Measured 2026-12-07 (jax 0.10.2, libtpu 0.0.42.1, 2 CPU cores shared with other work: load 8), moe-1b:
the trainer's init_fn before trainer/initializers.py 37.7 s wall / 19.1 s CPU (28-29 s on the v5e host), the
"before" stand-in here 39.9 / 22.5; now the trainer's 10.8 / 5.9 and the serving engine's 9.1 / 5.4. A
program without any draw compiles in 0.7 s CPU: the draws are the cost (trainer/initializers.py says why and
how they are made).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _timed(lowered) -> dict:
    started, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    stats = compiled.memory_analysis()
    return {"compile_s": round(time.perf_counter() - started, 2), "compile_cpu_s": round(time.process_time() - cpu, 2),
            "temp_gib": round(stats.temp_size_in_bytes / 2**30, 2)}


def before_program(tr):
    """The parameters as the trainer drew them before: jax.random in each one's own shape (normal for the
    embedding, truncated normal otherwise), a stacked parameter's layers in one jax.lax.map."""
    import jax
    import jax.numpy as jnp

    def draw(key, name, var):
        value = var.get_value()
        shape, dtype = value.shape, value.dtype
        if "norm" in name:
            return jnp.ones(shape, dtype)
        if name == "embed":
            return jax.random.normal(key, shape, dtype)
        if name.startswith("stacks."):
            keys = jax.random.split(key, shape[0])
            return jax.lax.map(lambda k: jax.random.truncated_normal(k, -2, 2, shape[1:], dtype) * 0.02, keys)
        return jax.random.truncated_normal(key, -2, 2, shape, dtype) * 0.02

    def init():
        key = jax.random.key(0)
        return {name: draw(jax.random.fold_in(key, i), name, var)
                for i, (name, var) in enumerate(tr.codec.variables.items())}

    return jax.jit(init, out_shardings=tr.state_shardings["params"])


def measure(config: str, overrides: list[str]) -> dict:
    from jax.experimental import topologies

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve.weights import build_serving_model, init_program
    from trainer.step import build_trainer

    cfg = load_config(config, overrides)
    devices = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu",
                                           chips_per_host_bounds=(1, 1, 1)).devices
    mesh = sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, devices)
    tr = build_trainer(cfg, mesh, cfg.train.steps)
    result = {"config": cfg.name, "params": sum(v.get_value().size for v in tr.codec.variables.values())}
    result["before"] = _timed(before_program(tr).lower())
    result["trainer"] = _timed(tr.init_fn.lower())
    result["serving"] = _timed(init_program(build_serving_model(cfg, mesh)).lower())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", default="moe-1b", help="a trainer config name or YAML path [moe-1b]")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--json-out", help="write the result here as JSON")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host backend; the TPU compiler comes from libtpu
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        sys.exit("the TPU compiler is not installed: run this with benchmarks/aot_topology.py's venv")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = measure(args.config, args.overrides)
    print(f"{result['config']} ({result['params'] / 1e9:.2f}B parameters), init programs for one v5e chip:")
    for what, label in (("before", "drawn as before (jax.random, own shapes)"), ("trainer", "trainer init_fn"),
                        ("serving", "serving init_program")):
        r = result[what]
        print(f"  {label:<42} {r['compile_s']:6.1f} s wall {r['compile_cpu_s']:6.1f} s CPU"
              f"  temporaries {r['temp_gib']:.2f} GiB")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
