"""Sampling's share of a decode step: the engine's decode step (forward, sampling, log-probability branch)
against the model's forward alone, with every slot greedy, every slot top-p, and against the sampler this
engine had before (a sort of the whole vocabulary for every slot, every step), all in one run.

    PYTHONPATH=. python benchmarks/serve_sampling.py                       # tiny with a 32,768-token vocabulary
    PYTHONPATH=. python benchmarks/serve_sampling.py --override model.d_model=256 --slots 8

Prints one JSON object: each case's median wall time per step (ms) over --steps steps (CPU time beside it),
and the ratios to the forward alone. `top_p` is temperature 0.7, top_p 0.9 with logits as peaked as a trained
model's (the random model's are scaled by --peak, so that the nucleus lies within the preselection, as it does
for a trained model); `top_p_flat` is the same on the random model's own flat logits, whose nucleus spans
thousands of tokens (the exact path, a full sort: the worst case); `softmax` draws from the whole softmax at
temperature 1. `before_*` is the former sampler on the same steps.

`structured_*`: the engine's decode throughput (tokens/s, --slots requests at temperature 1 run to
--structured-tokens each, the median of --structured-runs alternating runs) with every request held to a JSON
schema (an array of objects with enums, numbers and strings; llguidance's masks computed on the host each step)
against the same requests unconstrained; `_cpu`: the same per CPU second of the process (every thread's), which
other processes' load on the machine changes less. The grammar's tokens are the bytes (ids 0-255; the rest of
the vocabulary no text).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from trainer import sharding  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.serve.engine import Engine, Request, SamplingParams  # noqa: E402
from trainer.serve.sampling import exact  # noqa: E402
from trainer.serve.weights import build_serving_model, init_weights  # noqa: E402


def timed(cases: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Each case's median wall and CPU milliseconds of `step()` (which blocks until its result is ready). The
    cases take turns, a step each, so that a machine whose load changes during the run (other processes on its
    cores) slows every case alike and the ratios hold; one case timed after another compared different loads."""
    for step in cases.values():
        step()
        step()
    walls, cpus = {name: [] for name in cases}, {name: [] for name in cases}
    for _ in range(steps):
        for name, step in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: (statistics.median(walls[name]) * 1e3, statistics.median(cpus[name]) * 1e3) for name in cases}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--override", action="append", default=[], help="a config override, key=value (repeatable)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--peak", type=float, default=8.0, help="the logit scale of the `top_p` case")
    p.add_argument("--structured-tokens", type=int, default=96)
    p.add_argument("--structured-runs", type=int, default=9, help="alternating runs of each, unheld and held")
    args = p.parse_args(argv)

    cfg = load_config(args.config, [f"model.vocab_size={args.vocab}", *args.override])
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    weights = init_weights(model)
    engine = Engine(model, weights, slots=args.slots, max_len=args.max_len, chunk=16)
    engine.warm_up()
    slots = args.slots
    runner = engine.runner
    runner.positions_S[:] = args.max_len // 2  # every slot busy, half-way through its context
    runner.tokens_S[:] = np.arange(slots) % args.vocab

    forward = jax.jit(lambda w, c, t, s: model.module(w).decode(t[:, None], c, s), donate_argnums=(1,))
    scale = jnp.float32(1.0)

    def before_fn(w, c, t, s, temperature, top_k, top_p, seed, peak):
        logits, c = model.module(w).decode(t[:, None], c, s)
        logits = logits[:, 0] * peak
        keys = jax.vmap(lambda a, b: jax.random.fold_in(jax.random.key(a.astype(jnp.uint32)), b))(seed, s + 1)
        drawn = exact(logits / jnp.maximum(temperature, 1e-6)[:, None], top_k, top_p, keys)
        return jnp.where(temperature > 0, drawn, jnp.argmax(logits, -1).astype(jnp.int32)), c

    before = jax.jit(before_fn, donate_argnums=(1,))

    def run_forward():
        logits, runner.cache = forward(weights, runner.cache, runner.tokens_S, runner.positions_S)
        jax.block_until_ready(logits)

    def run_engine(temperature, top_p, peak):
        peaked = _peaked(weights, peak)

        def step():
            runner.temperature_S[:], runner.top_p_S[:] = temperature, top_p
            runner.changed()  # the device's copies of the sampling rows too
            decode = runner.program(f"decode/{runner.max_len}/{slots}")  # the whole cache, as the forward reads
            (tokens, _, _), runner.cache = decode(peaked, runner.cache, *runner.decode_inputs(slots, False))
            jax.block_until_ready(tokens)

        return step

    def run_before(temperature, top_p):
        def step():
            tokens, runner.cache = before(weights, runner.cache, runner.tokens_S, runner.positions_S,
                                          np.full(slots, temperature, np.float32), np.zeros(slots, np.int32),
                                          np.full(slots, top_p, np.float32), np.arange(slots, dtype=np.int32),
                                          scale)
            jax.block_until_ready(tokens)

        return step

    cases = {"forward": run_forward, "greedy": run_engine(0.0, 1.0, 1.0), "top_p": run_engine(0.7, 0.9, args.peak),
             "top_p_flat": run_engine(0.7, 0.9, 1.0), "softmax": run_engine(1.0, 1.0, 1.0),
             "before_greedy": run_before(0.0, 1.0), "before_top_p": run_before(0.7, 0.9)}
    row = {"config": args.config, "overrides": args.override, "vocab": args.vocab, "slots": slots}
    for name, (wall, cpu) in timed(cases, args.steps).items():
        row[f"{name}_ms"], row[f"{name}_cpu_ms"] = round(wall, 3), round(cpu, 3)
    for name in cases:
        if name != "forward":
            row[f"{name}_over_forward"] = round(row[f"{name}_ms"] / row["forward_ms"], 3)
    runner.positions_S[:] = args.max_len  # idle again: the engine's own requests next
    rates = structured(engine, args)
    (plain, plain_cpu), (held, held_cpu) = rates[False], rates[True]
    row.update(structured_tokens_per_s=round(plain, 1), structured_masked_tokens_per_s=round(held, 1),
               structured_masked_over_plain=round(held / plain, 3),
               structured_masked_over_plain_cpu=round(held_cpu / plain_cpu, 3))
    row["load_average"] = os.getloadavg()[0]
    print(json.dumps(row))


