"""Serving weights at bfloat16, int8 and int4 (both storages), side by side in one run: their bytes, the
compiled decode program's scratch, the engine's decode step and its ratio to the memory-bandwidth bound.

    python benchmarks/serve_weights.py                          # a small model on the CPU (a minute or two)
    python benchmarks/serve_weights.py --accelerator --json out.json   # moe-1b on the default backend (TPU)
    python benchmarks/serve_weights.py --formats int4-nibbles,int4-native --slots 1,8,32 --memory-only

One model, one set of fresh weights: stored as they are (bfloat16), then quantized as the server quantizes
them (trainer/serve/quant.py, quant4.py): int8, and int4 in each storage quant4 offers (`int4-nibbles`, two
values a byte, what the CPU wants; `int4-native`, jnp.int4, what XLA packs on a TPU), whatever the backend
would choose. For each format and slot count:
  - temp_bytes: XLA's compiled memory analysis of the decode program (its scratch). A float copy of the
    whole weight stack shows here (on a v5e chip int8's was 2,488 MiB, float32's 2,487 MiB).
  - decode_step_ms: an engine (one a format and --decode-steps, of the most slots) decodes `slots` greedy
    requests of a 16-token prompt; the step is (a run of 8 + --steps tokens - a run of 8) / --steps, so
    prefill and the first steps fall out; the median of --repeats such differences.
  - touched_bytes: the weights the step reads (trainer.serve.weights.decode_weight_bytes: the experts its
    tokens route to) and the KV cache rows and span it attends over; over_bound: the step over
    touched_bytes / the memory bandwidth (819 GB/s on a v5e chip, --hbm-gbps elsewhere; none on a CPU
    unless given).
One JSON line per format and slot count on stdout; --json PATH writes them all as one object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# A small MoE for the CPU (about 20M parameters, bfloat16): a minute or two for every format.
CPU_OVERRIDES = ["dtype=bfloat16", "param_dtype=bfloat16", "model.vocab_size=8192", "model.d_model=256",
                 "model.num_layers=4", "model.num_heads=4", "model.d_ff=1024", "moe.d_ff=512", "moe.num_experts=8",
                 "moe.top_k=2"]
ACCELERATOR_OVERRIDES = ["dtype=bfloat16", "param_dtype=bfloat16"]
FORMATS = ("bf16", "int8", "int4-nibbles", "int4-native")
# Memory bandwidth per chip by the start of jax's device_kind (bytes/s): v5e's from provision/catalogue.py.
BANDWIDTH = {"TPU v5 lite": 819e9, "TPU v5e": 819e9}


def timed_run(engine, slots: int, tokens: int) -> float:
    from trainer.serve.engine import Request, SamplingParams

    for i in range(slots):
        engine.submit(Request([(7 * i + j) % 200 + 1 for j in range(16)], SamplingParams(max_tokens=tokens)))
    started = time.perf_counter()
    engine.run()
    return time.perf_counter() - started


def stored_weights(weights: dict, fmt: str) -> dict:
    """The weights as `fmt` stores them (bf16: as they are)."""
    from trainer.serve import quant, quant4

    if fmt == "bf16":
        return weights
    if fmt == "int8":
        return {**weights, "params": quant.quantize_params(weights["params"])}
    return {**weights, "params": quant4.quantize_params(weights["params"], storage=fmt.split("-")[1])}


def decode_program(engine, slots: int):
    """(the engine's decode program for `slots` live slots at its longest span, compiled; its name)."""
    runner = engine.runner
    rows, span = runner.rows_for(slots), runner.spans()[-1]
    name = f"decode/{span}/{rows}"
    compiled = runner.program(name).lower(runner.weights, runner.cache, *runner.decode_inputs(rows, False)).compile()
    return compiled, name


def touched_bytes(model, engine, slots: int) -> int:
    """Bytes a decode step of `slots` rows reads: the weights its tokens touch and its rows of the KV cache
    over the span the steps attend (the longest the timed runs reach)."""
    import jax

    from trainer.serve.weights import decode_weight_bytes

    runner = engine.runner
    cache = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.cache))
    live = runner.span_for(runner.max_len)  # the longest timed run reaches the end of the cache
    cache_read = round(cache * slots / runner.slots * live / runner.max_len)
    return decode_weight_bytes(model, engine.weights, slots) + cache_read


