"""A decode step's product of a few rows with one layer's weight read from its stack of layers, on the chip:
the project's Pallas kernel (trainer/moe/direct.py stacked_rows_product, the layer's tiles read in place)
against XLA's product of the layer's slice as held (direct.layer_product with "xla"), for each weight format and the
kernel's column tiles, side by side in one process:

    python benchmarks/rows_product.py [--json PATH] [--rows 1,8] [--formats bf16,int8,int4]

The weights are moe-1b's dense FFN's ([6, 1024, 4096] in, [6, 4096, 1024] out) and one expert's
([6 x 16, 1024, 2816]). Each figure is a call's device time (its ops in jax's profiler, 20 calls:
gmm_formats.timed) against the bound of the layer's bytes at 819 GB/s. The question it answers: where the
kernel's int4 tiles are no faster than XLA's copy and product (the 2026-12-07 chip calls, docs/performance.md),
is the kernel bound by the HBM or by widening int4 in the vector unit? An int8 tile holds twice int4's bytes
for the same values: if int8 and int4 take the same time a tile, the values bound it, not the bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

HBM = 819e9
WEIGHTS = {"dense in": (6, 1024, 4096), "dense out": (6, 4096, 1024), "expert in": (96, 1024, 2816)}
TILES = (512, 1024, None)  # the kernel's column tiles tried (None: column_tile's choice)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path")
    p.add_argument("--rows", default="1,8", help="comma-separated rows a call (a decode step's slots)")
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--scale-down", type=int, default=1, help="divide every width by this (a quick CPU check)")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    from gmm_formats import timed

    from trainer.moe import direct
    from trainer.moe.stacked import LayerOf
    from trainer.serve import quant, quant4

    on_tpu = jax.devices()[0].platform == "tpu"
    results = []
    for label, (groups, k, n) in WEIGHTS.items():
        k, n = k // args.scale_down, n // args.scale_down
        stack = (jax.random.normal(jax.random.key(0), (groups, k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
        name = "stacks.0.0.ffn.w_in"  # grouped along its inputs, as every one of these weights
        held = {"bf16": stack, "int8": quant.quantize_array(name, stack),
                "int4": quant4.quantize_array(name, stack, storage="native")}
        for fmt in args.formats.split(","):
            w = held[fmt]
            nbytes = {"bf16": 2 * k * n, "int8": k * n, "int4": k * n // 2}[fmt]
            whole = LayerOf(jax.tree.map(lambda a: a[:, None], w), jnp.int32(0))  # as stacked.split_stacks keeps it
            operands = None if fmt == "bf16" else direct.kernel_operands(whole, "kernel")
            for rows in map(int, args.rows.split(",")):
                x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
                layer = jnp.int32(groups // 2)
                base = {"weight": label, "shape": [k, n], "format": fmt, "rows": rows,
                        "bound_us": round(1e6 * nbytes / HBM, 2)}

                def xla(x, stack, layer):  # the engine's own path for a slice as held (direct.layer_product)
                    return direct.layer_product(x, LayerOf(stack, layer), jnp.bfloat16, "xla")

                variants = [("xla, the slice as held", jax.jit(xla), (x, whole.stack, layer))]
                for tile in TILES if operands is not None else ():
                    def kernel(x, values, scale, layer, tile=tile):
                        padded = jnp.pad(x, ((0, -x.shape[0] % direct.KERNEL_ROWS), (0, 0)))[None]
                        return direct.stacked_rows_product(padded, values, scale, layer[None],
                                                           interpret=not on_tpu, columns=tile)

                    chosen = direct.column_tile(k, n) if tile is None else min(n, tile)
                    variants.append((f"kernel, {chosen} columns a tile", jax.jit(kernel), (x, *operands, layer)))
                for impl, fn, fn_args in variants:
                    row = {**base, "impl": impl}
                    try:
                        seconds = timed(fn, *fn_args)
                        row.update(us=round(1e6 * seconds, 2), over_bound=round(seconds * HBM / nbytes, 2),
                                   gbps=round(nbytes / seconds / 1e9, 1))
                    except Exception as e:  # noqa: BLE001 - a refused variant is a finding
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    results.append(row)
                    print(json.dumps(row), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"device_kind": jax.devices()[0].device_kind,
                                                    "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
