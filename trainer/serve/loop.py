"""The engine on a thread of its own: requests come in through a queue from the HTTP server's event
loop, tokens go back through each request's listener.

Only the engine's thread touches the engine (its scheduler, its runner). Other threads signal it: `submit`
queues a request, `stop` and `fail` ask it to end, and it acts at its next turn. It publishes its progress,
the time it last completed a step or found nothing to do (`progress`), from which `stuck` tells a step that
never returns (a multi-host group whose collective waits for a process that does not step) from one that
is merely long."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported: the command line reads STEP_TIMEOUT_S before jax may load
    from trainer.serve.engine import Engine, Request, Snapshot

log = logging.getLogger("trainer.serve")

IDLE_TICK_S = 1.0  # an idle engine's thread marks its progress this often
STEP_TIMEOUT_S = 20.0  # `serve --step-timeout`'s default: a step running longer is stuck
# A step that compiles a program (one a request reaches first, not compiled yet by the warm-up or ahead of it)
# may take minutes.
COMPILE_TIMEOUT_S = 900.0


class EngineLoop:
    """`on_failed_step(reason)`: called on the engine's thread when a step raises, after every request has
    failed with `reason`, and the loop ends (a multi-host group, whose processes cannot step apart); without
    it, a failed step fails the requests it held and the loop goes on."""

    def __init__(self, engine: Engine, *, step_timeout: float = STEP_TIMEOUT_S,
                 on_failed_step: Callable[[str], None] | None = None):
        self.engine, self.step_timeout, self.on_failed_step = engine, step_timeout, on_failed_step
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._failure: str | None = None  # set by `fail`: the engine's thread fails every request with it
        self.progress = time.monotonic()  # the last step completed, or the last turn with nothing to do
        self._first_calls = engine.runner.first_calls  # the runner's compiling calls when the step under way began
        self.submitted = 0  # requests ever submitted (counted before they are queued)
        self.taken = 0  # of those, the requests the engine's thread has taken from the inbox
        # The engine's snapshot after a step with the count taken before that step, published as one tuple:
        # the requests taken since count as waiting, so that no scrape sees a request twice or not at all.
        self.view: tuple[Snapshot, int] = (engine.snapshot, 0)
        # The count taken before the step under way: a snapshot the engine publishes within it (a request ended)
        # pairs with it, as every request taken by then is in the engine's own counts (start: the loop that
        # steps the engine hears its snapshots).
        self._step_taken = 0
        self.thread = threading.Thread(target=self._run, name="moe-tpu-engine", daemon=True)

    def start(self) -> EngineLoop:
        self.progress = time.monotonic()
        self.engine.on_publish = lambda snapshot: setattr(self, "view", (snapshot, self._step_taken))
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def fail(self, reason: str) -> None:
        """Asks the engine's thread, from any thread, to end every request, queued or running, with `reason` as
        its error and to stop: at once when idle, after the step under way otherwise (a step that never returns
        keeps them: the caller ends the process)."""
        self._failure = self._failure or reason
        self._stop = True
        self._wake.set()

    def stuck(self, now: float | None = None) -> str | None:
        """Why the engine counts as stuck, or None: no step completed for --step-timeout seconds while it had
        work (COMPILE_TIMEOUT_S for a step that compiles a program); any thread may ask."""
        waited = (time.monotonic() if now is None else now) - self.progress
        compiling = self.engine.runner.first_calls > self._first_calls
        limit = COMPILE_TIMEOUT_S if compiling else self.step_timeout
        if waited <= limit:
            return None
        return (f"no engine step completed for {waited:.0f} s (" +
                (f"a step that compiles may take {limit:g} s)" if compiling else f"--step-timeout {limit:g} s)"))

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
            taken = self._step_taken = self.taken
            if not self.engine.busy:
                self.progress = time.monotonic()
                self._wake.wait(min(IDLE_TICK_S, self.step_timeout / 4))
                self._wake.clear()
                continue
            self._first_calls = self.engine.runner.first_calls
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the server
                if self._on_failed_step(e):
                    return
            else:
                self.progress = time.monotonic()
            self.view = (self.engine.snapshot, taken)
        if self._failure is not None:
            self.take()
            self.engine.fail_all(self._failure)

    def _on_failed_step(self, e: Exception) -> bool:
        """Fails the requests of a step that raised; True when the loop ends with it."""
        reason = f"{type(e).__name__}: {e}"
        if self._failure is None and self.on_failed_step is None:
            log.exception("engine step failed")
            self.engine.fail_in_flight(reason)
            self.progress = time.monotonic()
            return False
        if self._failure is None:
            log.exception("engine step failed")
        self.take()
        self.engine.fail_all(self._failure or reason)
        if self._failure is None:
            self.on_failed_step(reason)
        return True
