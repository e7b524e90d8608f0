"""The engine's scheduler: which request is admitted into which decode slot (the lowest free one, so that the
slots in use stay the first ones and a decode step runs those rows alone: trainer.serve.runner's rows_for), in
arrival order, one prefill chunk a step; which are running; freeing a slot when its request ends or is
cancelled.

It holds requests, never arrays: trainer.serve.runner runs what it picks.
"""

from __future__ import annotations

import collections
import heapq


class Scheduler:
    def __init__(self, slots: int):
        self.slots = slots
        self.waiting: collections.deque = collections.deque()
        self.admitting = None  # the request being prefilled, chunk by chunk
        self.active: dict[int, object] = {}  # slot -> request decoding there
        self.free = list(range(slots))  # a heap: the lowest first

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.admitting or self.active)

    def next_prefill(self):
        """The request whose next chunk this step prefills (the one being admitted, else the first waiting one
        when a slot is free, which it takes: the lowest), or None."""
        if self.admitting is None and self.waiting and self.free:
            self.admitting = self.waiting.popleft()
            self.admitting.slot = heapq.heappop(self.free)
        return self.admitting

    def start_decoding(self, req) -> None:
        """The request's prompt is in the cache: it decodes in its slot from the next step."""
        self.admitting = None
        self.active[req.slot] = req

    def release(self, req) -> int | None:
        """Frees the request's slot; returns it (None: it had none)."""
        slot = req.slot
        if slot is None:
            return None
        if self.admitting is req:
            self.admitting = None
        self.active.pop(slot, None)
        heapq.heappush(self.free, slot)
        req.slot = None
        return slot

    def cancelled(self) -> list:
        """The requests cancelled since the last step, taken out of the queue and the slots' hold."""
        gone = [r for r in (*self.active.values(), self.admitting, *self.waiting) if r is not None and r.cancelled]
        for req in gone:
            if req is self.admitting:
                self.admitting = None
            elif req in self.waiting:
                self.waiting.remove(req)
        return gone

    def in_flight(self) -> list:
        """The requests holding a slot (decoding or being prefilled)."""
        return [*self.active.values(), *([self.admitting] if self.admitting is not None else [])]

    def used_positions(self) -> int:
        """Cache positions holding live requests' tokens (the KV cache usage)."""
        held = sum(len(r.prompt) + len(r.output) for r in self.active.values())
        return held + (self.admitting.prefilled if self.admitting else 0)
