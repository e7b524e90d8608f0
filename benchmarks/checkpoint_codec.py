"""A checkpoint's arrays written with orbax's zstd compression (its default) and without, side by side in one
process: the bytes on disk, the save's seconds and the restore's, onto the host and onto the default devices;
with `--chunk-mib`, compressed again in chunks of at most that many MiB (orbax's SaveArgs.chunk_byte_size:
otherwise an array of one device is one chunk, read and decompressed on one thread).
The arrays are weights-like, normal(0, 0.02) in bfloat16 (an initialised model's; a trained one's spread
differently but as dense in their mantissas), laid out as `moe-1b`'s stacked parameters are in a few large
arrays.

    python benchmarks/checkpoint_codec.py --gib 1 --repeats 2 --json codec.json
    python benchmarks/checkpoint_codec.py --gib 2 --arrays 4 --chunk-mib 16 64

Each restore reads files written by this process, so the page cache holds them (as for a server restarted on
the host that wrote or just read the checkpoint); the figures are the read path's CPU work, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="the arrays' total size")
    p.add_argument("--arrays", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunk-mib", type=float, nargs="*", default=[], help="also zstd in chunks of this size")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    rows_per_array = int(args.gib * 2**30 / 2 / args.arrays / 2048)
    keys = jax.random.split(jax.random.key(0), args.arrays)
    tree = {f"w{i}": (0.02 * jax.random.normal(k, (rows_per_array, 2048), jnp.float32)).astype(jnp.bfloat16)
            for i, k in enumerate(keys)}
    jax.block_until_ready(tree)
    nbytes = sum(a.nbytes for a in tree.values())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    host_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for compressed, chunk in [(True, None), (False, None), *((True, c) for c in args.chunk_mib)]:
            path = Path(work) / (f"{'zstd' if compressed else 'raw'}-{chunk}")
            handler = ocp.PyTreeCheckpointHandler(use_compression=compressed)
            save_args = jax.tree.map(lambda _, c=chunk: ocp.SaveArgs(
                chunk_byte_size=int(c * 2**20) if c else None), tree)
            with ocp.Checkpointer(handler) as ckpt:
                started = time.perf_counter()
                ckpt.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
                saved = time.perf_counter() - started
                row = {"compression": "zstd" if compressed else "none", "chunk_mib": chunk, "array_bytes": nbytes,
                       "file_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                       "save_s": round(saved, 3), "host_s": [], "devices_s": []}
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    ckpt.restore(path, args=ocp.args.PyTreeRestore(item=tree, restore_args=host_args))
                    row["host_s"].append(round(time.perf_counter() - started, 3))
                    started = time.perf_counter()
                    restored = ckpt.restore(path, args=ocp.args.PyTreeRestore(
                        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
                    jax.block_until_ready(restored)
                    row["devices_s"].append(round(time.perf_counter() - started, 3))
                    del restored
            row["host_gb_s"] = round(nbytes / min(row["host_s"]) / 1e9, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    zstd, raw = rows[:2]
    for row in rows[2:]:
        print(f"zstd in chunks of {row['chunk_mib']} MiB: restore onto the host "
              f"{min(zstd['host_s']) / min(row['host_s']):.2f}x as fast as whole, onto the devices "
              f"{min(zstd['devices_s']) / min(row['devices_s']):.2f}x; save {zstd['save_s'] / row['save_s']:.2f}x")
    ratio = lambda key: min(zstd[key]) / min(raw[key])  # noqa: E731 - the best of each, zstd's over none's
    print(f"without compression: restore onto the host {ratio('host_s'):.2f}x as fast, onto the devices "
          f"{ratio('devices_s'):.2f}x; files {raw['file_bytes'] / zstd['file_bytes']:.2f}x as large; save "
          f"{zstd['save_s'] / raw['save_s']:.2f}x as fast ({jax.devices()[0].platform}, {nbytes / 2**30:.2f} GiB)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
