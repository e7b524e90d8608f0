"""The train step compiled ahead of time for a TPU v5e slice this machine does not have: XLA's memory per
chip and the compiled program's collectives, against the planner's figures.

    python3 -m venv /tmp/aotvenv && /tmp/aotvenv/bin/pip install -e '.[trainer]' 'libtpu==0.0.42.*'
    /tmp/aotvenv/bin/python benchmarks/aot_topology.py --json-out aot.json     # the two cases below
    /tmp/aotvenv/bin/python benchmarks/aot_topology.py -c examples/v5e-64.yaml --accelerator v5litepod-8 \\
        --mesh data=1,expert=8 --set model.num_layers=2 --set data.global_batch_size=32

libtpu (the version jax's `tpu` extra pins: 0.0.42.* for jax 0.10.2) holds the TPU compiler; with it,
`jax.experimental.topologies.get_topology_desc("v5e:8x8", "tpu")` describes a slice's chips without any
hardware, a Mesh over those devices builds the trainer as trainer/train.py's build_trainer does, and the
step lowered from abstract inputs (nothing is allocated) compiles for that slice on the host's CPU. The
devices say "tpu", so model.attention "auto" resolves to the splash kernel, which Mosaic compiles ahead of
time too (the Pallas calls are counted in the report).

Per chip: XLA's memory (arguments + outputs - donated + temporaries) against the planner's memory_per_chip,
and the collectives in the compiled HLO: how many ops of each kind over which mesh axes, how often they run
(a scanned layer's ops run once per scan step), their payload and the bytes a ring moves per chip, summed
against the planner's traffic (provision/planner/estimates.py traffic_per_chip). TPU XLA spells a
reduce-scatter as an all-reduce inside a `%all-reduce-scatter` computation: counted as a reduce-scatter.
The planner is always computed for the config that was compiled (overrides included). libtpu's warnings
about TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES (no TPU VM here) are harmless.

Measured (jax 0.10.2, libtpu 0.0.42.1, 2 CPU cores shared with other work, 2026-12-06; the splash kernel
compiled in both; the whole run 12 minutes, 6 of CPU):
- v5e-64 on v5litepod-64, data=8,expert=8, 16 layers: compiled in 400 s (204 s of CPU). XLA 10.32 GiB a
  chip (arguments 3.28, temporaries 7.04), planner 9.24: 0.895x. All-to-all over expert 3.28 GiB out of a
  chip, the planner's figure exactly. Over data XLA gathers each layer weight twice a step in bf16 (the
  forward scan, and once for the backward scan's recompute and its transposed matmuls together: 7.6 GiB)
  and reduce-scatters the gradients in bf16 (3.8 GiB); the planner counted three gathers under remat and
  float32 gradients: 19.15 GiB against XLA's 12.21 for everything but the all-to-all; now that it counts
  two gathers, compute-dtype gradients and the expert axis's all-reduce (collective_bytes): 11.79 (0.97x).
- the same family on v5litepod-8, data=1,expert=8, 2 layers, 32 rows (4 a chip, as above): XLA 7.25 GiB,
  planner 10.55: 1.455x: the planner's activations are 4.43, 3.09 of them the head's three float32
  [tokens, vocab] arrays, against XLA's 2.66 of temporaries in all; compiled in 311 s (154 s of CPU).
  All-to-all 0.41 GiB both; XLA also all-reduces over `expert` the gradients of every weight the expert
  axis does not split (the batch is split over it: 0.90 GiB), which collective_bytes, looking at the data
  axis alone, counted as 0; now 1.37 (1.52x: it counts float32 gradients where XLA reduced most in bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import time

GIB = 2**30
LIBTPU_HINT = "pip install 'libtpu==0.0.42.*' (the version jax 0.10.2's [tpu] extra pins) in a separate venv"
# The two cases: the example's own slice and mesh, and one v5e host (8 chips) of the same model
# family cut to one dense and one MoE layer and the example's 4 rows per chip.
CASES = (
    ("examples/v5e-64.yaml", None, None, ()),
    ("examples/v5e-64.yaml", "v5litepod-8", "data=1,expert=8", ("model.num_layers=2", "data.global_batch_size=32")),
)
KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


# ----------------------------------------------------------------------------- the HLO's collectives

COMPUTATION = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")
COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(all-to-all|all-gather|all-reduce|reduce-scatter|"
                        r"collective-permute|ragged-all-to-all)(-start)?\(")
CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=(%[\w.\-]+)")
CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]  # the mesh axes its groups span
    dtype: str  # of its buffers ("mixed" where a combined op holds several)
    group: int  # devices in each group
    payload: int  # bytes per chip: the whole buffer reduced, gathered (the result) or exchanged
    runs: int  # times one step executes it (scan steps included)

    @property
    def wire(self) -> float:
        """Bytes a ring moves out of each chip for one run."""
        n = self.group
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind, (n - 1) / n)
        return self.payload * factor


def split_computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines; the entry computation is also under "ENTRY"."""
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if (m := COMPUTATION.match(line)) is not None:
            current = found.setdefault(m.group(1), [])
            if line.startswith("ENTRY"):
                found["ENTRY"] = current
        elif line.rstrip() == "}":  # a kernel's backend_config spans lines: "}}, ..." ends none
            current = None
        elif current is not None:
            current.append(line)
    return found


