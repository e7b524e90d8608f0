"""The spans of the cache a serving step reads: one compiled program of each step per span, the chunk (at
least MIN_SPAN) doubled until it reaches max_len. Light (no jax), so that a deploy's startup estimate
(provision/kinds/common.py) counts the programs the server it starts compiles before it is ready."""

from __future__ import annotations

# The shortest span a step reads: below it a step's cost is its fixed work (the weights, the sampling), not
# attention, and fewer spans compile fewer programs.
MIN_SPAN = 128
DEFAULT_CHUNK = 64  # `serve --chunk`'s default: the deployed servers' argv leaves it so


def ladder(chunk: int, max_len: int, min_span: int = MIN_SPAN) -> list[int]:
    """The spans, shortest first (ceil(log2(max_len / the first)) + 1 of them)."""
    out = [min(max(chunk, min_span), max_len)]
    while out[-1] < max_len:
        out.append(min(2 * out[-1], max_len))
    return out
