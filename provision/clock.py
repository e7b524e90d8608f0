"""Clocks: the real one, and a simulated one that dry runs share with the emulator.

Waiting code takes a clock instead of calling time.sleep, so a dry run can wait
through hours of WAITING_FOR_RESOURCES in milliseconds without branching.
"""

from __future__ import annotations

import threading
import time


class RealClock:
    """Wall-clock time; sleep really sleeps."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class SimClock:
    """Simulated time: sleep advances now() at once. Thread-safe."""

    def __init__(self, start: float = 1_767_225_600.0) -> None:  # 2026-01-01T00:00:00Z
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self._now += float(seconds)

    def set(self, value: float) -> None:
        with self._lock:
            self._now = max(self._now, float(value))
