"""The serving steps' grouped matmul on the chip, one expert weight of moe-1b's shape read from its whole stack
of layers (trainer/moe/gmm.py stacked_matmul: tokamax's Mosaic ragged dot over [layers * experts] groups), for
each weight format a kernel could take and each tile, side by side in one process:

    python benchmarks/gmm_formats.py [--json PATH] [--formats bf16,int8,int4,int8-w8a8]

Rows: a decode step's at 1 and 32 slots (2 or 64 routed rows in the dispatch layout, 136 and 192 rows).
Formats: bf16; int8 (a scale an output channel, applied after); int8-w8a8 (the same weights, the rows quantized
to int8 as well: the MXU's int8 product); int4 (a bf16 scale a group of 128 inputs);
and the candidates for MXFP4's blocks of 32 (FP4 values the v5e's matrix unit refuses): int8 holding twice
each FP4 value (exact), float8_e4m3fn (exact for FP4's values), each with a bf16 scale a block of 32; and the
fallback the engine takes now, the layer read widened (these three only when --formats names them). Each
figure is a call's device time (its ops in jax's profiler, 20 calls) against the bound of the bytes the routed
experts' tiles hold (819 GB/s); a format the kernel refuses is reported with its error. Tiles: TILES.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS, EXPERTS, K, N = 6, 16, 1024, 2816
# (rows, columns) of the tiles timed for each row count: the engine's rows in one tile (stacked_tiling's choice
# at 136 rows) or 64-row tiles, each with 512, 1,024 or 1,408 (half of N) columns
TILES = {136: [(136, 512), (136, 1024), (136, 1408)], 192: [(192, 512), (64, 512), (64, 1024), (192, 1408)]}
HBM = 819e9


def timed(fn, *args) -> float:
    """Seconds a call of `fn` keeps the device busy: the sum of its device ops in jax's profiler
    (benchmarks/profile_ops.py), so that a kernel of microseconds is not hidden by the host's dispatch of
    it (timed from the host, every call here took ~130 us on the chip whatever its kernel did); the wall
    time a call where the backend shows no device ops (CPU)."""
    import jax
    from profile_ops import op_table

    jax.block_until_ready(fn(*args))
    table = op_table(lambda: jax.block_until_ready(fn(*args)), calls=20, top=3)
    if table["ops"]:
        return table["device_ms_per_call"] / 1e3
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t) / 20)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path")
    p.add_argument("--formats", default="bf16,int8,int4,int8-w8a8",
                   help="comma-separated, of bf16, int8, int4, int8-w8a8, mxfp4-as-int8x2, mxfp4-as-fp8, "
                        "mxfp4-widened-layer")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    import qwix
    import tokamax

    from trainer.moe import gmm

    gmm.tokamax_without_argv()
    key = jax.random.key(0)
    w = (jax.random.normal(key, (LAYERS * EXPERTS, K, N), jnp.float32) * 0.05).astype(jnp.bfloat16)
    blocks = lambda b: w.reshape(LAYERS * EXPERTS, K // b, b, N)  # noqa: E731
    amax = lambda b: jnp.max(jnp.abs(blocks(b).astype(jnp.float32)), axis=2)  # noqa: E731
    s8 = amax(K)[:, 0] / 127
    s4 = amax(128) / 7
    s32 = amax(32) / 6  # FP4's largest value: 6
    fp4 = (blocks(32) / s32[:, :, None]).astype(jnp.float4_e2m1fn)
    formats = {
        "bf16": (w, None, w.nbytes),
        "int8": (jnp.round(w / s8[:, None]).astype(jnp.int8), s8, w.size),
        "int4": (qwix.QArray(jnp.round(blocks(128) / s4[:, :, None]).reshape(w.shape).astype(jnp.int4),
                             s4.astype(jnp.bfloat16)), None, w.size // 2),
        # w8a8: the rows quantized to int8 too (a scale a row, outside the kernel), int8 x int8 on the MXU
        "int8-w8a8": (qwix.QArray(jnp.round(w / s8[:, None]).astype(jnp.int8), s8[:, None].astype(jnp.float32)),
                      None, w.size),
        "mxfp4-as-int8x2": (qwix.QArray((fp4.astype(jnp.float32) * 2).astype(jnp.int8).reshape(w.shape),
                                        (s32 / 2).astype(jnp.bfloat16)), None, w.size),
        "mxfp4-as-fp8": (qwix.QArray(fp4.astype(jnp.float8_e4m3fn).reshape(w.shape), s32.astype(jnp.bfloat16)),
                         None, w.size),
    }
    rows = []
    for m, routed in ((136, 2), (192, 64)):
        x = jax.random.normal(key, (m, K), jnp.bfloat16)
        sizes = jnp.zeros((LAYERS * EXPERTS,), jnp.int32).at[2 * EXPERTS:3 * EXPERTS].set(
            jnp.asarray([routed // min(routed, EXPERTS)] * min(routed, EXPERTS) + [0] * (EXPERTS - min(routed,
                                                                                                   EXPERTS))))
        touched = min(routed, EXPERTS)
        for name, (weight, scale, nbytes) in formats.items():
            if name not in args.formats.split(","):
                continue
            for tile_m, tile_n in TILES[m]:
                row = {"rows": m, "routed_rows": routed, "format": name, "tile_m": tile_m, "tile_n": tile_n}
                try:
                    tiling = (tile_m, min(K, 1024), min(N, tile_n))
                    impl = gmm.tpu_ragged_dot(*tiling) if jax.devices()[0].platform == "tpu" else "xla"
                    if name == "int8-w8a8" and impl != "xla":
                        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as mosaic

                        impl = mosaic.PallasMosaicTpuRaggedDot(qdtype=jnp.int8, config=impl.config)

                    def f(x, weight, sizes, impl=impl, scale=scale):
                        out = tokamax.ragged_dot(x, weight, sizes, preferred_element_type=jnp.float32,
                                                 implementation=[impl])
                        return out if scale is None else out * scale[2 * EXPERTS]

                    seconds = timed(jax.jit(f), x, weight, sizes)
                    bound = nbytes / (LAYERS * EXPERTS) * touched / HBM
                    row.update(us=round(1e6 * seconds, 1), bound_us=round(1e6 * bound, 1),
                               over_bound=round(seconds / bound, 2))
                except Exception as e:  # noqa: BLE001 - a refused format is a finding
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        if "mxfp4-widened-layer" not in args.formats.split(","):
            continue
        # The engine's MXFP4 fallback on a TPU: the layer read widened, then the grouped product.
        layer = jax.jit(lambda x, v, s, sizes, m=m, routed=routed: jax.lax.ragged_dot(
            x, (v.astype(jnp.bfloat16).reshape(LAYERS, EXPERTS, K // 32, 32, N)[2]
                * s.reshape(LAYERS, EXPERTS, K // 32, 1, N)[2]).reshape(EXPERTS, K, N),
            sizes[2 * EXPERTS:3 * EXPERTS].at[-1].add(m - routed), preferred_element_type=jnp.float32))
        try:
            seconds = timed(layer, x, fp4, s32.astype(jnp.bfloat16), sizes)
            rows.append({"rows": m, "routed_rows": routed, "format": "mxfp4-widened-layer",
                         "us": round(1e6 * seconds, 1)})
        except Exception as e:  # noqa: BLE001
            rows.append({"rows": m, "format": "mxfp4-widened-layer", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
