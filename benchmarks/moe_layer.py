"""MoE layer benchmark: the expert-parallel block against its ideal and the GShard einsum, in one run.

    python benchmarks/moe_layer.py --json                 # 8 fake CPU devices
    python benchmarks/moe_layer.py --json --accelerator   # the GPU/TPU devices jax finds
    python benchmarks/moe_layer.py --case 0 --token-scale 4   # E=16 with 1024 tokens per device
    python benchmarks/moe_layer.py --json --mesh expert=2,model=4   # each expert split 4 ways

Runs on 8 fake CPU devices (mesh expert=8) unless XLA_FLAGS already says otherwise, or with
--accelerator on every device of the default backend (mesh expert=<device count>). --mesh takes
the trainer's mesh text: with a `model` axis (tensor parallelism) each expert's hidden dimension
is split over it, tokens over data x expert, and the ideal is the same batched einsums on each
device's hidden slice (the capacity-mode shapes of its token shard), with nothing around them: no
all-reduce of the partial sums, no routing, which every device of a group repeats.
For every case and mode it prints one JSON object per line with moe_ms (median
fwd+bwd of the expert-parallel block), ideal_ms (the same expert matmuls as plain
batched einsums of the capacity-mode shapes, sharded over the same devices),
einsum_ms (the same block with GShard's one-hot dispatch and combine) and the ratios.

work_fraction is the share of the ideal's rows that hold an assignment the mode computes
(kept ones in capacity mode, all in dropless mode), and speedup_bound = einsum_ms /
(ideal_ms * work_fraction): the speedup over the einsum baseline of a block that cost
nothing but its expert matmuls, run as fast as the ideal's and on no empty row.

With --routing balanced token t's choices are experts t, t + 1, ... (mod E): every expert and
every device gets exactly its fair share, as the ideal's even shapes assume; the default routing
(a random router) leaves the most loaded device 3-10% above it.

Every time also comes as CPU time (`*_cpu_ms`, all threads of the process, steadier than the
wall clock on shared cores) beside the load average at the end of the case. With --stages the
dropless row (exchange_rows auto) also times where the block's time goes, in the same rounds: `ffn_tiled` (the
receiver's tiled FFN alone, on a device's expected rows split evenly over its experts and
sources), `ffn_einsum` (batched einsums over the same rows, unpadded), `rest` (the whole
block with d_ff = 8: routing, sort, layout, exchange, gathers and combine, with next to no FFN)
and `collectives` (the block's six collectives alone, their all_to_all sized for this routing's
largest send: one round of the tightest padded exchange). `floor_ratio` = (collectives +
ffn_einsum) / ideal is what no dropless block on this backend can go under: its collectives at
their smallest and its expert matmuls at the einsum's speed, with nothing else and no device
waiting for another. `largest_send` and `most_loaded` are the largest send from one device to
another and the rows the most loaded device receives, against their fair shares.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "jax" not in sys.modules and "--accelerator" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from trainer.meshspec import MESH_AXES, parse_mesh  # noqa: E402
from trainer.moe import core, exchange  # noqa: E402
from trainer.moe.capacity import expert_capacity  # noqa: E402
from trainer.moe.config import MoEConfig  # noqa: E402
from trainer.moe.core import Topology, auto_block_rows  # noqa: E402
from trainer.moe.experts import ExpertWeights, batched_ffn  # noqa: E402
from trainer.moe.parallel import moe_apply  # noqa: E402

# (experts, top_k, d_model, d_ff, tokens, capacity_factor, routing): the last a top-8 of 64
# experts (8 per device) from at most 4 of 8 groups, one group per device, with sigmoid gating.
GROUP_LIMITED = {"score": "sigmoid", "expert_groups": 8, "routing_groups_limit": 4}
CASES = [
    (16, 2, 256, 512, 2048, 1.25, {}),
    (8, 2, 512, 1024, 8192, 1.25, {}),
    (64, 2, 512, 1024, 8192, 1.25, {}),
    (64, 8, 256, 256, 2048, 1.25, GROUP_LIMITED),
]
# dropless: the default (exchange_rows auto); the other two force one exchange.
MODES = ("capacity", "dropless", "dropless_per_assignment", "dropless_per_device")
DROPLESS_ROWS = {"dropless": "auto", "dropless_per_assignment": "assignment", "dropless_per_device": "device"}
SEQ_LEN = 128
# The ideal's [E, rows, D] buffers: a device holds its experts' rows from the token shards of its data slice.
ROWS = P("expert", "data")


def time_ms(fn, args) -> tuple[float, float]:
    """(wall, CPU) milliseconds of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3


