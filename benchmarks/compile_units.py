"""Where the train step's compile for one TPU v5e chip goes, unit by unit, ahead of time on this CPU: the TPU
backend's own log (libtpu's `--vmodule=deepsea_compiler_backend=3`) names each unit it lowers, schedules and
register-allocates (a fusion, a sort, a custom call) on one of its threads; a unit's time runs from its
"LLO optimizing" line to its thread's last line before the next one. The units are summed by the model code
that made them (the compiled HLO's op_name and source line).

    /tmp/aotvenv/bin/python benchmarks/compile_units.py                         # moe-1b, the top 15
    /tmp/aotvenv/bin/python benchmarks/compile_units.py --set moe.capacity_factor=0 --top 30 --json-out u.json

The venv is benchmarks/aot_topology.py's (jax with libtpu, which holds the TPU compiler). Nothing is run or
allocated. Seconds are wall and the process's CPU (the compiler's threads included); the units' seconds are
summed over the backend's threads, so on a busy machine they count the neighbours too: compare shares, and
trust CPU seconds over wall.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import sys
import tempfile
import time

LOG_LINE = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d+)\s+(\d+) ([\w.]+):\d+\] (.*)$")
UNIT = re.compile(r"^\[([^\]]+)\] LLO optimizing ([\d,]+) instructions")
HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")
META = re.compile(r'(op_name|source_file)="([^"]*)"|source_line=(\d+)')


def units_from_log(lines) -> list[dict]:
    """[{"unit", "instructions", "seconds", "thread", "start"}] from libtpu's INFO log: each unit from its start
    line to its "post-bundle-packing" line on the same thread (the backend works a unit on one thread), else
    to that thread's last line before its next unit."""
    open_units: dict[str, dict] = {}
    done = []
    for line in lines:
        m = LOG_LINE.match(line)
        if not m:
            continue
        day, clock, thread, _, message = m.groups()
        t = datetime.datetime.strptime(f"2000{day} {clock}", "%Y%m%d %H:%M:%S.%f").timestamp()
        unit = UNIT.match(message)
        if unit:
            if thread in open_units:
                done.append(open_units.pop(thread))
            open_units[thread] = {"unit": unit.group(1), "instructions": int(unit.group(2).replace(",", "")),
                                  "start": t, "end": t, "thread": thread}
        elif thread in open_units:
            open_units[thread]["end"] = t
            if message.startswith("post-bundle-packing"):
                done.append(open_units.pop(thread))
    done.extend(open_units.values())
    return [{"unit": u["unit"], "instructions": u["instructions"], "seconds": u["end"] - u["start"],
             "thread": u["thread"], "start": u["start"]} for u in done]


def thread_cpu(tids) -> dict[str, float]:
    """{thread id: CPU seconds it has used}: what each of the backend's threads did rather than waited (a unit's
    log span counts both)."""
    out = {}
    for tid in sorted(tids):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread has ended
            continue
        out[tid] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    return out


def origins(hlo: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (op_name without the jit prefix, "file:line")} from the compiled HLO's metadata."""
    out = {}
    for line in hlo.splitlines():
        m = HLO_OP.match(line)
        if not m:
            continue
        fields = {}
        for key, value, number in META.findall(m.group(2)):
            if number:
                fields["source_line"] = number
            else:
                fields[key] = value
        op = re.sub(r"^jit\([^)]*\)/", "", fields.get("op_name", ""))
        source = f"{os.path.relpath(fields['source_file'])}:{fields.get('source_line', '?')}" \
            if "source_file" in fields else ""
        out[m.group(1)] = (op, source)
    return out


def short_op(op: str) -> str:
    """An op_name cut to what tells the model code apart: transforms' wrappers dropped, the last 4 parts."""
    parts = [p for p in op.split("/") if not re.match(r"^(jvp|transpose|vmap|checkpoint|remat|while|body|"
                                                       r"closed_call|pjit|cond|branch_\d+_fun)\b", p)]
    return "/".join(parts[-4:])