def measure(model, weights, fmt: str, slot_counts: list[int], args, bandwidth: float | None,
            decode_steps: int = 1, single: dict | None = None) -> list[dict]:
    """One row per slot count, from one engine of the most slots (a step of fewer live slots runs the decode
    program of fewer rows: it reads only theirs). With `decode_steps` > 1 the engine runs bursts of that many
    steps (serve --decode-steps), timed against the single step's program alone (`single`: slots -> the rows
    of the same format at one step)."""
    import jax

    from trainer.serve.engine import Engine
    from trainer.serve.weights import stored_bytes

    engine = Engine(model, stored_weights(weights, fmt), slots=max(slot_counts), max_len=16 + 8 + args.steps,
                    chunk=16, decode_steps=decode_steps)
    held = sum(stored_bytes(x) for x in jax.tree.leaves(engine.weights["params"]))
    rows = []
    for slots in slot_counts:
        if decode_steps > 1 and slots > engine.runner.rows()[0]:
            continue  # bursts run a lone stream's row alone (ModelRunner.burst_fits)
        if decode_steps > 1:
            row = {"weights": fmt, "slots": slots, "decode_steps": decode_steps, "weight_bytes": held,
                   **timed(model, engine, slots, args, bandwidth)}
            if single and single.get(slots, {}).get("program_ms"):
                row["engine_over_program"] = round(row["decode_step_ms"] / single[slots]["program_ms"], 3)
            rows.append(row)
            continue
        compiled, name = decode_program(engine, slots)
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append({"weights": fmt, "slots": slots, "decode_steps": 1, "weight_bytes": held, "decode_program": name,
                     "temp_bytes": temp, "temp_mib": round(temp / 2**20, 2)})
        if not args.memory_only:
            rows[-1].update(timed(model, engine, slots, args, bandwidth))
            rows[-1]["program_ms"] = round(1e3 * program_alone(engine, name, slots, args.steps), 3)
            rows[-1]["engine_over_program"] = round(rows[-1]["decode_step_ms"] / rows[-1]["program_ms"], 3)
            if args.profile:
                from profile_ops import op_table

                once = lambda c=name, n=slots: program_alone(engine, c, n, 1, warm=0)  # noqa: E731
                rows[-1]["profile"] = op_table(once, calls=8, top=60)
    return rows


def program_alone(engine, name: str, slots: int, steps: int, warm: int = 2) -> float:
    """Seconds a step of the engine's decode program `name` alone: `steps` calls back to back on inputs already on
    the device, the cache threaded through (donated, as the engine does), one wait at the end. Against the
    engine's step, what the host adds (uploads, reading the tokens back, the scheduler)."""
    import jax
    import numpy as np

    runner = engine.runner
    compiled, rows = runner.program(name), runner.rows_for(slots)
    _, sampling, mask, last = runner.decode_inputs(rows, False)
    step_4xR, live = runner.step_inputs(rows, False), np.arange(rows) < slots
    step_4xR[1] = np.where(live, runner.max_len - 1, runner.max_len)
    step_4xR[2] = live  # as the engine's steps: each live row takes its last token
    step_4xR = jax.device_put(step_4xR, last.sharding)
    cache = runner.cache
    for _ in range(warm):
        (last, _, _), cache = compiled(runner.weights, cache, step_4xR, sampling, mask, last)
    jax.block_until_ready(cache)
    started = time.perf_counter()
    for _ in range(steps):
        (last, _, _), cache = compiled(runner.weights, cache, step_4xR, sampling, mask, last)
    last.block_until_ready()
    elapsed = time.perf_counter() - started
    runner.cache = cache
    return elapsed / steps


def weights_read_s(weights: dict) -> float:
    """Seconds one program takes to read every weight once (a max over each): the chip's own memory bandwidth
    measured beside the steps, the physical bound the ratios could use in place of the data sheet's."""
    import jax
    import jax.numpy as jnp

    read = jax.jit(lambda w: [jnp.max(x) for x in jax.tree.leaves(w)])
    jax.block_until_ready(read(weights))
    started = time.perf_counter()
    for _ in range(5):
        out = read(weights)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / 5