def interleaved(steps: dict, reps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) ms of each step (name -> (fn, args)) in `reps` interleaved rounds.

    Each timed call comes right after an untimed one of its own: a step run after another one
    ran up to 1.8x slower than after itself (after the einsum baseline, whose one-hot tensors are
    the largest buffers here; and 1.3x after the ideal), so whatever came next in a round paid."""
    for fn, args in steps.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, (fn, args) in steps.items():
            jax.block_until_ready(fn(*args))
            times[name].append(time_ms(fn, args))
    return times


def make_inputs(mesh, experts, d_model, d_ff, tokens, seed=0, balanced_k=0):
    """Random tokens and weights; with balanced_k, token t's top choices are experts t, t + 1, ...,
    t + balanced_k - 1 (mod E), so that every expert, and every device, gets exactly its fair share."""
    keys = jax.random.split(jax.random.key(seed), 5)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x = jax.random.normal(keys[0], (tokens, d_model))
    router = jax.random.normal(keys[1], (d_model, experts)) * d_model**-0.5
    if balanced_k:
        t = jnp.arange(tokens)
        x = 0.01 * x + sum((balanced_k + 1 - r) * jax.nn.one_hot((t + r) % experts, d_model) for r in range(balanced_k))
        router = jnp.eye(d_model, experts)
    x = put(x.reshape(tokens // SEQ_LEN, SEQ_LEN, d_model), P(("data", "expert")))
    router = put(router, P())
    w_in, w_out = expert_specs(mesh)
    w = ExpertWeights(
        put(jax.random.normal(keys[2], (experts, d_model, d_ff)) * d_model**-0.5, w_in),
        put(jax.random.normal(keys[3], (experts, d_model, d_ff)) * d_model**-0.5, w_in),
        put(jax.random.normal(keys[4], (experts, d_ff, d_model)) * d_ff**-0.5, w_out),
    )
    return x, router, w


def expert_specs(mesh) -> tuple[P, P]:
    """The layouts of [E, D, F] and [E, F, D] expert weights: experts over `expert`, and the hidden
    dimension over `model` where the mesh has one (as trainer.sharding lays them out)."""
    hidden = "model" if dict(mesh.shape).get("model", 1) > 1 else None
    return P("expert", None, hidden), P("expert", hidden, None)


def token_shards(mesh) -> int:
    shape = dict(mesh.shape)
    return shape.get("data", 1) * shape.get("expert", 1)


def block_step(cfg: MoEConfig, mesh, apply=None):
    """fwd+bwd of the block (trainer.moe's moe_apply, or `apply`): gradients for the input, the router
    and every expert weight."""
    apply = apply or moe_apply

    def loss(x, router, w):
        y, aux = apply(x, router, w, cfg, mesh, train=True)
        return jnp.mean(jnp.square(y.astype(jnp.float32))) + aux["aux_loss"] + aux["z_loss"]

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def ideal_step(mesh):
    """The expert matmuls alone, fwd+bwd: each device runs batched einsums over its experts'
    [E_l, rows, D] buffers (rows = every device's capacity), exactly the shapes the
    capacity-mode block hands its experts, with nothing around them."""
    spec = ROWS
    w_in, w_out = expert_specs(mesh)
    # One partial sum per device (a device of a tensor-parallel group holds its hidden slice's).
    every = P(tuple(mesh.axis_names))

    def loss(x_ExRxD, w):
        local = jax.shard_map(
            lambda x, w: jnp.sum(jnp.square(batched_ffn(x, w)))[None],
            mesh=mesh, in_specs=(spec, ExpertWeights(w_in, w_in, w_out)), out_specs=every,
        )
        return jnp.sum(local(x_ExRxD, w))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def ffn_einsum_step(mesh, rows_per_expert, d_model, w):
    """The ideal's batched einsums over rows_per_expert rows per expert (a dropless device's
    expected rows, unpadded), fwd+bwd."""
    experts = w.w_in_ExDxF.shape[0]
    rows = jax.device_put(jax.random.normal(jax.random.key(8), (experts, rows_per_expert, d_model)),
                          NamedSharding(mesh, P("expert")))
    return ideal_step(mesh), (rows, w)


def ffn_tiled_step(mesh, num_rows, block_rows, d_model, w):
    """The receiver's tiled FFN alone (as the padded dropless exchange hands it its rows: one chunk
    per source, sorted by local expert), fwd+bwd; each device receives its num_rows expected rows,
    spread evenly over sources and local experts."""
    devices = mesh.devices.size
    local = w.w_in_ExDxF.shape[0] // devices
    chunk = exchange.padded_chunks(num_rows, devices).first
    counts_SxEl = jnp.full((devices, local), num_rows // (devices * local), jnp.int32)
    topo = Topology(grouped_matmul="tiled")
    spec = P("expert")
    recv = jax.device_put(jax.random.normal(jax.random.key(9), (devices * devices * chunk, d_model)),
                          NamedSharding(mesh, spec))

    def loss(recv, w):
        local_loss = lambda r, w: jnp.sum(jnp.square(
            exchange._on_receiver(r, counts_SxEl, w, block_rows, topo)))[None]
        sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(spec, ExpertWeights(spec, spec, spec)),
                                out_specs=spec)
        return jnp.sum(sharded(recv, w))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (recv, w)


def sends(x, router, cfg: MoEConfig, devices: int) -> tuple[float, float]:
    """(the largest send from one device to another, the rows the most loaded device receives), each
    against its fair share, for the block's routing of these tokens (each device routes its own shard)."""
    tokens, experts, k = x.shape[0] * x.shape[1], cfg.num_experts, cfg.top_k
    logits = core.route_tokens(x.reshape(devices, tokens // devices, -1), router, cfg, False, None)
    experts_SxTxK = core.token_choice(logits, cfg, jnp.zeros(experts) if cfg.uses_bias else None)[0]
    to_device = jax.nn.one_hot(experts_SxTxK // (experts // devices), devices, dtype=jnp.int32)
    sends_SxJ = jnp.sum(to_device, axis=(1, 2))
    fair = tokens * k / devices**2
    return float(jnp.max(sends_SxJ)) / fair, float(jnp.max(jnp.sum(sends_SxJ, axis=0))) / (fair * devices)


def collectives_step(mesh, chunk_rows: int, d_model: int, experts: int):
    """The dropless block's collectives alone, on empty data: the forward's all-reduce of the routing
    statistics ([devices, E] counts, [E] probabilities), its two all_to_all of [devices * chunk_rows, D]
    rows, the backward's two, and the router gradient's all-reduce ([D, E]); each waits for the one
    before, as in the block. With chunk_rows the largest send, the least any block moves in one
    round of a padded exchange: what no dropless block on this backend can spend less on."""
    devices = mesh.devices.size
    axis = "expert"

    def body(rows, stats, router):
        stats = jax.lax.psum(stats, axis)
        for _ in range(4):
            rows = jax.lax.all_to_all(rows + stats[0, 0], axis, 0, 0, tiled=True)
        return rows, jax.lax.psum(router + rows[0, 0], axis)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(), P()), out_specs=(P(axis), P()),
                                 check_vma=False))
    rows = jax.device_put(jnp.zeros((devices * devices * chunk_rows, d_model)), NamedSharding(mesh, P(axis)))
    return step, (rows, jnp.zeros((devices + 1, experts)), jnp.zeros((d_model, experts)))


