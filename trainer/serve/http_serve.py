"""The serving process's HTTP half: uvicorn on the given socket in front of the engine's loop, the steps compiled
on a thread meanwhile, draining on SIGTERM within the grace period, and a multi-host group's failure handled
once (trainer/serve/cli.py parses the command line and loads the model; this runs it).

Exit codes: 0 stopped by a signal; 1 a runtime failure (compiling, listening, the group).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import click

from trainer.serve.loop import STEP_TIMEOUT_S
from trainer.serve.stopping import Stop, Stopped
from trainer.serve.streams import STREAM_INTERVAL

EXIT_RUNTIME = 1
# How long /health answers 503 after a multi-host group failed, before the process exits (probes see why).
FAILED_HEALTH_S = 5.0


def progress(message: str) -> None:
    click.echo(f"serve: {message}", err=True)


def compile_ahead_thread(engine, between) -> threading.Thread:
    """A thread compiling the engine's programs not compiled yet (Engine.compile_ahead), saying when it is done;
    a failure is said, not raised: each program then compiles when a step first needs it."""
    from trainer.serve.stopping import Stopped

    def run():
        started = time.perf_counter()
        try:
            count = engine.compile_ahead(between)
        except Stopped:
            return
        except Exception as e:  # noqa: BLE001 - the steps compile what is missing when they reach it
            progress(f"compiling ahead failed ({type(e).__name__}: {e}); each step compiles its program when "
                      "first needed")
            return
        progress(f"compiled the other {count} programs in the background in {time.perf_counter() - started:.1f}s")

    thread = threading.Thread(target=run, name="moe-tpu-compile-ahead", daemon=True)
    thread.start()
    return thread


def serve_http(loaded, sock: socket.socket, host: str, port: int, max_waiting: int, template, name: str,
               grace_seconds: float, leader=None, warm_up: str = "all", stream_interval: float = STREAM_INTERVAL,
               step_timeout: float = STEP_TIMEOUT_S, stop: Stop | None = None) -> int:
    """Serves `loaded` on `sock` until a signal (exit code 0) or a failure (1): the HTTP server answers at once
    (/health 503 meanwhile) while a thread compiles the engine's steps, then starts the engine's loop."""
    import uvicorn

    from trainer.serve.server import create_app, http_protocol

    state = server_state(loaded, name, max_waiting, template, stream_interval)
    # uvicorn's own limit is a backstop past ours: by then every open request has had its error (expire).
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", http=http_protocol(),
                            timeout_graceful_shutdown=grace_seconds + 5, lifespan="off")
    stop = stop or Stop().install()
    server = draining_server(config, state, grace_seconds, stop)
    warm = Warming(loaded, state, server, stop, warm_up, step_timeout, f"{name} at http://{host}:{port}/v1",
                   watch_group(leader, state, server) if leader is not None else None)
    compiling = threading.Thread(target=warm.run, name="moe-tpu-compile", daemon=True)
    compiling.start()
    # uvicorn raises the signal it stopped for again once it has shut down, for the handler it found (`stop`'s,
    # which notes it): with the default one SIGTERM would end the process by the signal, not with exit code 0.
    try:
        server.run(sockets=[sock])
    finally:
        if state.loop is not None:
            state.loop.stop()
    compiling.join(timeout=0.5)  # stopped between two programs: it ends at once
    if compiling.is_alive():  # stopped while XLA compiles: exiting past it aborts the process (SIGABRT, 134)
        progress("stopped before the steps were compiled")
        if leader is not None:
            leader.stop(timeout=0)
        exit_past_threads(0)
    return finished(warm, server, leader, host, port)


def server_state(loaded, name: str, max_waiting: int, template, stream_interval: float):
    """The HTTP front end's state for the loaded model (its engine's loop is set once the steps compiled)."""
    from trainer.serve.server import ServerState

    state = ServerState(name, encode=loaded.encode, decode=loaded.decode, max_waiting=max_waiting,
                        eos_token=loaded.eos_token, tokenizer_class=loaded.tokenizer_class,
                        tokenizer=loaded.tokenizer, stream_interval=stream_interval)
    if template is not None:
        state.chat_template = template
    return state


class Warming:
    """Compiles the engine's steps on a thread of its own while the server already answers, then starts the
    engine's loop; a signal stops it between programs, a failure is kept for the exit code."""

    def __init__(self, loaded, state, server, stop: Stop, warm_up: str, step_timeout: float, where: str,
                 on_failed_step):
        self.loaded, self.state, self.server, self.stop = loaded, state, server, stop
        self.warm_up, self.step_timeout, self.where, self.on_failed_step = warm_up, step_timeout, where, on_failed_step
        self.failed: list[str] = []
        self.ahead: list[threading.Thread] = []  # the programs compiling while it serves (--warm-up background)

    def _listening(self, timeout: float = 60.0) -> None:
        """Waits (at most `timeout`) until uvicorn has started on the socket: a warm-up quicker than uvicorn's
        own start (a warm cache, a small model) said "ready" while a request to the address was still refused."""
        deadline = time.monotonic() + timeout
        while not self.server.started and not self.server.should_exit and time.monotonic() < deadline:
            self.stop.check()
            time.sleep(0.01)

    def run(self) -> None:
        from trainer.serve.loop import EngineLoop

        engine = self.loaded.engine
        try:
            started = time.perf_counter()
            every_span = self.warm_up == "all"
            progress(f"compiling the prefill and decode steps ({engine.slots} slots x {engine.max_len} tokens, "
                     f"{'every span' if every_span else 'the first span'})")
            engine.warm_up(every_span, self.stop.check)
            self.stop.check()
            self.state.loop = EngineLoop(engine, step_timeout=self.step_timeout,
                                         on_failed_step=self.on_failed_step).start()
            progress(f"compiled in {time.perf_counter() - started:.1f}s")
            self._listening()
            progress(f"ready: {self.where} (health /health, metrics /metrics)")
            if self.warm_up == "background":
                self.ahead.append(compile_ahead_thread(engine, self.stop.check))
        except Stopped:  # a signal before uvicorn took its own handlers: the server stops, nothing served
            self.server.should_exit = True
        except Exception as e:  # noqa: BLE001 - reported, and the server stops with exit code 1
            self.failed.append(f"{type(e).__name__}: {e}")
            self.server.should_exit = True


