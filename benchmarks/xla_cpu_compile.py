"""XLA's CPU code generators for the suite's programs, measured side by side in one run.

    python benchmarks/xla_cpu_compile.py [--repeat 3] [--json]

The suite's compile-bound tests compile the expert-parallel MoE block (forward and gradients, on 8
fake CPU devices) with most of XLA's optimisations off (tests/trainer/conftest.py). This compiles
such blocks in fresh processes (XLA reads its flags once per process), interleaved so that load on
the machine hits every mode alike, and prints the median CPU seconds of compiling them in each mode:

- unoptimised, new emitters: JAX_DISABLE_MOST_OPTIMIZATIONS=1, XLA's default fusion emitters;
- unoptimised, old emitters: the same with --xla_cpu_use_fusion_emitters=false (the compile-bound tests);
- optimised, new emitters (XLA's default) and optimised, old emitters: XLA's optimisations on;
- optimised, old emitters, LLVM level 1: with --xla_backend_optimization_level=1 too (the rest of the suite).

Its ratios are what tests/conftest.py chooses XLA's CPU flags by, for every process of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "unoptimised_new_emitters": ("1", ""),
    "unoptimised_old_emitters": ("1", "--xla_cpu_use_fusion_emitters=false"),
    "optimised_new_emitters": ("0", ""),
    "optimised_old_emitters": ("0", "--xla_cpu_use_fusion_emitters=false"),
    "optimised_old_emitters_llvm1": ("0", "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"),
}
# test_moe_parallel's shapes: 16 x 8 tokens of width 16, 8 experts of hidden size 32.
B, L, D, F, E = 16, 8, 16, 32, 8
CASES = {"top2_capacity": dict(top_k=2, capacity_factor=4.0, routing_groups=8),
         "top2_dropless": dict(top_k=2, capacity_factor=0.0, block_rows=8, routing_groups=8),
         "top2_dropless_once": dict(top_k=2, capacity_factor=0.0, block_rows=8, routing_groups=8,
                                    exchange_rows="device")}


def child() -> None:
    """Compile each case's forward and gradients on mesh expert=8; print the CPU seconds it took."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.moe import MoEConfig
    from trainer.moe.experts import ExpertWeights
    from trainer.moe.parallel import moe_apply

    mesh = jax.make_mesh((1, 8), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    keys = jax.random.split(jax.random.key(0), 5)
    x = put(jax.random.normal(keys[0], (B, L, D)), P(("data", "expert")))
    router = put(jax.random.normal(keys[1], (D, E)), P())
    weights = ExpertWeights(*(put(jax.random.normal(k, s) * 0.2, P("expert"))
                              for k, s in zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)))
    jax.block_until_ready((x, router, weights))
    start = time.process_time()
    for case in CASES.values():
        cfg = MoEConfig(num_experts=E, d_ff=F, min_capacity=1, **case)

        def loss(x, router, w, cfg=cfg):
            y, aux = moe_apply(x, router, w, cfg, mesh, train=True)
            return jnp.sum(y.astype(jnp.float32)) + aux["aux_loss"]
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, router, weights).compile()
    print(json.dumps({"compile_cpu_s": time.process_time() - start}))


def measure(mode: str) -> float:
    unoptimised, flags = MODES[mode]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS=unoptimised,
               JAX_ENABLE_COMPILATION_CACHE="false",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {flags}".strip())
    out = subprocess.run([sys.executable, __file__, "--child"], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["compile_cpu_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return 0
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeat):  # interleaved
        for mode in MODES:
            samples[mode].append(measure(mode))
    med = {mode: round(statistics.median(v), 2) for mode, v in samples.items()}
    result = {"repeat": args.repeat, **{f"{m}_cpu_s": v for m, v in med.items()},
              "unoptimised_old_over_new": round(med["unoptimised_old_emitters"] / med["unoptimised_new_emitters"], 2),
              "optimised_old_over_new": round(med["optimised_old_emitters"] / med["optimised_new_emitters"], 2),
              "optimised_suite_over_default": round(med["optimised_old_emitters_llvm1"] / med["optimised_new_emitters"],
                                                    2)}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
