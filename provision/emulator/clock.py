"""A clock that runs at a multiple of real time, for `moe-tpu emulator serve --speed X`."""

from __future__ import annotations

import threading
import time


class ScaledClock:
    """now() advances `speed` simulated seconds per real second; sleep(s) takes s/speed real seconds."""

    def __init__(self, speed: float = 1.0, start: float | None = None) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = float(speed)
        self._start = time.time() if start is None else float(start)
        self._real0 = time.monotonic()
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._start + (time.monotonic() - self._real0) * self.speed

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.speed)

    def set(self, value: float) -> None:
        """Jump forward to `value` (never back), like SimClock.set."""
        with self._lock:
            current = self._start + (time.monotonic() - self._real0) * self.speed
            if value > current:
                self._start += value - current
