"""A stream's signals from the engine's thread to its reader on the server's event loop (trainer/serve/routes.py),
and how often they come. Light (no jax, no web framework): the command line reads its default."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported: the command line reads STREAM_INTERVAL, and asyncio costs its start 30 ms
    import asyncio

# `serve --stream-interval`'s default: a stream's chunks come at most this often (seconds), each with every
# token since: 50 a second, more than a reader of the text can tell apart. Where a decode step takes longer
# (a large model), every token is a chunk; where it is shorter (a small one), chunks take less of the
# engine's interpreter lock (Wake): one greedy stream on the CPU, `sample` over the server streamed was
# 1.27-1.73x with a chunk a token, 0.97-1.42x at 10 ms and 0.94-1.22x at 20 ms, as not streamed
# (benchmarks/serve_load.py).
STREAM_INTERVAL = 0.02


class Wake:
    """The engine thread's signal to a request's reader on the event loop. At most one is pending: a reader that
    lags behind the engine takes every token since in one chunk. And a token that comes within `interval`
    seconds of the last signal waits for the next token's signal (one engine step later at most; a request's
    end always signals): a signal is a write to the loop's self-pipe, a turn of the loop and a chunk, all on
    the engine's interpreter lock, and one a token slowed a small model's decode step (0.6 ms on the CPU) by
    a third. The reader clears `pending` before it reads the text, so a token added after that read signals
    again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, interval: float = 0.0):
        self.pending, self.interval, self.last = False, interval, float("-inf")
        self._signal = functools.partial(loop.call_soon_threadsafe, events.put_nowait, None)

    def __call__(self, final: bool = False) -> None:
        if self.pending:
            return
        now = time.perf_counter()
        if final or now - self.last >= self.interval:
            self.pending, self.last = True, now
            self._signal()