def trip_count(condition: list[str]) -> int:
    """A scan's loop condition compares its counter (from 0) with a constant: that constant."""
    root = next((line for line in condition if "ROOT" in line and "direction=LT" in line), None)
    constants = {m.group(1): int(m.group(2)) for line in condition
                 if (m := re.match(r"\s*(%[\w.\-]+) = s32\[\]\S* constant\((\d+)\)", line))}
    if root is not None:
        for name, value in constants.items():
            if name + ")" in root or name + "," in root:
                return value
    return 1


def run_counts(computations: dict[str, list[str]]) -> dict[str, int]:
    """How many times one execution of the entry runs each computation (a while body: its trip count)."""
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, lines in computations.items():
        if name == "ENTRY":
            continue
        for line in lines:
            known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for attr, callee in CALLEE.findall(line):
                times = 1
                if attr == "body":
                    cond = re.search(r"condition=(%[\w.\-]+)", line)
                    times = int(known.group(1)) if known else trip_count(computations.get(cond.group(1), []))
                callers.setdefault(callee, []).append((name, times))
            for group in CALLEES.findall(line):
                for callee in re.findall(r"%[\w.\-]+", group):
                    callers.setdefault(callee, []).append((name, 1))
    entry = next(n for n, lines in computations.items() if n != "ENTRY" and lines is computations.get("ENTRY"))
    counts: dict[str, int] = {}

    def count(name: str) -> int:
        if name not in counts:
            counts[name] = 1 if name == entry else sum(count(c) * t for c, t in callers.get(name, ()))
        return counts[name]

    return {name: count(name) for name in computations if name != "ENTRY"}


