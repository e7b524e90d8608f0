"""Serving load benchmark: the OpenAI-compatible server under Poisson arrivals, measured by its client.

    python benchmarks/serve_load.py                          # `tiny` with fresh weights, on the CPU
    python benchmarks/serve_load.py --checkpoint runs/demo   # a trained run's latest checkpoint
    python benchmarks/serve_load.py --requests 64 --rate 20 --seed 1 --concurrency 1,8

Starts the server (trainer/serve) in this process on 127.0.0.1 and streams completions to it over HTTP
from a client process of its own (as on a deployment, client and server share no interpreter lock), on a
lean HTTP client (StreamingClient) whose own time is not counted as the server's.
Requests arrive as a Poisson process (`--rate` per second, `--seed`), with prompt and output lengths
drawn uniformly from `--prompt-len` and `--output-len` or read from `--lengths FILE` (JSON lines
{"prompt_len", "output_len"}); at most `--concurrency` run at once. Each phase (one per concurrency)
reports, as one JSON line, TTFT, TPOT (after the first token, vLLM's definition), ITL (time between
streamed chunks; these phases run the server with a chunk a token) and end-to-end latency (mean, median,
p99, seconds), request and output-token throughput, and the server's own TTFT mean and median (read from
its /metrics histogram as Prometheus reads a quantile) beside the client's.

Then, in the same run:
  `prefix`: `--prefix-requests` requests, one at a time, sharing a `--prefix-len`-token prefix with 32-token
  suffixes of their own, on two servers alike but for prefix caching: TTFT median without / with, and how many of
  the greedy outputs are the same.
  `stream`: one greedy completion of `--stream-tokens` tokens through the server, streamed (its tokens/s after the
  first, as the client sees them; at the server's default stream interval, and with a chunk a token:
  `stream_per_token`) and not (its tokens over the whole request), against `sample`'s own rate
  (trainer.sample.generate: the engine with one slot) on the same weights and prompt, in `--stream-runs` turns of
  the four: the medians, `sample_over_server_stream` (`_stream_per_token`, `_plain`), and whether the texts
  are `sample`'s; and the same ratios of each one's fastest turn (`_best`).
  `interference`: 7 streams decoding while a `--long-prompt`-token prompt arrives: their ITL p99 / p50.
  `decode_bound`: the decode step at batch 1 of a config of about 100M parameters (`--bound-config`)
  against the memory-bandwidth bound: bytes the step reads (weights + KV cache) / bandwidth of a large
  array copy timed in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

import numpy as np


def summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p99": float(np.percentile(values, 99))}


def start_server(loaded, port: int, max_waiting: int):
    import uvicorn

    from trainer.serve.loop import EngineLoop
    from trainer.serve.server import ServerState, create_app, http_protocol

    state = ServerState(loaded["name"], encode=loaded["encode"], decode=loaded["decode"], max_waiting=max_waiting)
    loaded["engine"].warm_up(every_span=True)  # no stream measured waits on a compilation
    state.loop = EngineLoop(loaded["engine"]).start()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           http=http_protocol(), lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, state


def build(args, config: str, overrides: list[str], slots: int, max_len: int, prefix_cache: int = 0):
    import jax

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve.engine import Engine
    from trainer.serve.weights import build_serving_model, init_weights, restore_weights

    if args.checkpoint and config == args.config:
        from trainer.run_loader import Codec, find_run, load_run_config

        run = find_run(args.checkpoint)
        checkpoints, cfg = run.checkpoints, load_run_config(run.config)
        codec = Codec(cfg, None)
        encode, decode = codec.encode, codec.decode
    else:
        cfg = load_config(config, overrides)
        encode, decode = (lambda text: [int(t) for t in text.split()]), (lambda ids: " ".join(map(str, ids)))
    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    model = build_serving_model(cfg, mesh)
    weights = restore_weights(model, checkpoints)[0] if args.checkpoint and config == args.config else \
        init_weights(model)
    engine = Engine(model, weights, slots=slots, max_len=max_len, chunk=args.chunk, detokenize=decode,
                    prefix_cache=prefix_cache)
    return {"name": cfg.name, "engine": engine, "encode": encode, "decode": decode, "model": model,
            "weights": weights}


class StreamingClient:
    """POSTs JSON and streams the answer's lines (a JSON body: one), over HTTP/1.1 on asyncio's streams, with a
    kept-alive connection per request in flight; h11 does the HTTP.

    Written here rather than taken from httpx or aiohttp because the client must not be what it measures:
    timed against the server's own stamps (perf_counter is one clock for every process here), those spend 0.3
    to 1 ms of Python per request before its first byte leaves and 0.2-0.4 ms on the way back, 10-25% of the
    5 ms TTFT of a short prompt on `tiny`; this one spends under 0.1 ms each way."""

    def __init__(self, base: str):
        address = base.split("//", 1)[-1].rstrip("/")
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.idle: list[tuple] = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for _, _, writer in self.idle:
            writer.close()
        self.idle.clear()

    async def lines(self, path: str, body: dict):
        import h11

        if self.idle:
            conn, reader, writer = self.idle.pop()
            conn.start_next_cycle()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            conn = h11.Connection(h11.CLIENT)
        data = json.dumps(body).encode()
        writer.write(conn.send(h11.Request(method="POST", target=path, headers=[
            ("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
            ("Content-Length", str(len(data)))])) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        pending, done = b"", False
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response) and event.status_code != 200:
                    raise RuntimeError(f"{path} answered {event.status_code}")
                elif isinstance(event, h11.Data):
                    *complete, pending = (pending + bytes(event.data)).split(b"\n")
                    for line in complete:
                        yield line.decode()
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    done = isinstance(event, h11.EndOfMessage) and conn.our_state is h11.DONE
                    if pending:  # a last line without its newline (a JSON body)
                        yield pending.decode()
                    return
        finally:
            if done:
                self.idle.append((conn, reader, writer))
            else:
                writer.close()


async def one_request(client: StreamingClient, prompt_len: int, output_len: int, vocab: int, rng,
                      text: bool = False) -> dict:
    """One streamed greedy completion; with `text`, its prompt and text as well."""
    prompt = " ".join(str(t) for t in rng.integers(0, min(vocab, 32), prompt_len))
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # usage in a last chunk without choices
    sent = time.perf_counter()
    chunks, usage, pieces = [], None, []
    async for line in client.lines("/v1/completions", body):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data["choices"] and data["choices"][0].get("text"):
            chunks.append(time.perf_counter())
            pieces.append(data["choices"][0]["text"])
        usage = data.get("usage") or usage
    tokens = usage["completion_tokens"] if usage else 0
    ttft = chunks[0] - sent if chunks else None
    e2e = time.perf_counter() - sent
    out = {"ttft": ttft, "e2e": e2e, "tokens": tokens, "itl": list(np.diff(chunks)),
           "tpot": (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None}
    return {**out, "prompt": prompt, "text": "".join(pieces)} if text else out


async def phase(base: str, lengths: list[tuple[int, int]], rate: float, concurrency: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(lengths)) if rate > 0 else np.zeros(len(lengths))
    gate = asyncio.Semaphore(concurrency)
    async with StreamingClient(base) as client:
        async def run(prompt_len, output_len, delay):
            await asyncio.sleep(delay)
            async with gate:
                return await one_request(client, prompt_len, output_len, vocab, rng)

        started = time.perf_counter()
        arrivals = np.cumsum(gaps)
        results = await asyncio.gather(*(run(p, o, d) for (p, o), d in zip(lengths, arrivals, strict=True)))
        seconds = time.perf_counter() - started
    return results, seconds


def in_client_process(coroutine_fn, *args):
    """asyncio.run(coroutine_fn(*args)) in a process of its own, started fresh: the clients' Python never
    competes with the server's for one interpreter lock, as on a deployment."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_async, coroutine_fn, *args).result()


