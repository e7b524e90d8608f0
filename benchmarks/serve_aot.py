"""The engine's decode program compiled ahead of time for one TPU v5e chip, on this CPU: XLA's scratch, and the
large copies the compiled program makes (a weight or cache slice written out before a kernel reads it).

    /tmp/aotvenv/bin/python benchmarks/serve_aot.py                       # moe-1b, bf16/int8/int4, 8 slots
    /tmp/aotvenv/bin/python benchmarks/serve_aot.py --formats int8 --rows 1,8,32 --json out.json

The venv is benchmarks/aot_topology.py's (jax with libtpu, which holds the TPU compiler). The serving model is
built on a one-chip v5e topology (jax.experimental.topologies), its weights and cache as abstract arrays
(bf16, or int8/int4 as trainer/serve/quant.py and quant4.py lay them out, int4 in jnp.int4 as on a TPU), and
ModelRunner's decode step lowered and compiled for that chip. tokamax's Mosaic grouped matmul asks the
default device for its TPU generation and refuses a CPU device; here, and only here, it is told the chip is
a v5e (there is none to ask).

Measured 2026-12-06 (jax 0.10.2, libtpu 0.0.42.1), moe-1b, 8 slots x 1,024 positions: before the experts were
read from the whole stack (trainer/moe/stacked.py) the program wrote out each MoE layer's three expert weights
(bf16[16, 1024, 2816], 92 MB each; at int8 and int4 widened to bf16) before the grouped matmul, at 1 slot as at
8; scratch 90.1 MiB (bf16), 6.1 (int8), 178.6 (int4). After, the kernels take the stacks by bitcast: scratch
6.8, 6.9 and 132.8 MiB (tokamax broadcasts int4's scales over the TPU's sublanes each call). docs/performance.md
has the table. Since int4 stacks have their own kernel (trainer/moe/gmm.py int4_grouped_matmul, 2026-12-06) the
loop no longer writes tokamax's repeated scales (bf16[96, 64, 2816] twice and bf16[96, 176, 1024], 34.6 MB
each, in each of its 6 steps): at 1 slot 12.8 MB written against 112.3, scratch 2.53 MiB against 2.65; at 8
slots 136.6 MB against 236.1, scratch 6.68 against 7.59.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

BIG = re.compile(r"= (bf16|s8|s4|f32)\[((?:\d+,){2,3}\d+)\]\{[^}]*\}\s+(copy|fusion)\(")
DTYPE_BITS = {"bf16": 16, "s8": 8, "s4": 4, "f32": 32}


FUSED = re.compile(r" fusion\(.*?calls=(%[\w.\-]+)")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")


def large_copies(hlo: str, floor_mb: float = 1.0) -> list[tuple[str, float]]:
    """Arrays of rank 3 or more that a copy or a loop fusion writes out, in HBM or in the chip's other memory
    space (S(1)), each once as the program text holds it (an op of the layer loop runs once a layer); the ops
    inside a fusion's own computation, which write nothing out, are left out. (text, megabytes) each."""
    fused = set(FUSED.findall(hlo))
    out, inside = [], None
    for line in hlo.splitlines():
        head = COMPUTATION.match(line)
        if head:
            inside = head.group(1)
            continue
        m = BIG.search(line)
        if not m or inside in fused or "kind=kOutput" in line:
            continue
        size = 1
        for d in m.group(2).split(","):
            size *= int(d)
        mb = size * DTYPE_BITS[m.group(1)] / 8 / 1e6
        if mb >= floor_mb:
            space = " (memory space 1)" if "S(1)" in line.split("=", 1)[1][:160] else ""
            out.append((f"{m.group(1)}[{m.group(2)}] {m.group(3)} {mb:.1f} MB{space}", mb))
    return out


def chip_is_v5e() -> None:
    """tokamax's kernel asks the default device for its TPU generation: here there is no TPU, so say v5e."""
    from jax._src.pallas.mosaic import tpu_info
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    pallas_mosaic_tpu.PallasMosaicTpuRaggedDot.supported_on = lambda self, device: True


def abstract_weights(model, fmt: str, sharding):
    import jax
    import jax.numpy as jnp

    from trainer.serve import quant, quant4

    def place(tree):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)

    w = model.abstract()
    if fmt == "int8":
        w["params"] = {n: jax.eval_shape(lambda p, n=n: quant.quantize_array(n, p), s) for n, s in w["params"].items()}
    elif fmt == "int4":
        def int4(name, s):
            axis = quant4.group_axis(name, s.shape)
            if axis is None:
                return s
            scale = quant4.layout(s.shape, axis)[1]  # int4's groups along the input axis, as the engine cuts them
            return quant4.Int4Native(jax.ShapeDtypeStruct(s.shape, jnp.int4),
                                     jax.ShapeDtypeStruct(scale, jnp.float32), axis - len(s.shape), s.dtype.name)
        w["params"] = {n: int4(n, s) for n, s in w["params"].items()}
    return place(w)


def compile_decode(cfg, fmt: str, rows: int, max_len: int, hlo_dir: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from trainer import sharding
    from trainer.serve.latentcache import CacheLayout
    from trainer.serve.runner import Steps
    from trainer.serve.structured import words
    from trainer.serve.weights import build_serving_model

    devices = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu",
                                           chips_per_host_bounds=(1, 1, 1)).devices
    mesh = sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, devices)
    model = build_serving_model(cfg, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    weights = abstract_weights(model, fmt, rep)
    layout = CacheLayout.of(model.cfg.model)
    cache = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep),
                         jax.eval_shape(lambda: layout.empty(rows, max_len, jnp.bfloat16)))

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    vec = (rows,)  # as many slots as rows
    inputs = (spec((4, rows), jnp.int32),  # the step's tokens, positions, followers, want (ModelRunner.step_inputs)
              (spec(vec, jnp.float32), spec(vec, jnp.int32), spec(vec, jnp.float32), spec(vec, jnp.int32)),
              spec((rows, words(cfg.model.vocab_size)), jnp.int32), spec(vec, jnp.int32))  # masks, last tokens
    steps = Steps(model, max_len)

    def decode(w, c, *args):
        return steps.decode(w, c, *args, span=max_len)

    started = time.perf_counter()
    compiled = jax.jit(decode, donate_argnums=(1,), out_shardings=(rep, rep)).lower(weights, cache, *inputs).compile()
    hlo = compiled.as_text()
    if hlo_dir:  # the compiled program, to read what XLA made of it
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"decode-{fmt}-{rows}.hlo.txt"), "w") as f:
            f.write(hlo)
    copies = large_copies(hlo)
    return {"weights": fmt, "rows": rows, "max_len": max_len, "compile_s": round(time.perf_counter() - started, 1),
            "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
            "custom_calls": hlo.count("tpu_custom_call"), "written_mb": round(sum(mb for _, mb in copies), 1),
            "copies": [text for text, _ in copies]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="moe-1b")
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--rows", default="8", help="comma-separated decode rows (slots)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--hlo-dir", default=None, help="write each compiled program's HLO text here")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    try:
        chip_is_v5e()
    except ImportError as e:
        print(f"serve_aot: {e}: run it with a venv holding libtpu (benchmarks/aot_topology.py says how)",
              file=sys.stderr)
        return 2
    from trainer.config import load_config

    cfg = load_config(args.config, ["dtype=bfloat16", "param_dtype=bfloat16", *args.overrides])
    rows = []
    for fmt in args.formats.split(","):
        for r in (int(x) for x in args.rows.split(",")):
            rows.append(compile_decode(cfg, fmt, r, args.max_len, args.hlo_dir))
            print(json.dumps(rows[-1]), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
