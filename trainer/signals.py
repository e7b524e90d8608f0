"""Signals that cannot be lost: handlers that only record, loops that act at points of their choosing.

A Python signal handler runs between two bytecodes of the main thread, wherever that thread is: inside a
garbage-collection callback, a `finally`, a library's `except Exception`. An exception raised by the
handler there can be printed as "Exception ignored" and dropped, and the command goes on as if nothing
had been asked. So the handlers of a `Latch` only record the signal (and Python's C-level handler writes
a wakeup byte to the latch's pipe: signal.set_wakeup_fd); the loop calls `checkpoint()` at points of its
own, which raises the signal's exception there, again at every checkpoint until the loop says it has
acted on it (`acted()`); from then on later signals are recorded and ignored, so that the teardown they
would interrupt finishes. Waits go through `sleep`, which wakes as soon as a signal arrives.

Standard library only: the control plane (`moe-tpu run`) and the trainer's commands share it.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# The shell's exit code of a command that a signal stopped: 128 + its number.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class Signalled(BaseException):
    """A recorded signal, raised at a checkpoint: a BaseException like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


def as_exception(signum: int) -> BaseException:
    """What a checkpoint raises for a signal by default: Ctrl-C is KeyboardInterrupt, as Python's own."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Signalled(signum)


class Latch:
    """The signals received while installed (`latch()`), in order, and whether the loop acted on them."""

    def __init__(self, raise_for: Callable[[int], BaseException]) -> None:
        self.received: list[int] = []
        self.handled = False
        self.raised = False  # a checkpoint raised the pending signal's exception (it is on its way out)
        self.raise_for = raise_for
        self._read_fd = self._write_fd = -1  # the wakeup pipe, while installed (`latch`)

    def _open(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def _record(self, signum: int, frame) -> None:  # the handler: nothing but a list append
        self.received.append(signum)

    @property
    def pending(self) -> int | None:
        """The first signal received, until the loop acted on it."""
        return self.received[0] if self.received and not self.handled else None

    def checkpoint(self) -> None:
        signum = self.pending
        if signum is not None and threading.current_thread() is threading.main_thread():
            self.raised = True
            raise self.raise_for(signum)

    def sleep(self, seconds: float) -> None:
        """Wait `seconds`, waking at once when a signal arrives (then the checkpoint raises)."""
        deadline = time.monotonic() + seconds
        while True:
            self.checkpoint()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([self._read_fd], [], [], left)
            if ready:
                self._drain()

    def _drain(self) -> None:
        try:
            while os.read(self._read_fd, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._read_fd >= 0:
            os.close(self._read_fd)
            os.close(self._write_fd)
            self._read_fd = self._write_fd = -1


_current: Latch | None = None


@contextmanager
def latch(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
          raise_for: Callable[[int], BaseException] = as_exception) -> Iterator[Latch]:
    """Record `signals` for the block (main thread only; elsewhere nothing changes). On the way out the
    previous handlers come back; a signal that arrived after the loop's last checkpoint (none raised it)
    is delivered again to them, so that it is not lost either."""
    global _current
    if threading.current_thread() is not threading.main_thread() or _current is not None:
        yield _current or Latch(raise_for)
        return
    found = Latch(raise_for)
    found._open()
    previous = {sig: signal.signal(sig, found._record) for sig in signals}
    old_fd = signal.set_wakeup_fd(found._write_fd, warn_on_full_buffer=False)
    _current = found
    try:
        yield found
    finally:
        _current = None
        signal.set_wakeup_fd(old_fd)
        for sig, old in previous.items():
            signal.signal(sig, old)
        found.close()
        unhandled = found.pending
        if unhandled is not None and not found.raised:
            signal.raise_signal(unhandled)


def checkpoint() -> None:
    """Raise the pending signal's exception here (main thread, inside `latch()`); else nothing."""
    if _current is not None:
        _current.checkpoint()


def sleep(seconds: float) -> None:
    """time.sleep, but inside `latch()` in the main thread a signal ends it at once (raised here)."""
    if _current is not None and threading.current_thread() is threading.main_thread():
        _current.sleep(seconds)
    elif seconds > 0:
        time.sleep(seconds)


def acted() -> None:
    """The loop has acted on the pending signal (it is tearing down): later ones are ignored."""
    if _current is not None:
        _current.handled = True