def _run_async(coroutine_fn, *args):
    return asyncio.run(coroutine_fn(*args))


def report(results: list[dict], seconds: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "seconds": seconds, "request_throughput": len(results) / seconds,
            "output_tokens_per_s": tokens / seconds,
            "ttft": summary([r["ttft"] for r in results if r["ttft"] is not None]),
            "tpot": summary([r["tpot"] for r in results if r["tpot"] is not None]),
            "itl": summary([x for r in results for x in r["itl"]]),
            "e2e": summary([r["e2e"] for r in results])}


def load_phases(args, base: str, vocab: int) -> None:
    rng = np.random.default_rng(args.seed)
    if args.lengths:
        rows = [json.loads(line) for line in open(args.lengths, encoding="utf-8") if line.strip()]
        lengths = [(int(r["prompt_len"]), int(r["output_len"])) for r in rows][:args.requests]
    else:
        lengths = [(int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1)),
                    int(rng.integers(args.output_len[0], args.output_len[1] + 1))) for _ in range(args.requests)]
    by_concurrency = {}
    for concurrency in args.concurrency:
        before = server_ttft_metrics(base)
        results, seconds = in_client_process(phase, base, lengths, args.rate, concurrency, vocab, args.seed)
        row = {"phase": "load", "concurrency": concurrency, "rate": args.rate, **report(results, seconds)}
        row.update(server_ttft_since(base, before))
        if row["server_ttft_median"] and row["ttft"]["median"]:
            row["server_over_client_ttft_median"] = row["server_ttft_median"] / row["ttft"]["median"]
        by_concurrency[concurrency] = row
        print(json.dumps(row), flush=True)
    if len(by_concurrency) > 1:
        low, high = min(by_concurrency), max(by_concurrency)
        print(json.dumps({"phase": "concurrency_ratio", "low": low, "high": high,
                          "output_tokens_per_s_ratio": by_concurrency[high]["output_tokens_per_s"]
                          / by_concurrency[low]["output_tokens_per_s"]}), flush=True)


