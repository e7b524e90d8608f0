"""The spans of the cache a serving step reads and the rows a decode step runs: one compiled program of the
prefill per span, of the decode per span and row count, and (serve --mixed-prefill) of the decode step that
takes a prefill chunk along per pair of spans (the chunk's, and the decode rows' up to it); the spans the
chunk (at least MIN_SPAN) doubled until it reaches max_len. Light (no jax), so that a deploy's startup
estimate (provision/kinds/common.py) counts the programs the server it starts compiles before it is ready."""

from __future__ import annotations

# The shortest span a step reads: below it a step's cost is its fixed work (the weights, the sampling), not
# attention, and fewer spans compile fewer programs.
MIN_SPAN = 128
DEFAULT_CHUNK = 64  # `serve --chunk`'s default: the deployed servers' argv leaves it so
# What a server compiles before /health says ready (`serve --warm-up`): `background` the FIRST_PROGRAMS (a short
# request's prefill and a lone stream's decode at the shortest span), then the others on a thread while it
# serves; `smallest` the same first ones alone (the others when a step first reaches them); `all` every one.
WARM_UPS = ("background", "all", "smallest")
DEFAULT_WARM_UP = "background"  # the deployed servers' argv leaves it so
FIRST_PROGRAMS = 2


def ladder(chunk: int, max_len: int, min_span: int = MIN_SPAN) -> list[int]:
    """The spans, shortest first (ceil(log2(max_len / the first)) + 1 of them)."""
    out = [min(max(chunk, min_span), max_len)]
    while out[-1] < max_len:
        out.append(min(2 * out[-1], max_len))
    return out


def row_counts(slots: int, shards: int = 1) -> list[int]:
    """The rows a decode step runs, fewest first: the first `shards` slots alone (one token a device of the
    mesh's data and expert axes, which split the step's tokens; on one device, one slot: a lone stream's
    step), or every slot. Two counts and no more: each is one more decode program a span to compile before
    a server is ready, and a count between them saves a share of the step's reads of the cache and the
    experts' weights that the one-row step already saves where it matters most, a stream alone."""
    return sorted({min(shards, slots), slots})


def programs(chunk: int, max_len: int, slots: int, shards: int = 1, min_span: int = MIN_SPAN,
             decode_steps: int = 1, mixed: bool = False) -> int:
    """The programs a server compiles at every span (serve --warm-up all): the prefill and a decode a row
    count, at each span, a lone stream's burst of decode steps where it runs them (serve --decode-steps), and
    the decode step that takes a prefill chunk along where it runs (serve --mixed-prefill: one for each
    decode span up to the chunk's)."""
    spans = len(ladder(chunk, max_len, min_span))
    decodes = len(row_counts(slots, shards)) + (decode_steps > 1)
    return spans * (1 + decodes) + (spans * (spans + 1) // 2 if mixed else 0)


def programs_before_ready(chunk: int, max_len: int, slots: int, shards: int = 1, min_span: int = MIN_SPAN,
                          warm_up: str = DEFAULT_WARM_UP, decode_steps: int = 1) -> int:
    """The programs a server compiles before /health says ready, with `serve --warm-up warm_up` (and
    `--decode-steps`: a lone stream's burst is one of the first)."""
    if warm_up not in WARM_UPS:
        raise ValueError(f"warm_up must be one of {', '.join(WARM_UPS)}, got {warm_up!r}")
    if warm_up == "all":
        return programs(chunk, max_len, slots, shards, min_span, decode_steps)
    return FIRST_PROGRAMS + (decode_steps > 1)
