"""Prometheus metrics under vLLM's names, so that dashboards and autoscalers written for vLLM (GKE's
HPA on vllm:num_requests_waiting) read this server unchanged."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 1 ms to 100 s in the R10 series of preferred numbers (each about 1.25x the last): a
# quantile read from the histogram (Prometheus's histogram_quantile, benchmarks/serve_load.py) interpolates
# within one bucket, so its error is a fraction of 25%, where buckets that double (10 ms, 20 ms, 40 ms) left
# a TTFT median of a few milliseconds unreadable.
R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
LATENCY_BUCKETS = tuple(round(m * 10.0 ** e, 6) for e in range(-3, 2) for m in R10) + (100.0,)


class ServingMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, state):
        self.registry = registry = CollectorRegistry()  # one per server: tests build several
        labels = ["model_name"]
        self.state = state
        running = Gauge("vllm:num_requests_running", "Requests in decode slots.", labels, registry=registry)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", labels, registry=registry)
        usage = Gauge("vllm:kv_cache_usage_perc", "Share of the KV cache's positions in use (1 = full).", labels,
                      registry=registry)
        name = state.model_name
        self.gauges = (running.labels(name), waiting.labels(name), usage.labels(name))
        self.scraping = threading.Lock()  # two scrapes at once would set each other's gauges
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=registry).labels(name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              labels, buckets=LATENCY_BUCKETS, registry=registry).labels(name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=registry).labels(name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=registry).labels(name)
        # vLLM's prefix cache counters count tokens: those looked up, and those found (not prefilled).
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=registry).labels(name)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=registry).labels(name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=registry).labels(name)

    def _set_gauges(self) -> None:
        """The gauges from one view of the engine (EngineLoop.counts, from the snapshot it publishes after each
        step: its slots are never read mid-step), so that one scrape's running, waiting and cache usage agree."""
        loop = self.state.loop
        running, waiting, used = loop.counts() if loop is not None else (0, 0, 0)
        positions = loop.engine.slots * loop.engine.max_len if loop is not None else 1
        for gauge, value in zip(self.gauges, (running, waiting, used / positions), strict=True):
            gauge.set(value)

    def finished(self, req) -> None:
        if getattr(req, "counted", False):
            return
        req.counted = True
        times = req.token_times
        self.prompt_tokens.inc(len(req.prompt) if times else 0)
        self.generation_tokens.inc(len(req.output))
        self.prefix_queries.inc(req.prefix_queried)
        self.prefix_hits.inc(req.cached_tokens)
        if not times:
            return
        # A stream's first token counts when its text leaves (what the client sees), else when it is made.
        self.ttft.observe((getattr(req, "first_sent", None) or times[0]) - req.arrival)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        self.e2e.observe(times[-1] - req.arrival)

    def render(self) -> bytes:
        with self.scraping:
            self._set_gauges()
            return generate_latest(self.registry)