def server_ttft_metrics(base: str) -> dict[float, float]:
    """The server's TTFT histogram from /metrics: cumulative count by upper bound (inf for +Inf), and the
    sum under the key "sum"."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        if family.name == "vllm:time_to_first_token_seconds":
            out = {}
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out[float(sample.labels["le"])] = sample.value
                elif sample.name.endswith("_sum"):
                    out["sum"] = sample.value
            return out
    return {}


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of a Prometheus histogram as Prometheus computes it: linear within the bucket that
    holds it (the first bucket from 0)."""
    bounds = sorted(b for b in cumulative if b != "sum")
    total = cumulative[bounds[-1]] if bounds else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # beyond the last finite bound: that bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def server_ttft_since(base: str, before: dict) -> dict:
    """The server's TTFT mean and median over the requests since `before`."""
    after = server_ttft_metrics(base)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    count = delta.get(float("inf"), 0.0)
    return {"server_ttft_mean": delta["sum"] / count if count else None,
            "server_ttft_median": histogram_quantile(0.5, delta)}


async def _stream_turn(base: str, tokens: int, vocab: int, seed: int, plain: bool = True) -> dict:
    """One greedy completion of `tokens` tokens streamed, then (`plain`) the same not streamed: each one's
    tokens/s as the client sees it and its text. Streamed: after the first token (vLLM's TPOT), as `sample`
    counts; not streamed: every token over the whole request (its HTTP, the prompt's prefill), which is
    stricter."""
    async with StreamingClient(base) as client:
        rng = np.random.default_rng(seed)  # the prompt `single_stream` gives `sample`
        streamed = await one_request(client, 16, tokens, vocab, rng, text=True)
        out = {"stream": (streamed["tokens"] - 1) / (streamed["e2e"] - streamed["ttft"]),
               "stream_text": streamed["text"]}
        if plain:
            body = {"prompt": streamed["prompt"], "max_tokens": tokens, "temperature": 0}
            sent = time.perf_counter()
            answer = json.loads("".join([line async for line in client.lines("/v1/completions", body)]))
            seconds = time.perf_counter() - sent
            out.update(plain=answer["usage"]["completion_tokens"] / seconds, plain_text=answer["choices"][0]["text"])
    return out


def single_stream(base: str, args, loaded, state) -> None:
    """One greedy stream through the server, streamed (at the server's stream interval, and with a chunk a
    token) and not, against `sample`'s tokens/s (trainer.sample.generate, its own count) on the same weights and
    prompt, in --stream-runs turns (a load that changes during the run slows each alike): the medians and their
    ratios, and whether the texts are `sample`'s."""
    import concurrent.futures
    import multiprocessing

    from trainer.sample import generate

    vocab = loaded["model"].cfg.model.vocab_size
    prompt = np.random.default_rng(args.seed).integers(0, min(vocab, 32), 16).tolist()
    rates, same = {"stream": [], "stream_per_token": [], "plain": [], "sample": []}, True
    interval = state.stream_interval
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
        for _ in range(args.stream_runs):
            state.stream_interval = 0.0
            each = client.submit(_run_async, _stream_turn, base, args.stream_tokens, vocab, args.seed, False).result()
            state.stream_interval = interval
            served = client.submit(_run_async, _stream_turn, base, args.stream_tokens, vocab, args.seed).result()
            served.update(stream_per_token=each["stream"], stream_per_token_text=each["stream_text"])
            out, sampled = generate(loaded["model"], loaded["weights"], prompt, args.stream_tokens, temperature=0.0,
                                    top_k=0, seed=0)
            for name in ("stream", "stream_per_token", "plain"):
                rates[name].append(served[name])
                same &= served[f"{name}_text"] == loaded["decode"](out)
            rates["sample"].append(sampled)
    row = {"phase": "stream", "tokens": args.stream_tokens, "runs": args.stream_runs, "same_text": same,
           "stream_interval": interval}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    row.update({f"{name}_tokens_per_s": value for name, value in medians.items()})
    for name in ("stream", "stream_per_token", "plain"):
        row[f"sample_over_server_{name}"] = medians["sample"] / medians[name]
        # Each one's fastest turn: the least disturbed by a shared machine's other work (as timeit's best).
        row[f"sample_over_server_{name}_best"] = max(rates["sample"]) / max(rates[name])
    print(json.dumps(row), flush=True)


