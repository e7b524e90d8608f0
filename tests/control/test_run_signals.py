"""Signals that cannot be lost: `run`'s handlers only record (trainer/signals.py) and its loop acts at its
waits, so a signal that lands in a garbage collection, at any moment of a dry run, or during the teardown
of an earlier one, is acted on once, with the documented exit code and nothing left up. The full count
(1,000 SIGINTs and 1,000 SIGTERMs): benchmarks/run_signals.py."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from test_runner import ScriptedTarget, running, runner_for  # noqa: F401 - its cfg fixture too
from test_runner import cfg  # noqa: F401

from provision.clock import RealClock, SimClock
from provision.runs import Interrupted, Terminated, terminate_on_signals
from provision.core import Report
from trainer import signals

ROOT = Path(__file__).resolve().parents[2]


class CollectingTarget(ScriptedTarget):
    """A scripted target whose third report runs a garbage collection in the run's own thread."""

    def __init__(self, *attempts, clock, collect_at: int = 3) -> None:
        super().__init__(*attempts, clock=clock)
        self.reports = 0
        self.collect_at = collect_at

    def report(self):
        self.reports += 1
        if self.reports == self.collect_at:
            gc.collect()
        return super().report()


@pytest.mark.parametrize("sig, error, code", [(signal.SIGTERM, Terminated, 143), (signal.SIGINT, Interrupted, 130)])
def test_a_signal_that_lands_in_a_garbage_collection_is_acted_on(cfg, tmp_path, sig, error, code):  # noqa: F811
    """The handler runs inside a gc callback: an exception raised there would be 'ignored' and the run
    would go on to the end; the latch keeps it, and the next wait raises it."""
    def in_gc(phase, info):
        if phase == "start" and threading.current_thread() is threading.main_thread():
            gc.callbacks.remove(in_gc)
            os.kill(os.getpid(), sig)
            for _ in range(10_000):  # bytecodes: the handler runs here, inside the collection
                pass

    reports = [running(step, 5.0) for step in range(1, 10)] + [Report("finished", step=10, total_steps=10, loss=4.0)]
    target = CollectingTarget(reports, clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path, confirm_teardown=lambda: True)
    gc.callbacks.append(in_gc)
    try:
        with pytest.raises(error) as caught, terminate_on_signals():
            runner.run()
    finally:
        if in_gc in gc.callbacks:
            gc.callbacks.remove(in_gc)
    assert caught.value.exit_code == code and target.left() == [] and "teardown" in target.calls


def test_a_wait_wakes_at_once_when_a_signal_arrives_and_later_ones_are_ignored_once_acted_on():
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    with pytest.raises(signals.Signalled) as caught, signals.latch():
        try:
            RealClock().sleep(30)
        except signals.Signalled:
            assert time.monotonic() - start < 5  # not the 30 s asked
            signals.acted()  # tearing down from here: a second signal changes nothing
            os.kill(os.getpid(), signal.SIGINT)
            RealClock().sleep(0.05)
            SimClock().sleep(60)
            raise
    assert caught.value.exit_code == 143


def test_signals_at_random_moments_of_dry_runs_are_never_lost(tmp_path):
    """A few rounds of benchmarks/run_signals.py: the dry run's own loop on its emulated TPU VM target."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run_signals import Rounds
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    rounds = Rounds(str(tmp_path))
    try:
        verdicts = [rounds.one(sig, delay, in_gc) for sig, delay, in_gc in (
            (signal.SIGINT, 0.0, False), (signal.SIGTERM, 0.05, False), (signal.SIGINT, 0.4, True),
            (signal.SIGTERM, 0.3, False), (signal.SIGTERM, 0.6, True), (signal.SIGINT, 0.8, False))]
    finally:
        rounds.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert all(v == "acted on" or v.startswith("after the run") for v in verdicts), verdicts
    assert verdicts.count("acted on") >= 4, verdicts  # the rest: sent from a collection after the run ended


def test_a_latch_outside_the_main_thread_changes_nothing():
    """Signals are the main thread's: elsewhere the latch installs nothing and opens no pipe. (The descriptors
    compared as sets after a collection: an earlier test's garbage, a server's pipes, may close meanwhile, and
    an fd closed elsewhere is not one the latch opened.)"""
    gc.collect()
    handler, fds = signal.getsignal(signal.SIGTERM), set(os.listdir("/proc/self/fd"))

    def body():
        with signals.latch():
            signals.checkpoint()
            signals.sleep(0.01)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is handler and set(os.listdir("/proc/self/fd")) <= fds