def replica_groups(line: str, devices: int) -> list[list[int]]:
    """The device groups of a collective, in any of HLO's spellings: explicit lists, an iota
    ([groups,size]<=[dims]T(perm)) or a mesh (mesh['axis_0'=a,...], device_ids=(...) {'axis_i',...})."""
    if (m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", line)):
        sizes = [int(n) for n in re.findall(r"=(\d+)", m.group(1))]
        names = re.findall(r"'(\w+)'=", m.group(1))
        ids = iota(m.group(2)) if m.group(2) else list(range(devices))
        grid = _np().asarray(ids).reshape(sizes)
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
        rest = [i for i in range(len(sizes)) if i not in grouped]
        size = int(_np().prod([sizes[i] for i in grouped]))
        return grid.transpose(rest + grouped).reshape(-1, size).tolist()
    if (m := re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)):
        shape = [int(n) for n in re.match(r"\[([\d,]+)\]", m.group(1)).group(1).split(",")]
        return _np().asarray(iota(m.group(1).split("<=")[1])).reshape(shape).tolist()
    if (m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)) and m.group(1):
        return [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    return [list(range(devices))]


def iota(text: str) -> list[int]:
    """[dims]T(perm): 0..N-1 laid out as dims, transposed by perm, flattened."""
    np = _np()
    dims = [int(n) for n in re.match(r"\[([\d,]+)\]", text).group(1).split(",")]
    perm = re.search(r"T\(([\d,]+)\)", text)
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return (ids.transpose([int(p) for p in perm.group(1).split(",")]) if perm else ids).reshape(-1).tolist()


def axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of size > 1) whose devices the groups span; ("?",) for groups no set of axes makes."""
    np = _np()
    names = list(mesh_shape)
    ids = np.arange(int(np.prod(list(mesh_shape.values())))).reshape(list(mesh_shape.values()))
    want = frozenset(frozenset(g) for g in groups)
    for r in range(len(names) + 1):
        for axes in itertools.combinations(range(len(names)), r):
            rest = [i for i in range(len(names)) if i not in axes]
            size = int(np.prod([mesh_shape[names[i]] for i in axes]))
            rows = ids.transpose(rest + list(axes)).reshape(-1, size)
            if frozenset(frozenset(int(i) for i in row) for row in rows) == want:
                return tuple(names[i] for i in axes if mesh_shape[names[i]] > 1)
    return ("?",)


def shape_bytes(text: str) -> list[tuple[str, int]]:
    return [(t, int(_np().prod([int(d) for d in dims.split(",") if d] or [1])) * DTYPE_BYTES.get(t, 4))
            for t, dims in SHAPE.findall(text)]


def collectives(hlo: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective op of a compiled module, with how often one step runs it."""
    computations = split_computations(hlo)
    runs = run_counts(computations)
    devices = int(_np().prod(list(mesh_shape.values())))
    found = []
    for name, lines in computations.items():
        if name == "ENTRY" or is_async_continuation(name, lines):
            continue
        for line in lines:
            if (m := COLLECTIVE.match(line)) is None:
                continue
            sizes = shape_bytes(m.group(1))
            if m.group(3):  # an async start's result holds its operands, then its results
                sizes = sizes[len(sizes) // 2:]
            kind = m.group(2).replace("ragged-", "")
            if kind == "all-reduce" and name.startswith("%all-reduce-scatter"):
                kind = "reduce-scatter"  # its payload is the whole buffer reduced, as a reduce-scatter's input
            groups = replica_groups(line, devices)
            if kind == "reduce-scatter" and m.group(2) == "reduce-scatter":  # its result is one chip's shard
                sizes = [(t, s * len(groups[0])) for t, s in sizes]
            dtypes = {t for t, _ in sizes}
            found.append(Collective(kind, axes_of(groups, mesh_shape), dtypes.pop() if len(dtypes) == 1 else "mixed",
                                    len(groups[0]), sum(s for _, s in sizes), runs[name]))
    return found


def is_async_continuation(name: str, lines: list[str]) -> bool:
    """TPU XLA writes an asynchronous collective three times, with one channel_id: in the fusion that starts
    it (ROOT an AsyncCollectiveStart custom call), in the fusions that compute while it is in flight
    (async_collective_fusion) and in the one that waits for it (AsyncCollectiveDone). The start counts."""
    root = next((line for line in lines if line.lstrip().startswith("ROOT")), "")
    return name.startswith("%async_collective_fusion") or 'custom_call_target="AsyncCollectiveDone"' in root


def _np():
    import numpy

    return numpy


# ----------------------------------------------------------------------------- one case


@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    accelerator: str | None
    mesh: str | None
    overrides: tuple[str, ...]


def model_and_target(case: Case):
    """(trainer config, accelerator, planner mesh): as `moe-tpu plan` reads the run config, with the
    case's accelerator, mesh and extra overrides."""
    from provision import planner
    from provision.config import load_config as load_run_config
    from provision.planner.plan import target_of
    from trainer.config import load_config

    run = load_run_config(case.config)
    overrides = [f for f in run.trainer.set_flags() if f != "--set"] + list(case.overrides)
    cfg = load_config(run.trainer.config, overrides)
    target = target_of(run, case.accelerator)
    mesh = planner.target_mesh(case.mesh or run.trainer.mesh, target.chips, target.slices)
    return cfg, target.accelerator, mesh


def compile_case(case: Case, hlo_out: str | None) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from provision import planner
    from trainer import sharding
    from trainer.params import param_inventory
    from trainer.train import build_trainer

    cfg, acc, pmesh = model_and_target(case)
    topology = f"{acc.generation}:{acc.topology}"
    # a one-chip host (v5litepod-1) is its own host's bounds; the default bounds are a 4-chip host's
    bounds = {"chips_per_host_bounds": (1, 1, 1)} if acc.chips == 1 else {}
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu", **bounds).devices
    shape = {"data": pmesh.data, "expert": pmesh.expert, "model": pmesh.model}
    started = time.perf_counter()
    tr = build_trainer(cfg, sharding.make_mesh(shape, devices), cfg.train.steps)
    batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), jnp.int32,
                                 sharding=tr.batch_sharding)
    lowered = tr.step_fn.lower(tr.abstract_state, batch)
    seconds = {"lower_s": time.perf_counter() - started}
    started, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    seconds.update(compile_s=time.perf_counter() - started, compile_cpu_s=time.process_time() - cpu)
    hlo = compiled.as_text()
    if hlo_out:
        os.makedirs(hlo_out, exist_ok=True)
        with open(os.path.join(hlo_out, f"{cfg.name}-{acc.name}-{pmesh.text()}.hlo"), "w") as f:
            f.write(hlo)
    stats = compiled.memory_analysis()
    params = param_inventory(cfg)
    memory = planner.memory_per_chip(params, cfg, pmesh, acc)
    traffic = planner.traffic_per_chip(params, cfg, pmesh, memory)
    return report(case, cfg, acc, pmesh, topology, stats, memory, traffic, collectives(hlo, shape), hlo,
                  seconds)