async def interference_scenario(base: str, seed: int, stream_tokens: int, long_prompt: int, vocab: int):
    """7 streams decode; a long prompt arrives once they run."""
    rng = np.random.default_rng(seed + 1)
    async with StreamingClient(base) as client:
        streams = [asyncio.ensure_future(one_request(client, 8, stream_tokens, vocab, rng)) for _ in range(7)]
        await asyncio.sleep(0.5)
        long = await one_request(client, long_prompt, 4, vocab, rng)
        return await asyncio.gather(*streams), long


def interference(base: str, args, vocab: int) -> None:
    """The streams' chunk gaps while the long prompt is prefilled between their decode steps."""
    streams, long = in_client_process(interference_scenario, base, args.seed, args.interference_tokens,
                                      args.long_prompt, vocab)
    itl = [x for r in streams for x in r["itl"]]
    row = {"phase": "interference", "long_prompt": args.long_prompt, "stream_itl": summary(itl),
           "itl_p99_over_p50": float(np.percentile(itl, 99) / np.median(itl)), "long_prompt_ttft": long["ttft"]}
    print(json.dumps(row), flush=True)


async def shared_prefix_scenario(base: str, prompts: list[list[int]], tokens: int):
    """The prompts one after another, streamed: (each one's TTFT, each one's text)."""
    ttfts, texts = [], []
    async with StreamingClient(base) as client:
        for prompt in prompts:
            body = {"prompt": " ".join(map(str, prompt)), "max_tokens": tokens, "temperature": 0, "stream": True}
            sent, first, text = time.perf_counter(), None, ""
            async for line in client.lines("/v1/completions", body):
                if line.startswith("data: ") and line != "data: [DONE]":
                    piece = json.loads(line[6:])["choices"][0].get("text") or ""
                    if piece and first is None:
                        first = time.perf_counter()
                    text += piece
            ttfts.append(first - sent)
            texts.append(text)
    return ttfts, texts


def shared_prefix(args) -> None:
    """TTFT of prompts sharing a long prefix without and with the prefix cache, on two servers built alike."""
    rows = {}
    for cached in (False, True):
        loaded = build(args, args.config, [], args.slots, args.max_len,
                       prefix_cache=4 * args.prefix_len if cached else 0)
        vocab = loaded["model"].cfg.model.vocab_size
        rng = np.random.default_rng(args.seed + 2)  # the same prompts for both
        prefix = rng.integers(0, vocab, args.prefix_len).tolist()
        prompts = [prefix + rng.integers(0, vocab, 32).tolist() for _ in range(args.prefix_requests)]
        server, thread, _ = start_server(loaded, args.port + 1 + cached, max_waiting=10_000)
        try:
            rows[cached] = in_client_process(shared_prefix_scenario, f"http://127.0.0.1:{args.port + 1 + cached}",
                                             prompts, 8)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    (plain_ttft, plain_text), (cached_ttft, cached_text) = rows[False], rows[True]
    print(json.dumps({"phase": "prefix", "prefix_len": args.prefix_len, "suffix_len": 32,
                      "requests": args.prefix_requests, "ttft_median_without": statistics.median(plain_ttft),
                      "ttft_median_with": statistics.median(cached_ttft),
                      "ttft_median_ratio": statistics.median(plain_ttft) / statistics.median(cached_ttft),
                      "same_outputs": sum(a == b for a, b in zip(plain_text, cached_text, strict=True))}), flush=True)


