"""Clocks: the real one, and a simulated one that dry runs share with the emulator.

Waiting code takes a clock instead of calling time.sleep, so a dry run can wait
through hours of WAITING_FOR_RESOURCES in milliseconds without branching.
"""

from __future__ import annotations

import threading
import time

from trainer import signals


class RealClock:
    """Wall-clock time; sleep really sleeps (and, inside a command's signal latch, wakes at a signal and
    raises it: trainer/signals.py)."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        signals.sleep(max(seconds, 0.0))


class SimClock:
    """Simulated time: sleep advances now() at once. Thread-safe.

    While real work runs beside the simulation (the trainer run locally in a dry run), a
    `gate` ties the two together: then sleep waits in real time (at most `gate.wait(s)`
    seconds, returning early when the work reports) and advances now() by the time that
    really passed, so the emulated clock and the real process agree.
    """

    def __init__(self, start: float = 1_767_225_600.0) -> None:  # 2026-01-01T00:00:00Z
        self._now = float(start)
        self._lock = threading.Lock()
        self.gate = None  # an object with active() -> bool and wait(seconds) -> None

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        signals.checkpoint()  # every wait of a command is a point where it acts on a signal
        gate = self.gate
        if gate is not None and seconds > 0 and gate.active():
            start = time.monotonic()
            gate.wait(seconds)
            self.advance(time.monotonic() - start)
            signals.checkpoint()
            return
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self._now += float(seconds)

    def set(self, value: float) -> None:
        with self._lock:
            self._now = max(self._now, float(value))


class AnyGate:
    """A SimClock gate that is open while any of its gates is: waits in real time as the first open one does."""

    def __init__(self, *gates) -> None:
        self.gates = gates

    def active(self) -> bool:
        return any(gate.active() for gate in self.gates)

    def wait(self, seconds: float) -> None:
        for gate in self.gates:
            if gate.active():
                gate.wait(seconds)
                return
