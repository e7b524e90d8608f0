"""The engine on a thread of its own: requests come in through a queue from the HTTP server's event
loop, tokens go back through each request's listener."""

from __future__ import annotations

import logging
import queue
import threading

from trainer.serve.engine import Engine, Request, Snapshot

log = logging.getLogger("trainer.serve")


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.submitted = 0  # requests ever submitted (counted before they are queued)
        self.taken = 0  # of those, the requests the engine's thread has taken from the inbox
        # The engine's snapshot after a step with the count taken before that step, published as one tuple:
        # the requests taken since count as waiting, so that no scrape sees a request twice or not at all.
        self.view: tuple[Snapshot, int] = (Snapshot(), 0)
        self.thread = threading.Thread(target=self._run, name="moe-tpu-engine", daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def abort(self, reason: str) -> None:
        """Ends every request, queued or running, with `reason` as its error, and stops the loop, from any
        thread: for a step that will never return (a multi-host group that lost a process leaves it blocked
        in a collective), so nothing waits on the engine's thread."""
        self._stop = True
        self._wake.set()
        while True:
            try:
                self.engine.scheduler.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        self.engine.fail_all(reason)

    def submit(self, request: Request) -> None:
        """Queues a request the caller has checked (Engine.check); thread-safe."""
        self.submitted += 1
        self.inbox.put(request)
        self._wake.set()

    def counts(self) -> tuple[int, int, int]:
        """(running, waiting, cache positions in use), from one view: the engine's snapshot after its last step,
        and as waiting beside its own, every request submitted since the requests taken before that step."""
        snapshot, taken = self.view
        return snapshot.running, snapshot.waiting + self.submitted - taken, snapshot.used_positions

    def waiting(self) -> int:
        """Requests not yet in a decode slot."""
        return self.counts()[1]

    def running(self) -> int:
        return self.view[0].running

    def take(self) -> None:
        """Moves what the inbox holds to the scheduler's queue (the engine's thread, before each step)."""
        while True:
            try:
                self.engine.scheduler.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
            self.taken += 1

    def _run(self) -> None:
        while not self._stop:
            self.take()
            taken = self.taken
            if not self.engine.busy:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the server
                if self._stop:  # aborted meanwhile (`abort`): the requests have their error already
                    break
                log.exception("engine step failed")
                self.engine.fail_in_flight(f"{type(e).__name__}: {e}")
            self.view = (self.engine.snapshot, taken)
