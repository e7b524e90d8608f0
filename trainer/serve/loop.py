"""The engine on a thread of its own: requests come in through a queue from the HTTP server's event
loop, tokens go back through each request's listener."""

from __future__ import annotations

import logging
import queue
import threading

from trainer.serve.engine import Engine, Request

log = logging.getLogger("trainer.serve")


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
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
        self.inbox.put(request)
        self._wake.set()

    def waiting(self) -> int:
        """Requests not yet in a decode slot (the engine's as of its last step: its snapshot)."""
        return self.inbox.qsize() + self.engine.snapshot.waiting

    def running(self) -> int:
        return self.engine.snapshot.running

    def _run(self) -> None:
        while not self._stop:
            while True:
                try:
                    self.engine.scheduler.waiting.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
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