def run_case(mesh, case, modes, reps, block_rows=0, stages=False, balanced=False):
    """Times the ideal, the einsum baseline and every mode in interleaved rounds, so that load
    from other processes hits them alike, each timed call right after one of its own; reports
    medians over the rounds."""
    experts, k, d_model, d_ff, tokens, cf, routing = case
    devices = token_shards(mesh)  # a tensor-parallel group shares its tokens
    x, router, w = make_inputs(mesh, experts, d_model, d_ff, tokens, balanced_k=k if balanced else 0)
    capacity = expert_capacity(tokens // devices, k, cf, experts, 4)
    rows = jax.device_put(
        jax.random.normal(jax.random.key(7), (experts, devices * capacity, d_model)), NamedSharding(mesh, ROWS)
    )
    base = MoEConfig(num_experts=experts, top_k=k, d_ff=d_ff, capacity_factor=cf, **routing)
    configs = {"einsum": MoEConfig(**{**base.model_dump(), "dispatch": "einsum"})}
    dropless = lambda rows: MoEConfig(**{**base.model_dump(), "capacity_factor": 0.0, "exchange_rows": rows,
                                         "block_rows": block_rows})
    configs.update({m: base if m == "capacity" else dropless(DROPLESS_ROWS[m]) for m in modes})
    # Share of the ideal's rows (experts * devices * capacity) each mode fills with assignments.
    assigned = tokens * k / (experts * devices * capacity)
    drop = float(jax.jit(lambda *a: moe_apply(*a, base, mesh, train=True)[1]["drop_fraction"])(x, router, w))
    work = {"capacity": assigned * (1.0 - drop), **{m: assigned for m in DROPLESS_ROWS}}
    steps = {"ideal": (ideal_step(mesh), (rows, w))}
    steps.update({name: (block_step(cfg, mesh), (x, router, w)) for name, cfg in configs.items()})
    if stages and "dropless" in modes:
        num_rows = tokens // devices * k  # the assignments a device sends, and receives when balanced
        block = block_rows or auto_block_rows(num_rows * devices / experts)
        steps["ffn_tiled"] = ffn_tiled_step(mesh, num_rows, block, d_model, w)
        steps["ffn_einsum"] = ffn_einsum_step(mesh, num_rows * devices // experts, d_model, w)
        x8, router8, w8 = make_inputs(mesh, experts, d_model, 8, tokens, balanced_k=k if balanced else 0)
        steps["rest"] = (block_step(dropless(DROPLESS_ROWS["dropless"]).model_copy(update={"d_ff": 8}), mesh),
                         (x8, router8, w8))
        largest, most_loaded = sends(x, router, configs["dropless"], devices)
        fair = tokens // devices * k / devices
        steps["collectives"] = collectives_step(mesh, 8 * -(-round(largest * fair) // 8), d_model, experts)
    times = interleaved(steps, reps)
    ms = {name: statistics.median(wall for wall, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    load = round(os.getloadavg()[0], 1)
    for mode in modes:
        stage = {}
        if stages and mode == "dropless":
            for name in ("ffn_tiled", "ffn_einsum", "rest", "collectives"):
                stage.update({f"{name}_ms": round(ms[name], 2), f"{name}_ratio": round(ms[name] / ms["ideal"], 3),
                              f"{name}_cpu_ratio": round(cpu[name] / cpu["ideal"], 3)})
            # The least a dropless block could cost here: its collectives at their smallest and
            # batched einsums on every assigned row, with nothing else and no device waiting for another.
            stage.update({"floor_ratio": round((ms["collectives"] + ms["ffn_einsum"]) / ms["ideal"], 3),
                          "floor_cpu_ratio": round((cpu["collectives"] + cpu["ffn_einsum"]) / cpu["ideal"], 3),
                          "largest_send": round(largest, 3), "most_loaded": round(most_loaded, 3)})
        yield {
            "experts": experts, "top_k": k, "d_model": d_model, "d_ff": d_ff, "tokens": tokens,
            "capacity_factor": cf, "routing": routing or None, "balanced": balanced, "devices": mesh.devices.size,
            "mesh": ",".join(f"{a}={n}" for a, n in dict(mesh.shape).items()),
            "platform": mesh.devices.flat[0].platform,
            "mode": mode, "dtype": "float32",
            "moe_ms": round(ms[mode], 2), "ideal_ms": round(ms["ideal"], 2),
            "ratio_to_ideal": round(ms[mode] / ms["ideal"], 3),
            "einsum_ms": round(ms["einsum"], 2), "speedup_vs_einsum": round(ms["einsum"] / ms[mode], 3),
            "work_fraction": round(work[mode], 3),
            "speedup_bound": round(ms["einsum"] / (ms["ideal"] * work[mode]), 3),
            "moe_cpu_ms": round(cpu[mode], 2), "ideal_cpu_ms": round(cpu["ideal"], 2),
            "cpu_ratio_to_ideal": round(cpu[mode] / cpu["ideal"], 3), **stage, "load_average": load,
        }


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (interleaved); medians are reported")
    parser.add_argument("--case", type=int, action="append", help="run only these case indices (0-based)")
    parser.add_argument("--mode", choices=MODES, action="append", help="run only these modes")
    parser.add_argument("--accelerator", action="store_true", help="use the default backend's devices")
    parser.add_argument("--block-rows", type=int, default=0, help="moe.block_rows of the dropless modes (0: auto)")
    parser.add_argument("--stages", action="store_true",
                        help="also time the dropless block's parts: the tiled FFN alone, einsums on its rows, the rest")
    parser.add_argument("--routing", choices=("random", "balanced"), default="random",
                        help="balanced: every expert gets exactly its fair share of the assignments")
    parser.add_argument("--token-scale", type=_positive, default=1,
                        help="run the cases with this many times their tokens (more tokens per device)")
    parser.add_argument("--mesh", default=None, metavar="data=D,expert=E,model=T",
                        help="the mesh, as the trainer's --mesh [expert=<devices>]")
    args = parser.parse_args(argv)
    if any(not 0 <= i < len(CASES) for i in args.case or ()):
        parser.error(f"--case: the cases are 0 to {len(CASES) - 1}")
    devices = jax.devices()
    try:
        shape = parse_mesh(args.mesh or f"expert={len(devices)}", len(devices))
    except ValueError as e:
        parser.error(str(e))
    if args.stages and shape["model"] > 1:
        parser.error("--stages times the parts of a block without a model axis; leave out --mesh model")
    mesh = jax.make_mesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    cases = [CASES[i] for i in args.case] if args.case else CASES
    cases = [(e, k, d, f, tokens * args.token_scale, *rest) for e, k, d, f, tokens, *rest in cases]
    for case in cases:
        for row in run_case(mesh, case, tuple(args.mode or MODES), args.reps, args.block_rows, args.stages,
                            args.routing == "balanced"):
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"E={row['experts']:3d} k={row['top_k']} D={row['d_model']} F={row['d_ff']} "
                    f"T={row['tokens']} {row['mode']:24s} moe {row['moe_ms']:9.2f} ms  "
                    f"ideal {row['ideal_ms']:9.2f} ms  "
                    f"ratio {row['ratio_to_ideal']:.2f}  einsum {row['einsum_ms']:9.2f} ms  "
                    f"speedup {row['speedup_vs_einsum']:.2f} (bound {row['speedup_bound']:.2f})  "
                    f"cpu ratio {row['cpu_ratio_to_ideal']:.2f}  load {row['load_average']}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