def report(case, cfg, acc, pmesh, topology, stats, memory, traffic, found, hlo, seconds) -> dict:
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)
    groups: dict[tuple[str, tuple[str, ...], str], list[Collective]] = {}
    for c in found:
        groups.setdefault((c.kind, c.axes, c.dtype), []).append(c)
    rows = [{"kind": kind, "axes": ",".join(axes) or "-", "dtype": dtype, "ops": len(cs),
             "runs": sum(c.runs for c in cs),
             "payload_gib": sum(c.payload * c.runs for c in cs) / GIB,
             "wire_gib": sum(c.wire * c.runs for c in cs) / GIB}
            for (kind, axes, dtype), cs in sorted(groups.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1:]))]
    a2a = sum(r["wire_gib"] for r in rows if r["kind"] == "all-to-all")
    over_model = sum(r["wire_gib"] for r in rows if r["kind"] == "all-reduce" and r["axes"] == "model")
    return {
        "config": cfg.name, "source": case.config, "accelerator": acc.name, "topology": topology,
        "mesh": pmesh.text(), "overrides": list(case.overrides), "layers": cfg.model.num_layers,
        "attention": cfg.model.attention, "pallas_calls": hlo.count('custom_call_target="tpu_custom_call"'),
        **{name: round(value, 1) for name, value in seconds.items()},
        "xla_gib": {"arguments": stats.argument_size_in_bytes / GIB, "outputs": stats.output_size_in_bytes / GIB,
                    "donated": stats.alias_size_in_bytes / GIB, "temporaries": stats.temp_size_in_bytes / GIB,
                    "peak": peak / GIB},
        "planner_gib": {"params": memory.params / GIB, "grads": memory.grads / GIB,
                        "optimizer": memory.optimizer / GIB, "activations": memory.activations / GIB,
                        "total": memory.total / GIB},
        "planner_over_xla": memory.total / peak,
        "collectives": rows,
        "ici_gib": {"xla_all_to_all": a2a, "planner_all_to_all": traffic.all_to_all / GIB,
                    "xla_tensor_parallel": over_model, "planner_tensor_parallel": traffic.tensor_parallel / GIB,
                    "xla_other": sum(r["wire_gib"] for r in rows) - a2a - over_model,
                    "planner_other": (traffic.ici - traffic.all_to_all - traffic.tensor_parallel) / GIB,
                    "xla_total": sum(r["wire_gib"] for r in rows), "planner_total": traffic.ici / GIB},
    }