def decode_bound(args) -> None:
    """The decode step at batch 1 against bytes read / the bandwidth of a large copy, in this run."""
    import jax

    loaded = build(args, args.bound_config, args.bound_overrides, 1, args.bound_max_len)
    engine, model = loaded["engine"], loaded["model"]
    engine.warm_up()
    params = sum(p.size for p in loaded["weights"]["params"].values())
    weight_bytes = sum(p.nbytes for p in loaded["weights"]["params"].values())
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.cache))  # keys and values, or latents
    engine.runner.positions_S[:] = args.bound_max_len // 2
    times = []
    for _ in range(args.bound_steps):
        started = time.perf_counter()
        engine.runner.decode({})  # the step and its tokens back on the host
        times.append(time.perf_counter() - started)
    bandwidth = copy_bandwidth(args.copy_mib)
    step_s = statistics.median(times)
    # The experts a token does not route to are not read: count the attention, dense and routed shares.
    cfg = model.cfg
    moe_share = cfg.moe.top_k / cfg.moe.num_experts
    expert_bytes = sum(p.nbytes for n, p in loaded["weights"]["params"].items() if ".ffn.w_" in n and p.ndim == 3)
    # Half the cache's positions hold tokens (the step sits at max_len / 2); all of it is read (masked).
    read_all = weight_bytes + cache_bytes
    read_routed = weight_bytes - expert_bytes * (1 - moe_share) + cache_bytes
    print(json.dumps({"phase": "decode_bound", "config": args.bound_config, "overrides": args.bound_overrides,
                      "parameters": params, "weight_bytes": weight_bytes, "cache_bytes": cache_bytes,
                      "copy_bandwidth_gb_s": bandwidth / 1e9, "step_ms": 1e3 * step_s,
                      "bound_all_weights_ms": 1e3 * read_all / bandwidth,
                      "bound_routed_experts_ms": 1e3 * read_routed / bandwidth,
                      "step_over_bound_all_weights": step_s / (read_all / bandwidth),
                      "step_over_bound_routed_experts": step_s / (read_routed / bandwidth)}), flush=True)


def copy_bandwidth(mib: int) -> float:
    """Bytes per second of a large copy (read once, written once) on the platform the step ran on: jax's on
    an accelerator, numpy's memory copy on the CPU (XLA:CPU's elementwise loop is slower than memory there)."""
    import jax
    import jax.numpy as jnp

    times = []
    if jax.devices()[0].platform == "cpu":
        src = np.ones(mib * 2**20 // 4, np.float32)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        for _ in range(5):
            started = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - started)
        return 2 * src.nbytes / statistics.median(times)
    big = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)
    copy(big).block_until_ready()
    for _ in range(5):
        started = time.perf_counter()
        copy(big).block_until_ready()
        times.append(time.perf_counter() - started)
    return 2 * big.nbytes / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=0, help="arrivals per second (0: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--prompt-len", type=lambda t: [int(x) for x in t.split(",")], default=[8, 64])
    p.add_argument("--output-len", type=lambda t: [int(x) for x in t.split(",")], default=[32, 128])
    p.add_argument("--lengths", default=None, metavar="FILE")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1280)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--stream-runs", type=int, default=9)
    p.add_argument("--stream-interval", type=float, default=None, metavar="SECONDS",
                   help="the server's stream interval in the stream phase [serve --stream-interval's default]")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--interference-tokens", type=int, default=200)
    p.add_argument("--bound-config", default="tiny")
    p.add_argument("--bound-overrides", type=lambda t: t.split(), default=[
        "model.vocab_size=32768", "model.d_model=512", "model.num_layers=6", "model.num_heads=8", "model.d_ff=2048",
        "moe.d_ff=1024", "moe.num_experts=8", "moe.top_k=2"])
    p.add_argument("--bound-max-len", type=int, default=256)
    p.add_argument("--bound-steps", type=int, default=20)
    p.add_argument("--copy-mib", type=int, default=512)
    p.add_argument("--skip", default="", help="comma-separated phases to skip: load,stream,interference,prefix,bound")
    args = p.parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    if not {"load", "stream", "interference"} <= skip:
        loaded = build(args, args.config, [], args.slots, args.max_len)
        server, thread, state = start_server(loaded, args.port, max_waiting=10_000)
        base = f"http://127.0.0.1:{args.port}"
        vocab = loaded["model"].cfg.model.vocab_size
        interval = state.stream_interval if args.stream_interval is None else args.stream_interval
        try:
            if "load" not in skip:
                state.stream_interval = 0.0  # a chunk a token: the client's ITL is the time between tokens
                load_phases(args, base, vocab)
            if "stream" not in skip:
                state.stream_interval = interval
                single_stream(base, args, loaded, state)
            if "interference" not in skip:
                state.stream_interval = 0.0
                interference(base, args, vocab)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    if "prefix" not in skip:
        shared_prefix(args)
    if "bound" not in skip:
        decode_bound(args)


if __name__ == "__main__":
    main(sys.argv[1:])