def finished(warm: Warming, server, leader, host: str, port: int) -> int:
    """The exit code once the server has stopped, the group told to stop with it."""
    if warm.state.loop is None and not warm.failed and warm.stop.signal is not None:
        progress("stopped before the steps were compiled")
        if leader is not None:
            leader.stop(timeout=0)
        return 0
    code = 0
    if warm.failed:
        click.echo(f"serve: compiling failed: {warm.failed[0]}", err=True)
        code = EXIT_RUNTIME
    elif not server.started:
        click.echo(f"serve: cannot listen on {host}:{port}", err=True)
        code = EXIT_RUNTIME
    if leader is not None:
        stop_group(leader, code)
    if not code:
        progress("stopped")
    if warm.ahead:  # stopped at its next program; inside XLA's compiler, exiting past it would abort the process
        warm.ahead[0].join(timeout=0.5)
        if warm.ahead[0].is_alive():
            exit_past_threads(code)
    return code


def exit_past_threads(code: int) -> None:
    """Exits now, past a thread inside XLA's compiler (waiting for it at exit would abort the process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_group(leader, code: int) -> None:
    """Tells the workers to stop; exits at once (past jax's exit handlers, whose barrier would wait for them)
    unless they all did and this process ends well."""
    from trainer.serve import multihost

    if leader.stop():
        progress(f"stopped the group's {len(leader.workers)} worker(s)")
        if not code:
            return
    else:
        progress(f"the group's workers did not stop within {multihost.STOP_TIMEOUT_S:g} s")
    multihost.exit_now(code or EXIT_RUNTIME)


def watch_group(leader, state, server):
    """Hands the channel's watchdog the engine's progress (a group whose step is stuck fails) and the group's
    failure, which it returns for the engine's loop (a step that raised on the leader fails the group too)."""
    leader.stuck = lambda: state.loop.stuck() if state.loop is not None else None
    leader.on_failure = lambda reason: group_failed(state, reason, server)
    return leader.on_failure


FAILING = threading.Lock()


def group_failed(state, reason: str, server) -> None:
    """The multi-host group cannot step any more (a process gone or not stepping, found by the channel's
    watchdog, or a step that raised on the engine's thread); the first call acts, once: the engine's thread is
    told to fail every request (it does when its step returns), the server ends the open ones now on its event
    loop, /health answers 503 for FAILED_HEALTH_S so that probes see why, then the process exits 1 without
    waiting for the engine's thread, which a step blocked in a collective holds for good."""
    from trainer.serve import multihost

    if not FAILING.acquire(blocking=False):
        return
    progress(f"{reason}: the group cannot go on; failing every request and exiting")
    state.failed = reason
    state.draining = True
    if state.loop is not None:
        state.loop.fail(f"the serving group failed: {reason}")
    if server.event_loop is not None:
        server.event_loop.call_soon_threadsafe(state.expire)
    time.sleep(FAILED_HEALTH_S)
    multihost.exit_now(EXIT_RUNTIME)


def draining_server(config, state, grace_seconds: float, stop: Stop):
    """uvicorn's server for `state`. On SIGTERM/SIGINT uvicorn closes its socket and waits for the connections in
    flight; this one also answers 503 to requests arriving meanwhile on connections kept alive, and when the
    grace period runs out ends the requests still open with an error (an event on a stream) rather than
    dropping their connections, in one line of its log. The signal handler only sets flags; what follows runs
    on the event loop."""
    import asyncio

    import uvicorn

    def grace_ran_out():
        cut = state.expire()
        if cut:
            progress(f"--grace-seconds {grace_seconds:g} ran out: {cut} request(s) still running ended with an "
                      "error")

    class DrainingServer(uvicorn.Server):
        event_loop = None  # the server's, once it starts: where other threads hand it work

        def handle_exit(self, sig, frame):
            state.draining = True
            stop.note(sig)  # the warm-up, if it still runs, stops at its next program
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            self.event_loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if stop.signal is not None:  # it came before these handlers were installed
                self.should_exit = True

        async def shutdown(self, sockets=None):
            progress("stopping: no new requests; finishing those in flight")
            cutoff = asyncio.get_running_loop().call_later(grace_seconds, grace_ran_out)
            try:
                await super().shutdown(sockets)
            finally:
                cutoff.cancel()

    return DrainingServer(config)
