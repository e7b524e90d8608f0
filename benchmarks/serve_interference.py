"""What admitting a long prompt does to the streams already decoding, in process (no HTTP: it runs on the chip,
whose machine has no TCP sockets), for issue 56's bar: with 8 streams decoding, a 2,000-token prompt may
raise their inter-token latency p99 at most 2x.

    python benchmarks/serve_interference.py                          # a small model on the CPU
    python benchmarks/serve_interference.py --accelerator --json out.json   # moe-1b on the default backend (TPU)
    python benchmarks/serve_interference.py --chunks 64,256 --streams 8 --prompt 2000
    python benchmarks/serve_interference.py --mixed off,on      # the chunk in its own program, then with the step

--mixed: whether a prefill chunk goes with the decode step in one program (serve --mixed-prefill; the
engine's default: on an accelerator only), each setting side by side on the same weights.

For each prefill chunk: an engine (trainer/serve/engine.py, the server's) of --streams + 1 slots decodes
--streams greedy requests of a 16-token prompt; once each has --warm tokens, their token times over --base
more steps are the baseline; then one request of --prompt tokens arrives and the window runs from then until
its first token (its time to first token). The figures: the streams' inter-token latencies (each stream's
gaps between tokens, all streams pooled) p50 and p99 in the baseline and in the window, and their ratio. The
scenario runs twice on one engine and the second is reported, so that no program compiles inside it.
One JSON line per chunk; --json PATH writes them all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_weights import ACCELERATOR_OVERRIDES, CPU_OVERRIDES  # noqa: E402 - the same models as serve_weights.py


def gaps(times: list[float], start: float, end: float) -> list[float]:
    """The gaps between consecutive token times whose later token falls in [start, end)."""
    return [b - a for a, b in zip(times, times[1:], strict=False) if start <= b < end]


def quantile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.quantile(np.asarray(values), q)) if values else float("nan")


def scenario(engine, args) -> dict:
    """One run of the scenario on `engine` (idle): the streams, their baseline, the long prompt's window."""
    from trainer.serve.engine import Request, SamplingParams

    budget = args.warm + args.base + args.prompt // engine.runner.chunk + args.tail + 8
    streams = [engine.submit(Request([(7 * i + j) % 200 + 1 for j in range(16)], SamplingParams(max_tokens=budget)))
               for i in range(args.streams)]
    while min(len(r.output) for r in streams) < args.warm:
        engine.step()
    base_start = time.perf_counter()
    while min(len(r.output) for r in streams) < args.warm + args.base:
        engine.step()
    submitted = time.perf_counter()
    long = engine.submit(Request([(11 * j) % 200 + 1 for j in range(args.prompt)], SamplingParams(max_tokens=2)))
    while not long.output:
        engine.step()
    first = long.token_times[0]
    for _ in range(args.tail):
        engine.step()
    engine.run()  # the rest: every request to its end, the engine idle again
    base = [g for r in streams for g in gaps(r.token_times, base_start, submitted)]
    window = [g for r in streams for g in gaps(r.token_times, submitted, first)]
    row = {"chunk": engine.runner.chunk, "mixed": engine.runner.mixed, "streams": args.streams, "prompt": args.prompt,
           "ttft_s": round(first - submitted, 4), "window_steps": len(window) // max(1, args.streams),
           "itl_base_p50_ms": round(1e3 * quantile(base, 0.5), 3),
           "itl_base_p99_ms": round(1e3 * quantile(base, 0.99), 3),
           "itl_window_p50_ms": round(1e3 * quantile(window, 0.5), 3),
           "itl_window_p99_ms": round(1e3 * quantile(window, 0.99), 3)}
    row["p99_ratio"] = round(row["itl_window_p99_ms"] / row["itl_base_p99_ms"], 3)
    return row


def program_profiles(engine, top: int = 40) -> dict:
    """The device ops of the programs the window ran at their longest span (the decode step's most called,
    and the chunk's: "mixed/<span>/<decode span>" or "prefill/<span>"), each alone on its example inputs
    (benchmarks/profile_ops.py): where a fused step's time goes against the decode step's."""
    import jax
    from profile_ops import op_table

    runner = engine.runner
    called = [name for name, n in runner.calls.items() if n]
    span = lambda name: int(name.split("/")[1])  # noqa: E731
    picks = [max((n for n in called if n.startswith("decode/")), key=lambda n: runner.calls[n], default=None),
             max((n for n in called if n.split("/")[0] in ("mixed", "prefill")), key=span, default=None)]
    tables = {}
    for name in filter(None, picks):
        inputs = runner.example_inputs(name)

        def once(name=name, inputs=inputs):
            outputs, runner.cache = runner.program(name)(runner.weights, runner.cache, *inputs)
            jax.block_until_ready(outputs)

        once()
        tables[name] = op_table(once, calls=4, top=top)
    return tables


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", action="store_true", help="moe-1b on the default backend (a TPU) [tiny on the CPU]")
    p.add_argument("--config", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--chunks", default="64", help="comma-separated prefill chunks [64, the server's default]")
    p.add_argument("--mixed", default="off,on", help="comma-separated: off (the chunk in its own program), on "
                   "(with the decode step) [off,on]")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2000, help="the arriving prompt's tokens")
    p.add_argument("--warm", type=int, default=4, help="each stream's tokens before the baseline")
    p.add_argument("--base", type=int, default=32, help="steps of the baseline")
    p.add_argument("--tail", type=int, default=4, help="steps after the long prompt's first token")
    p.add_argument("--profile", action="store_true", help="then the device ops of the decode step and of the "
                   "chunk's program at its longest span, each alone (benchmarks/profile_ops.py)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    import jax

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve.engine import Engine
    from trainer.serve.weights import build_serving_model, init_weights

    if not args.accelerator:
        jax.config.update("jax_platforms", "cpu")
    else:  # as a server does: each setting's engine then loads the programs another compiled (one call, both)
        from trainer.distributed import use_compilation_cache

        use_compilation_cache(jax.devices()[0].platform)
    config = args.config or ("moe-1b" if args.accelerator else "tiny")
    overrides = (ACCELERATOR_OVERRIDES if args.accelerator else CPU_OVERRIDES if args.config is None else []) \
        + args.overrides
    cfg = load_config(config, overrides)
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    weights = init_weights(model)
    rows = []
    settings = [(int(c), {"on": True, "off": False}[m]) for c in args.chunks.split(",") for m in args.mixed.split(",")]
    for chunk, mixed in settings:
        max_len = -(-(args.prompt + 2 + 16 + args.warm + args.base + args.prompt // chunk + args.tail + 16) // chunk) \
            * chunk
        engine = Engine(model, weights, slots=args.streams + 1, max_len=max_len, chunk=chunk, mixed_prefill=mixed)
        started = time.perf_counter()
        scenario(engine, args)  # compiles every program the scenario runs
        row = {"config": config, "device_kind": jax.devices()[0].device_kind, "max_len": max_len,
               "first_run_s": round(time.perf_counter() - started, 1), **scenario(engine, args)}
        if args.profile:
            row["profile"] = program_profiles(engine)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != 'profile'}), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