# ----------------------------------------------------------------------------- printing


def table(r: dict) -> str:
    x, p = r["xla_gib"], r["planner_gib"]
    lines = [f"{r['config']} on {r['accelerator']} ({r['topology']}), mesh {r['mesh']}, {r['layers']} layers"
             + (f", --set {' '.join(r['overrides'])}" if r["overrides"] else ""),
             f"  attention {r['attention']}: {r['pallas_calls']} Pallas calls in the program; lowered in "
             f"{r['lower_s']} s, compiled for the TPU in {r['compile_s']} s ({r['compile_cpu_s']} s of CPU)",
             "  memory per chip (GiB)      XLA   planner",
             f"    parameters                       {p['params']:7.2f}",
             f"    gradients + optimizer            {p['grads'] + p['optimizer']:7.2f}",
             f"    arguments            {x['arguments']:7.2f}",
             f"    outputs - donated    {x['outputs'] - x['donated']:7.2f}",
             f"    temporaries          {x['temporaries']:7.2f}   {p['activations']:7.2f}  (planner: activations)",
             f"    peak / total         {x['peak']:7.2f}   {p['total']:7.2f}  planner/XLA {r['planner_over_xla']:.3f}",
             "  collectives per step              ops   runs   payload GiB   ring GiB out of a chip",
             *(f"    {c['kind']:<15} {c['axes']:<12} {c['dtype']:<5} {c['ops']:>3} {c['runs']:>6}"
               f" {c['payload_gib']:>11.3f} {c['wire_gib']:>10.3f}" for c in r["collectives"]),
             "  ICI per chip (GiB)         XLA   planner"]
    i = r["ici_gib"]
    for what in ("all_to_all", "tensor_parallel", "other", "total"):
        lines.append(f"    {what.replace('_', '-'):<18} {i['xla_' + what]:7.2f}   {i['planner_' + what]:7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", help="a run config (its trainer section, slice and mesh) [the two cases]")
    parser.add_argument("--accelerator", help="a v5e slice type instead of the config's")
    parser.add_argument("--mesh", help="the trainer's mesh instead of the config's trainer.mesh")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--attention", choices=("auto", "xla", "splash"), help="model.attention for every case")
    parser.add_argument("--json-out", help="write the results here as JSON")
    parser.add_argument("--hlo-out", help="write each compiled program's HLO text into this directory")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host backend; the TPU compiler comes from libtpu
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU VM metadata server to ask
    try:
        import libtpu  # noqa: F401
    except ImportError:
        sys.exit(f"the TPU compiler is not installed: {LIBTPU_HINT}")
    extra = tuple(args.overrides) + ((f"model.attention={args.attention}",) if args.attention else ())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    cases = ([Case(args.config, args.accelerator, args.mesh, extra)] if args.config else
             [Case(os.path.join(root, c), a, m, o + extra) for c, a, m, o in CASES])
    results = []
    for case in cases:
        results.append(compile_case(case, args.hlo_out))
        print(table(results[-1]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