ITEMS = {"type": "array", "minItems": 100, "items": {  # never complete within the tokens: every slot decodes
    "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0},
                                     "score": {"type": "number"}, "name": {"type": "string"}},
    "required": ["kind", "age", "score", "name"], "additionalProperties": False}}


def structured(engine, args) -> dict[bool, tuple[float, float]]:
    """Decode tokens/s of --slots sampled requests unconstrained and held to ITEMS, each the median of
    --structured-runs runs that alternate (a load that changes during the run slows both alike): (tokens per
    wall second, tokens per CPU second of this process, all its threads) by whether held."""
    from trainer.serve.structured import Grammars

    grammars = Grammars("bytes", args.vocab, None)
    grammar = grammars.grammar({"type": "json_schema", "json_schema": {"name": "items", "schema": ITEMS}}, None)
    rates = {False: ([], []), True: ([], [])}
    for _ in range(args.structured_runs):
        for held in (False, True):
            requests = []
            for i in range(args.slots):
                req = Request(list(b"record %d:" % i), SamplingParams(max_tokens=args.structured_tokens,
                                                                       temperature=1.0, seed=i))
                req.constraint = grammars.constraint(grammar) if held else None
                requests.append(engine.submit(req))
            while engine.scheduler.waiting or engine.scheduler.admitting:  # every prompt in: decoding alone
                engine.step()
            wall, cpu = time.perf_counter(), time.process_time()
            before = sum(len(r.output) for r in requests)
            engine.run()
            tokens = sum(len(r.output) for r in requests) - before
            rates[held][0].append(tokens / (time.perf_counter() - wall))
            rates[held][1].append(tokens / (time.process_time() - cpu))
    return {held: (statistics.median(wall), statistics.median(cpu)) for held, (wall, cpu) in rates.items()}


def _peaked(weights, peak: float):
    """The weights with the output head scaled by `peak` (logits `peak` times as spread)."""
    if peak == 1.0:
        return weights
    params = dict(weights["params"])
    name = "head" if "head" in params else "embed"
    params[name] = params[name] * peak
    return {**weights, "params": params}


if __name__ == "__main__":
    main()
