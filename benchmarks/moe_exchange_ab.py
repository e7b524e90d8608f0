"""The dropless block with this tree's exchange against another revision's, side by side in one run.

    python benchmarks/moe_exchange_ab.py --against f82f8e2^ --case 0
    python benchmarks/moe_exchange_ab.py --against HEAD --case 2 --reps 9 --json
    python benchmarks/moe_exchange_ab.py --against HEAD~3 --package --case 0 --reps 21
    python benchmarks/moe_exchange_ab.py --against HEAD~1 --package --exchange-rows device --case 3

Runs on 8 fake CPU devices (mesh expert=8), float32, fwd+bwd of the dropless block
(exchange_rows auto) of benchmarks/moe_layer.py's cases. The other revision's
trainer/moe/exchange.py is read with `git show` and loaded as a module of its own; the
block built with it differs from this tree's only in the exchange (both take their
routing, layouts and FFN from this tree). The ideal and both blocks are timed in
interleaved rounds; medians (and minima) of wall and CPU time are reported against the
ideal's, with the largest difference between the two blocks' outputs and gradients.

With --package the other block is the whole trainer/moe package at that revision (its routing,
layouts, exchange and FFN; read with `git archive`), against this tree's package.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from unittest import mock

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # noqa: E402

from trainer.moe import exchange  # noqa: E402
from trainer.moe.capacity import expert_capacity  # noqa: E402
from trainer.moe.config import MoEConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def load_exchange(revision: str):
    """trainer/moe/exchange.py at `revision`, as a module of its own."""
    try:
        source = subprocess.run(["git", "show", f"{revision}:trainer/moe/exchange.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"cannot read trainer/moe/exchange.py at {revision!r}: "
                         f"{getattr(err, 'stderr', '') or err}".strip()) from None
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("exchange_at_revision", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module


def load_package(revision: str):
    """moe_apply of trainer/moe at `revision`, taking this tree's ExpertWeights: that revision's package
    is imported under the names trainer.moe.* (its modules import each other by those names) and this
    tree's modules are put back afterwards; the functions keep the modules they were defined in."""
    import trainer

    where = tempfile.mkdtemp(prefix="moe-at-revision-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    try:
        archive = subprocess.run(["git", "archive", revision, "trainer/moe"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"cannot read trainer/moe at {revision!r}: "
                         f"{getattr(err, 'stderr', b'').decode(errors='replace') or err}".strip()) from None
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        # The "data" filter (Python 3.11.4 on) refuses links and paths out of `where`.
        tar.extractall(where, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    is_moe = lambda name: name == "trainer.moe" or name.startswith("trainer.moe.")
    ours = {name: mod for name, mod in sys.modules.items() if is_moe(name)}
    path = list(trainer.__path__)
    try:
        for name in ours:
            del sys.modules[name]
        # trainer.moe from the archive; any other trainer module still from this tree.
        trainer.__path__[:] = [os.path.join(where, "trainer"), *path]
        apply = importlib.import_module("trainer.moe.parallel").moe_apply
        weights = importlib.import_module("trainer.moe.experts").ExpertWeights
        return lambda x, router, w, *args, **kw: apply(x, router, weights(*w), *args, **kw)
    finally:
        trainer.__path__[:] = path
        for name in [n for n in sys.modules if is_moe(n)]:
            del sys.modules[name]
        sys.modules.update(ours)


@contextlib.contextmanager
def exchange_of(module):
    """Blocks traced inside take their padded dropless exchange (once per assignment: what `auto`
    runs on CPU) from `module`."""
    with mock.patch.object(exchange, "_dropless_padded", module._dropless_padded):
        yield


def run_case(mesh, case, other, reps, package=False, exchange_rows="auto"):
    experts, k, d_model, d_ff, tokens, cf, routing = case
    devices = mesh.devices.size
    x, router, w = moe_layer.make_inputs(mesh, experts, d_model, d_ff, tokens)
    capacity = expert_capacity(tokens // devices, k, cf, experts, 4)
    rows = jax.device_put(jax.random.normal(jax.random.key(7), (experts, devices * capacity, d_model)),
                          NamedSharding(mesh, P("expert")))
    cfg = MoEConfig(num_experts=experts, top_k=k, d_ff=d_ff, capacity_factor=0.0, exchange_rows=exchange_rows,
                    **routing)
    steps = {"ideal": (moe_layer.ideal_step(mesh), (rows, w)),
             "this_tree": (moe_layer.block_step(cfg, mesh), (x, router, w))}
    ours = steps["this_tree"][0](x, router, w)  # traced and compiled here, with this tree's exchange
    if package:
        fn = moe_layer.block_step(cfg, mesh, apply=other)
        theirs = fn(x, router, w)
    else:
        with exchange_of(other):
            fn = moe_layer.block_step(cfg, mesh)
            theirs = fn(x, router, w)  # traced and compiled under the patch
    steps["other"] = (fn, (x, router, w))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs),
                                                                strict=True))
    times = moe_layer.interleaved(steps, reps)
    ideal = [statistics.median(t[i] for t in times["ideal"]) for i in (0, 1)]
    ideal_min = [min(t[i] for t in times["ideal"]) for i in (0, 1)]
    row = {"experts": experts, "top_k": k, "tokens": tokens, "routing": routing or None, "reps": reps,
           "exchange_rows": exchange_rows,
           "max_abs_difference": diff, "ideal_ms": round(ideal[0], 2)}
    for name in ("this_tree", "other"):
        t = times[name]
        row[f"{name}_ratio"] = round(statistics.median(v[0] for v in t) / ideal[0], 3)
        row[f"{name}_cpu_ratio"] = round(statistics.median(v[1] for v in t) / ideal[1], 3)
        row[f"{name}_min_ratio"] = round(min(v[0] for v in t) / ideal_min[0], 3)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the git revision whose exchange.py to compare with")
    parser.add_argument("--package", action="store_true",
                        help="compare with the whole trainer/moe package at that revision, not its exchange.py alone")
    parser.add_argument("--case", type=int, action="append", help="benchmarks/moe_layer.py case indices (0-based)")
    parser.add_argument("--reps", type=int, default=9, help="timed rounds (interleaved); medians are reported")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--exchange-rows", choices=("auto", "assignment", "device"), default="auto",
                        help="moe.exchange_rows of both blocks (device: the once-per-device exchange; needs --package)")
    args = parser.parse_args(argv)
    if args.exchange_rows == "device" and not args.package:
        parser.error("--exchange-rows device compares whole packages: add --package")
    other = load_package(args.against) if args.package else load_exchange(args.against)
    devices = jax.devices()
    mesh = jax.make_mesh((1, len(devices)), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    for index in args.case or range(len(moe_layer.CASES)):
        row = run_case(mesh, moe_layer.CASES[index], other, args.reps, args.package, args.exchange_rows)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"E={row['experts']:3d} k={row['top_k']} T={row['tokens']}  this tree {row['this_tree_ratio']:.3f} "
                  f"(CPU {row['this_tree_cpu_ratio']:.3f})  {args.against} {row['other_ratio']:.3f} "
                  f"(CPU {row['other_cpu_ratio']:.3f})  of the ideal ({row['ideal_ms']:.1f} ms); "
                  f"max difference {row['max_abs_difference']:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
