"""Retry and polling policy, on the simulated clock (no real sleeping)."""

import itertools

import pytest
from google.api_core import exceptions as gexc

from provision.clock import SimClock
from provision.cloud.api import is_transient
from provision.errors import CloudError
from provision.waiting import PollPolicy, RetryPolicy, call_with_retry, format_duration, poll


def test_poll_backs_off_to_the_cap_and_stops_at_the_terminal_state():
    clock = SimClock(start=0)
    fetch_times = []
    states = iter(["WAITING"] * 30 + ["ACTIVE"] + ["NEVER-READ"])

    def fetch():
        fetch_times.append(clock.now())
        return next(states)

    result = poll(fetch, lambda s: s == "ACTIVE", clock, timeout_s=10 * 3600,
                  policy=PollPolicy(initial_s=5, factor=1.5, cap_s=60, jitter=0.0))
    assert result == "ACTIVE"
    assert len(fetch_times) == 31  # not one poll after the terminal state
    gaps = [b - a for a, b in itertools.pairwise(fetch_times)]
    assert gaps[0] == pytest.approx(5.0, abs=0.01)
    assert gaps[1] == pytest.approx(7.5, abs=0.01)
    assert max(gaps) == pytest.approx(60.0, abs=0.01)
    assert all(b >= a - 1e-6 for a, b in itertools.pairwise(gaps))  # never shrinks


def test_poll_gives_up_after_the_timeout_with_a_hint():
    clock = SimClock(start=0)
    with pytest.raises(CloudError) as info:
        poll(lambda: "WAITING", lambda s: False, clock, timeout_s=3600, what="queued resource x")
    assert "gave up waiting for queued resource x after 1h00m" in info.value.message
    assert "moe-tpu down" in info.value.hint
    assert 3600 <= clock.now() < 3600 + 61


def test_transient_errors_are_retried_with_backoff_on_the_clock():
    clock = SimClock(start=0)
    attempts = []

    def flaky():
        attempts.append(clock.now())
        if len(attempts) < 4:
            raise gexc.ServiceUnavailable("try again")
        return "done"

    policy = RetryPolicy(attempts=8, initial_s=1, max_s=60)
    assert call_with_retry(flaky, clock, policy, transient=is_transient) == "done"
    assert len(attempts) == 4
    assert clock.now() > 0  # it waited, on the simulated clock


def test_retries_stop_after_the_attempt_budget():
    clock = SimClock(start=0)
    calls = []

    def always_down():
        calls.append(1)
        raise gexc.DeadlineExceeded("slow")

    with pytest.raises(gexc.DeadlineExceeded):
        call_with_retry(always_down, clock, RetryPolicy(attempts=3), transient=is_transient)
    assert len(calls) == 3


def test_chip_quota_is_not_transient_but_a_rate_limit_is():
    chip = gexc.ResourceExhausted("Quota limit 'TPUV5sLitepodPerProjectPerZoneForTPUAPI' has been exceeded.")
    rate = gexc.ResourceExhausted("Quota exceeded for quota metric 'tpu.googleapis.com/qps/create'")
    assert not is_transient(chip)
    assert is_transient(rate)
    assert is_transient(gexc.InternalServerError("boom"))
    assert not is_transient(gexc.InvalidArgument("bad"))
    calls = []

    def quota():
        calls.append(1)
        raise chip

    with pytest.raises(gexc.ResourceExhausted):
        call_with_retry(quota, SimClock(start=0), transient=is_transient)
    assert len(calls) == 1


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (59, "59s"), (61, "1m01s"), (3600, "1h00m"),
                                          (3 * 3600 + 125, "3h02m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
