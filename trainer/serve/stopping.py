"""SIGTERM and SIGINT before the server serves: noted, never raised from the handler.

Raising from a signal handler lands in whatever code the main thread runs: while the checkpoint was read,
SIGINT's KeyboardInterrupt surfaced from inside the reading (and could be swallowed by a library's catch-all,
the server going on to compile and serve). Here the handler only notes the signal; loading checks it between
its stages and the warm-up between its programs (on whichever thread runs it), and the server, once it takes
its own handlers, starts by looking at it.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """A signal came before the server served: the caller exits 0, saying so."""


class Stop:
    def __init__(self):
        self.signal: int | None = None
        self.previous: dict = {}

    def install(self) -> Stop:
        """This handler for SIGTERM and SIGINT (from the main thread)."""
        self.previous = {sig: signal.signal(sig, self.note) for sig in SIGNALS}
        return self

    def __enter__(self) -> Stop:
        return self.install()

    def __exit__(self, *_) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def note(self, sig: int, _frame=None) -> None:
        self.signal = sig

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def check(self) -> None:
        """Raises Stopped once a signal came (call between stages, on any thread)."""
        if self.signal is not None:
            raise Stopped(self.name)