def compile_step(config: str, overrides: list[str], log_dir: str) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from trainer import sharding
    from trainer.config import load_config
    from trainer.step import build_trainer

    cfg = load_config(config, overrides)
    devices = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu",
                                           chips_per_host_bounds=(1, 1, 1)).devices
    mesh = sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, devices)
    started = time.perf_counter()
    tr = build_trainer(cfg, mesh, cfg.train.steps)
    batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), jnp.int32,
                                 sharding=tr.batch_sharding)
    lowered = tr.step_fn.lower(tr.abstract_state, batch)
    lower_s = time.perf_counter() - started
    started, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    result = {"config": cfg.name, "lower_s": round(lower_s, 2), "compile_s": round(time.perf_counter() - started, 2),
              "compile_cpu_s": round(time.process_time() - cpu, 2)}
    lines = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*INFO*"))):
        if not os.path.islink(path):
            with open(path, errors="replace") as f:
                lines.extend(f)
    units = units_from_log(lines)
    result["thread_cpu_s"] = thread_cpu({u["thread"] for u in units})
    where = origins(compiled.as_text())
    for u in units:
        op, source = where.get(u["unit"], ("", ""))
        u.update(op=short_op(op), source=source)
    result["units"] = sorted(units, key=lambda u: -u["seconds"])
    if units:
        first = min(u["start"] for u in units)
        result["backend_span_s"] = round(max(u["start"] + u["seconds"] for u in units) - first, 2)
        result["units_sum_s"] = round(sum(u["seconds"] for u in units), 2)
        result["threads"] = len({u["thread"] for u in units})
    return result


def by_origin(units: list[dict]) -> list[tuple[str, float, int]]:
    sums: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for u in units:
        key = f"{u['op'] or u['unit']}  {u['source']}".strip()
        sums[key][0] += u["seconds"]
        sums[key][1] += 1
    return sorted(((k, s, n) for k, (s, n) in sums.items()), key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", default="moe-1b", help="a trainer config name or YAML path [moe-1b]")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json-out", help="write the result (every unit) here as JSON")
    args = parser.parse_args()
    log_dir = tempfile.mkdtemp(prefix="compile-units-")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host backend; the TPU compiler comes from libtpu
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ["LIBTPU_INIT_ARGS"] = (f"{os.environ.get('LIBTPU_INIT_ARGS', '')} --log_dir={log_dir} "
                                      "--vmodule=deepsea_compiler_backend=3").strip()
    try:
        import libtpu  # noqa: F401
    except ImportError:
        sys.exit("the TPU compiler is not installed: run this with benchmarks/aot_topology.py's venv")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = compile_step(args.config, args.overrides, log_dir)
    print(f"{r['config']} train step for one v5e chip: lowered in {r['lower_s']} s, compiled in {r['compile_s']} s "
          f"wall, {r['compile_cpu_s']} s CPU; the backend's units {r.get('units_sum_s')} s summed over "
          f"{r.get('threads')} threads, {r.get('backend_span_s')} s from the first to the last")
    print(f"CPU seconds of the backend's threads: {r['thread_cpu_s']}")
    total = r.get("units_sum_s") or 1.0
    print(f"\nunits ({len(r['units'])}), the costliest {args.top}:")
    for u in r["units"][: args.top]:
        print(f"  {u['seconds']:6.2f} s {100 * u['seconds'] / total:5.1f}%  {u['instructions']:>8,} LLO  "
              f"{u['unit'][:28]:<28} {u['op'][:60]}  {u['source']}")
    print(f"\nby model code, the costliest {args.top}:")
    for key, seconds, n in by_origin(r["units"])[: args.top]:
        print(f"  {seconds:6.2f} s {100 * seconds / total:5.1f}%  x{n:<3} {key[:140]}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
