"""How the backward layer scan writes the stacked expert weights' gradients, ahead of time and on a chip.

    /tmp/aotvenv/bin/python benchmarks/stack_grads.py --aot [--config moe-1b] [--set KEY=VALUE ...]
    python benchmarks/stack_grads.py            # on a TPU: the weight-gradient matmul alone and as a scan's ys

The layers' parameters are the layer scan's xs (trainer/model.py `_run_stack`), so their gradients are the
transposed scan's ys: each step writes its layer's gradient into a [layers, ...] buffer with a
dynamic-update-slice. moe-1b's chip profile (benchmarks/train_levers.py --profile) lists three such fusions
on the [6, 16, 1024, 2816] expert stacks at 1.46-1.56 ms a run, 6 runs a step (28 ms of 378): about what a
copy of the whole 528 MiB stack would take, and about what the layer's weight-gradient matmul takes
(2 x 16 experts x 2,560 slots x 1,024 x 2,816 = 236 GFLOP, 1.2 ms at the chip's 197 TFLOP/s).

`--aot` compiles the train step for one v5e chip (v5e:1x1, through libtpu on this machine's CPU) and, for each
dynamic-update-slice fusion whose result is an expert stack, says what it fuses (a convolution: the matmul
producing the update), whether the stack it updates is the loop's own buffer (a get-tuple-element of the while
body's parameter: updated in place), and counts the copies of stack-shaped arrays and the zero-filled buffers
the scans' ys start from (JAX's scan allocates them with `lax.empty2`, a broadcast of zero).

On a chip it times, with the device profiler, the weight-gradient matmul of one layer alone and the same
matmul as the ys of a 6-step scan (written into the stack as the train step writes it).

Measured (jax 0.10.2, libtpu 0.0.42, moe-1b as written):
- AOT, v5e:1x1: the three fusions on the expert stacks each hold the gradient's convolution and update the
  loop's own buffer; no copy of a stack-shaped array anywhere in the program; the zero-filled ys buffers total
  1.81 GiB (1.55 of it the three 528 MiB expert stacks); temporaries 6.76 GiB, as the chip's profile reported.
- one v5e chip (the same matmuls through the device profiler): the matmul alone 1.46 ms (162 TFLOP/s); as the
  scan's ys 8.16 ms for 6 steps (1.36 ms a step: the write into the stack, in place, costs nothing); the zero
  fill of one 528 MiB stack 0.77 ms, once a call. (The scan here also copies each step's slice of x to the
  matmul's layout, 0.75 ms: this benchmark's inputs, not the train step's.) So the train step's 28 ms are the
  three weight-gradient matmuls of each MoE layer, not copies; what the stacking costs is the zero fill of the
  ys buffers, 1.81 GiB, about 2.7 ms a step at the 0.77 ms a 528 MiB stack measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.aot_topology import DTYPE_BYTES, split_computations  # noqa: E402

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*)$")
CALLS = re.compile(r"\bcalls=%([\w.\-]+)")


def _instructions(lines: list[str]):
    """(name, dtype, dims, opcode, the rest of the line) of each instruction line."""
    for line in lines:
        if (m := INSTRUCTION.match(line)) is not None:
            dims = tuple(int(d) for d in m.group(3).split(",") if d)
            yield m.group(1), m.group(2), dims, m.group(4), m.group(5)


def stack_writes(hlo: str, weights: set[tuple[int, ...]]) -> dict:
    """The dynamic-update-slice fusions on stacks of the weights' shapes ([layers, *shape] for a shape in
    `weights`), the copies of such stacks, and the zero-filled buffers (broadcasts of a constant, over 1 MiB)
    in the entry computation."""
    comps = split_computations(hlo)
    fused_ops = {name: {op for *_, op, _ in _instructions(lines)} for name, lines in comps.items()}
    writes, copies = [], []
    for comp, lines in comps.items():
        defined = {name: (op, rest) for name, _, _, op, rest in _instructions(lines)}
        for name, dtype, dims, op, rest in _instructions(lines):
            if dims[1:] not in weights:
                continue
            if op == "copy":
                copies.append(f"{dtype}{list(dims)} %{name} in {comp}")
            if op != "fusion" or "dynamic-update-slice" not in name or (callee := CALLS.search(rest)) is None:
                continue
            target = rest.split(",")[0].strip().lstrip("%")
            source = defined.get(target, ("?", ""))
            writes.append({"fusion": name, "shape": f"{dtype}{list(dims)}", "computation": comp,
                           "updates": target, "in_place": source[0] == "get-tuple-element",
                           "fuses_matmul": bool(fused_ops.get("%" + callee.group(1), set()) & {"convolution", "dot"})})
    zeros = 0
    for _, dtype, dims, op, rest in _instructions(comps.get("ENTRY", [])):
        size = DTYPE_BYTES.get(dtype, 0) * _product(dims)
        if op == "broadcast" and rest.startswith("%constant") and size > 2**20:
            zeros += size
    return {"writes": writes, "stack_copies": copies, "zero_fill_gib": round(zeros / 2**30, 3)}


def _product(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def aot(config: str, overrides: list[str]) -> dict:
    """The train step compiled for one v5e chip: its stack writes and XLA's memory."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from trainer import sharding
    from trainer.config import load_config
    from trainer.step import build_trainer

    cfg = load_config(config, overrides)
    devices = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu",
                                           chips_per_host_bounds=(1, 1, 1)).devices
    trainer = build_trainer(cfg, sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, devices), 100)
    batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    compiled = trainer.step_fn.lower(trainer.abstract_state, batch).compile()
    memory = compiled.memory_analysis()
    e, d, f = cfg.moe.num_experts, cfg.model.d_model, cfg.moe.d_ff
    return {**stack_writes(compiled.as_text(), {(e, d, f), (e, f, d)}),
            "temp_gib": round(memory.temp_size_in_bytes / 2**30, 3)}


