"""Serving weights at bfloat16, int8 and int4 (`--weights`), side by side in one run: their bytes and the
engine's decode step.

    python benchmarks/serve_weights.py                       # a config of about 100M parameters, bfloat16
    python benchmarks/serve_weights.py --steps 64 --slots 8 --overrides "model.num_layers=2 ..."

One model, one set of fresh weights: stored as they are (bfloat16), then quantized on load as the server
quantizes them (trainer/serve/quant.py, quant4.py). Each engine decodes `--slots` greedy requests of a
16-token prompt; the decode step is (a run of 8 + `--steps` tokens - a run of 8) / `--steps`, so prefill
and the first steps fall out, the median of `--repeats` such differences. Every format computes in the
config's dtype (its weights dequantized inside the compiled step): the figures differ by what is stored
and unpacked. One JSON line per format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

OVERRIDES = ["dtype=bfloat16", "param_dtype=bfloat16", "model.vocab_size=32768", "model.d_model=512",
             "model.num_layers=6", "model.num_heads=8", "model.d_ff=2048", "moe.d_ff=1024", "moe.num_experts=8",
             "moe.top_k=2"]


def timed_run(engine, slots: int, tokens: int) -> float:
    from trainer.serve.engine import Request, SamplingParams

    for i in range(slots):
        engine.submit(Request([(7 * i + j) % 200 + 1 for j in range(16)], SamplingParams(max_tokens=tokens)))
    started = time.perf_counter()
    engine.run()
    return time.perf_counter() - started


def measure(model, weights, args) -> dict:
    from trainer.serve.engine import Engine

    engine = Engine(model, weights, slots=args.slots, max_len=16 + 8 + args.steps, chunk=16)
    engine.warm_up()
    timed_run(engine, args.slots, 8 + args.steps)  # the first run of each program
    steps = []
    for _ in range(args.repeats):
        long, short = timed_run(engine, args.slots, 8 + args.steps), timed_run(engine, args.slots, 8)
        steps.append((long - short) / args.steps)
    return {"decode_step_ms": 1e3 * statistics.median(steps),
            "decode_step_ms_runs": [round(1e3 * s, 3) for s in steps]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--overrides", type=lambda t: t.split(), default=OVERRIDES)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import jax

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve import quant, quant4
    from trainer.serve.memory import memory_plan
    from trainer.serve.weights import build_serving_model, init_weights

    cfg = load_config(args.config, args.overrides)
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    weights = init_weights(model)
    float_bytes = sum(p.nbytes for p in weights["params"].values())
    formats = {"bf16": (weights, None), "int8": (quant, "int8"), "int4": (quant4, "int4")}
    for name, (source, planned) in formats.items():
        stored = source if planned is None else {**weights, "params": source.quantize_params(weights["params"])}
        held = sum(leaf.nbytes for leaf in jax.tree.leaves(stored["params"]))
        assert held == memory_plan(model, 1, 1, cfg.dtype, planned)["weights"]  # what start-up counts
        print(json.dumps({"weights": name, "config": args.config, "overrides": args.overrides,
                          "parameters": sum(p.size for p in weights["params"].values()), "weight_bytes": held,
                          "of_bf16": held / float_bytes, "slots": args.slots, "platform": jax.devices()[0].platform,
                          **measure(model, stored, args)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
