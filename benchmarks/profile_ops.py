"""Where a program's time goes on the device, from jax's own profiler: `op_table(run, calls)` traces `calls`
calls of `run` and sums the device's XLA ops by name (per call), read back through jax.profiler.ProfileData,
so a chip run writes a small table rather than a trace to be opened elsewhere.

    from benchmarks.profile_ops import op_table
    table = op_table(lambda: step(), calls=8)   # {"device_ms_per_call": ..., "ops": [{"name", "ms", "count"}...]}
"""

from __future__ import annotations

import collections
import glob
import tempfile


def op_table(run, calls: int, top: int = 20) -> dict:
    """`run` called `calls` times under the profiler (it must wait for its own result): the device ops' time
    per call by name, the largest `top`, and the device planes and lines seen (none on a CPU: empty ops)."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as where:
        with jax.profiler.trace(where):
            for _ in range(calls):
                run()
        paths = glob.glob(f"{where}/**/*.xplane.pb", recursive=True)
        if not paths:
            return {"device_ms_per_call": None, "ops": [], "lines": []}
        data = ProfileData.from_file(paths[0])
    totals, counts, lines = collections.Counter(), collections.Counter(), []
    categories, described = collections.Counter(), {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            lines.append(f"{plane.name}/{line.name}")
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                totals[event.name] += event.duration_ns
                counts[event.name] += 1
                if event.name not in described:  # the op's HLO (long_name) and category, where the plane has them
                    stats = dict(event.stats)
                    described[event.name] = (str(stats.get("long_name", stats.get("hlo_op", "")))[:200],
                                             str(stats.get("hlo_category", stats.get("category", ""))))
                categories[described[event.name][1]] += event.duration_ns
    # A loop's event spans the ops inside it, which have their own: the device's time counts the ops alone.
    loops = {name for name in totals if name.startswith(("%while", "while", "%conditional", "conditional"))}
    device_ns = sum(ns for name, ns in totals.items() if name not in loops)
    listed = totals.most_common(top)
    rest = [(name, ns) for name, ns in totals.items() if name not in loops and name not in dict(listed)]
    return {"device_ms_per_call": round(device_ns / calls / 1e6, 4),
            "categories": {c or "?": round(ns / calls / 1e6, 4) for c, ns in categories.most_common()},
            "ops": [{"name": name[:300], "ms": round(ns / calls / 1e6, 4), "count": counts[name] // calls,
                     "hlo": described[name][0]} for name, ns in listed],
            # what the table leaves out: how many ops, their time and launches a call
            "rest": {"ops": len(rest), "ms": round(sum(ns for _, ns in rest) / calls / 1e6, 4),
                     "launches": sum(counts[name] for name, _ in rest) // calls},
            "launches": sum(c for name, c in counts.items() if name not in loops) // calls,
            "lines": sorted(set(lines))}
