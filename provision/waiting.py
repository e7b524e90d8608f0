"""Retrying calls and polling long waits, on an injected clock.

Retries: the failures the caller's predicate calls transient (for the Google APIs,
provision.cloud.api.is_transient) back off exponentially with full jitter; any other
fails at once.

Polling: the interval grows geometrically to a cap (about a minute) and the
loop stops at the first terminal state, so nothing is polled after the end.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from provision.errors import WaitTimeout

T = TypeVar("T")

@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8
    initial_s: float = 1.0
    max_s: float = 60.0


def call_with_retry(fn: Callable[[], T], clock, policy: RetryPolicy = RetryPolicy(),
                    on_retry: Callable[[int, BaseException], None] | None = None, *,
                    transient: Callable[[BaseException], bool]) -> T:
    """Run fn, retrying the failures `transient` accepts with exponential backoff and full jitter (tenacity)."""
    import tenacity

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry and state.outcome is not None:
            on_retry(state.attempt_number, state.outcome.exception())

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(transient),
        wait=tenacity.wait_random_exponential(multiplier=policy.initial_s, max=policy.max_s),
        stop=tenacity.stop_after_attempt(policy.attempts),
        sleep=clock.sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(fn)


@dataclass(frozen=True)
class PollPolicy:
    initial_s: float = 5.0
    factor: float = 1.5
    cap_s: float = 60.0
    jitter: float = 0.1


def poll(fetch: Callable[[], T], done: Callable[[T], bool], clock, *, timeout_s: float,
         describe: Callable[[T, float], str] | None = None, progress=None,
         policy: PollPolicy = PollPolicy(), what: str = "the resource") -> T:
    """Fetch until done(value) or timeout_s passes on `clock`; returns the last value fetched.
    `describe(value, elapsed)` is the progress line for a value (None: the line stays as it is)."""
    start = clock.now()
    interval = policy.initial_s
    rng = random.Random(0)
    while True:
        value = fetch()
        elapsed = clock.now() - start
        line = describe(value, elapsed) if progress is not None and describe is not None else None
        if line is not None:
            progress.update(line)
        if done(value):
            return value
        if elapsed >= timeout_s:
            raise WaitTimeout(f"gave up waiting for {what} after {format_duration(elapsed)}",
                             hint="raise slice.max_wait, or run `moe-tpu down` to stop paying for it")
        step = min(interval, policy.cap_s) * (1 + rng.uniform(-policy.jitter, policy.jitter))
        clock.sleep(min(step, max(0.0, timeout_s - elapsed) + 0.001))
        interval = min(interval * policy.factor, policy.cap_s)


def format_duration(seconds: float | timedelta, *, exact: bool = False) -> str:
    """Seconds (or a timedelta) for people: "1h05m", "3m04s", "42s" (to the minute past an hour). `exact`:
    the config file's syntax, every unit that is not zero ("1h5m", "90s" -> "1m30s"), which
    provision.config.parse_duration reads back."""
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if exact:
        return "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n) or "0s"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