def timed(model, engine, slots: int, args, bandwidth: float | None) -> dict:
    first = timed_run(engine, slots, 8 + args.steps)  # the first run of each program (its compiles)
    steps = []
    for _ in range(args.repeats):
        long, short = timed_run(engine, slots, 8 + args.steps), timed_run(engine, slots, 8)
        steps.append((long - short) / args.steps)
    step = statistics.median(steps)
    touched = touched_bytes(model, engine, slots)
    return {"first_run_s": round(first, 2), "decode_step_ms": round(1e3 * step, 3),
            "decode_step_ms_runs": [round(1e3 * s, 3) for s in steps],
            "tokens_per_s": round(slots / step, 1), "touched_bytes": touched,
            "bound_ms": None if bandwidth is None else round(1e3 * touched / bandwidth, 4),
            "over_bound": None if bandwidth is None else round(step / (touched / bandwidth), 2)}


def bandwidth_of(device, given: float | None) -> float | None:
    if given:
        return given * 1e9
    return next((bw for kind, bw in BANDWIDTH.items() if device.device_kind.startswith(kind)), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", action="store_true",
                   help="--config on the default backend (TPU, GPU) at bfloat16 instead of the small CPU model")
    p.add_argument("--config", default=None, help="the config [tiny with CPU_OVERRIDES; moe-1b with --accelerator]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--slots", default=None, help="comma-separated slot counts [1,8; 1,8,32 with --accelerator]")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth (GB/s) where not known")
    p.add_argument("--decode-steps", default="1",
                   help="comma-separated: the engine's decode steps a program (serve --decode-steps), each timed "
                        "(bursts against the single step's program alone) [1]")
    p.add_argument("--variant", dest="variants", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="config overrides of one variant of the model (repeat it: each format is timed with each side "
                        "by side, e.g. moe.direct_assignments=0, every step through the grouped matmul), "
                        "with every --decode-steps [the config as it is]")
    p.add_argument("--memory-only", action="store_true", help="the bytes and the compiled scratch, no timing")
    p.add_argument("--profile", action="store_true",
                   help="with each timing, the decode program's device ops by time (benchmarks/profile_ops.py)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results to this path")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    if unknown := [f for f in formats if f not in FORMATS]:
        p.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")

    import jax

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve.weights import build_serving_model, init_weights

    config = args.config or ("moe-1b" if args.accelerator else "tiny")
    overrides = (ACCELERATOR_OVERRIDES if args.accelerator else CPU_OVERRIDES if args.config is None else []) \
        + args.overrides
    if not args.accelerator:
        jax.config.update("jax_platforms", "cpu")
    device = jax.devices()[0]
    cfg = load_config(config, overrides)
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, [device]))
    started = time.perf_counter()
    weights = init_weights(model)
    jax.block_until_ready(weights)
    init_s = time.perf_counter() - started
    bandwidth = bandwidth_of(device, args.hbm_gbps)
    head = {"config": config, "overrides": overrides, "platform": device.platform, "device_kind": device.device_kind,
            "parameters": sum(x.size for x in weights["params"].values()), "bandwidth_bytes_per_s": bandwidth,
            "init_weights_s": round(init_s, 2)}
    if args.accelerator:
        seconds = weights_read_s(weights["params"])
        head["weights_read_ms"] = round(1e3 * seconds, 3)
        head["measured_read_gbps"] = round(sum(x.nbytes for x in jax.tree.leaves(weights["params"])) / seconds / 1e9, 1)
    slot_counts = [int(s) for s in (args.slots or ("1,8,32" if args.accelerator else "1,8")).split(",")]
    rows = []
    bursts = [int(k) for k in args.decode_steps.split(",")]
    # each variant's model over the same weights (the overrides change how the model computes, not its parameters)
    variants = {"": model} if not args.variants else {
        v: build_serving_model(load_config(config, overrides + v.split(",")), model.mesh) for v in args.variants}
    for fmt in formats:
        for name, variant in variants.items():
            single = {}
            for steps in bursts if not args.memory_only else [1]:
                for row in measure(variant, weights, fmt, slot_counts, args, bandwidth, steps, single):
                    if steps == 1:
                        single[row["slots"]] = row
                    row = {"variant": name, **row}
                    rows.append(row)
                    print(json.dumps({**head, **row}), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({**head, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
