"""The engine's scheduler: admission in arrival order into free slots, one request prefilled at a time, slots
freed on release, cancelled requests taken out wherever they are."""

from trainer.serve.engine import Request
from trainer.serve.scheduler import Scheduler


def test_requests_are_admitted_in_order_into_free_slots_one_prefill_at_a_time():
    s = Scheduler(2)
    a, b, c = (Request([1, 2]) for _ in range(3))
    s.waiting.extend([a, b, c])
    assert s.next_prefill() is a and a.slot == 0
    assert s.next_prefill() is a  # still being prefilled: no other starts
    s.start_decoding(a)
    assert s.next_prefill() is b and b.slot == 1
    s.start_decoding(b)
    assert s.next_prefill() is None and s.waiting[0] is c  # no slot free
    a.output.append(5)
    assert s.used_positions() == 2 + 1 + 2
    assert s.release(a) == 0 and s.next_prefill() is c and c.slot == 0
    assert s.release(a) is None  # released once


def test_a_request_takes_the_lowest_free_slot():
    """So the slots in use stay the first ones, and a decode step runs their rows alone."""
    s = Scheduler(3)
    a, b, c, d = (Request([1]) for _ in range(4))
    s.waiting.extend([a, b, c])
    for _ in range(3):
        s.start_decoding(s.next_prefill())
    s.release(b)
    s.release(a)
    s.waiting.append(d)
    assert s.next_prefill() is d and d.slot == 0


def test_cancelled_requests_leave_the_queue_the_prefill_and_the_slots():
    s = Scheduler(2)
    running, admitting, queued, kept = (Request([1]) for _ in range(4))
    s.waiting.extend([running, admitting, queued, kept])
    s.start_decoding(s.next_prefill())
    assert s.next_prefill() is admitting
    for req in (running, admitting, queued):
        req.cancelled = True
    assert set(map(id, s.cancelled())) == {id(running), id(admitting), id(queued)}
    assert s.admitting is None and list(s.waiting) == [kept]
    for req in (running, admitting):
        s.release(req)
    assert sorted(s.free) == [0, 1] and not s.active and s.busy