def on_chip(config: str, overrides: list[str], calls: int = 5) -> dict:
    """The device time of one MoE layer's w_in gradient matmul alone, and as the ys of a scan over the MoE
    layers (the train step's shapes: experts x capacity slots x d_model x the expert's d_ff)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.profile_ops import op_table
    from trainer.config import load_config
    from trainer.moe.config import expert_capacity

    cfg = load_config(config, overrides)
    m, moe = cfg.model, cfg.moe
    layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    slots = expert_capacity(tokens, moe.top_k, moe.capacity_factor, moe.num_experts, moe.min_capacity)
    e, d, f = moe.num_experts, m.d_model, moe.d_ff
    keys = jax.random.split(jax.random.key(0), 3)
    x_LxExCxD = jax.random.normal(keys[0], (layers, e, slots, d), jnp.bfloat16)
    g_LxExCxF = jax.random.normal(keys[1], (layers, e, slots, f), jnp.bfloat16)
    kept_LxExC = jax.random.bernoulli(keys[2], 0.8, (layers, e, slots))

    def grad(x_ExCxD, kept_ExC, g_ExCxF):  # the dropped slots' rows are zero, as the capacity path's are
        return jnp.einsum("ecd,ecf->edf", jnp.where(kept_ExC[..., None], x_ExCxD, 0), g_ExCxF)

    def scanned(*xs):
        return jax.lax.scan(lambda c, layer: (c, grad(*layer)), 0, xs, reverse=True)[1]

    out = {"layers": layers, "gflop": round(2 * e * slots * d * f / 1e9, 1)}
    for name, fn, args in (("alone", grad, (x_LxExCxD[0], kept_LxExC[0], g_LxExCxF[0])),
                           ("scan_ys", scanned, (x_LxExCxD, kept_LxExC, g_LxExCxF))):
        step = jax.jit(fn)
        jax.block_until_ready(step(*args))
        table = op_table(lambda step=step, args=args: jax.block_until_ready(step(*args)), calls, top=6)
        out[name] = [{k: op[k] for k in ("ms", "count")} | {"op": op["hlo"][:140]} for op in table["ops"]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="moe-1b")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--aot", action="store_true", help="compile for v5e:1x1 through libtpu, run nothing")
    args = parser.parse_args()
    if args.aot:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host backend; the TPU compiler comes from libtpu
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        result = aot(args.config, ["model.attention=splash", *args.overrides])
    else:
        result = on_chip(args.config, args.overrides)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
