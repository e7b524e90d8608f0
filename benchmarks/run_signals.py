"""SIGINT and SIGTERM at random points of a dry `run`: is every one acted on, with nothing left up?

Each round is `moe-tpu run`'s own loop (provision.runs.Runner inside terminate_on_signals, as run_cmd
runs it) on the dry run's TPU VM target against the embedded emulator, in this process; the trainer is
not started (the emulated slice comes up and the run waits for a trainer), so a round costs a second
or so instead of a real training's minute. A thread sends the round's signal at a random moment; some
rounds send it from inside a garbage collection instead (a gc callback, with collections made frequent),
where a handler that raised was dropped ("Exception ignored in gc callback"). A round passes when the
run ended in the signal's own way (Interrupted, exit 130, for SIGINT; Terminated, exit 143, for SIGTERM)
with nothing of it left up, or when the signal arrived after the run had ended (it is then counted, not
lost: the process's own handler outside the run gets it). Any other end is a lost signal.

    python benchmarks/run_signals.py --rounds 1000        # 1,000 SIGINTs and 1,000 SIGTERMs
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {signal.SIGINT: ("Interrupted", 130), signal.SIGTERM: ("Terminated", 143)}
WORLD_ROUNDS = 50


class Rounds:
    """The dry run's world (one App, one emulator) and the signals that landed outside any run."""

    def __init__(self, workdir: str) -> None:
        from provision.app import App

        self.app = App(dry_run=True, workdir=workdir)
        self.app.console._err = io.StringIO()  # the runs' timelines are not what is measured
        self.cfg = self.app.load_config(str(ROOT / "examples" / "v5e-64.yaml"))
        self.output_dir = self.app.trainer_output_dir(self.cfg)  # no trainer: the run waits for one
        self.context = self.app.context(self.cfg)
        self.outside: list[int] = []
        self.armed: int | None = None  # a signal to send from the next garbage collection
        for sig in EXPECTED:
            signal.signal(sig, lambda signum, frame: self.outside.append(signum))
        gc.callbacks.append(self._in_gc)

    def _in_gc(self, phase: str, info: dict) -> None:
        if self.armed is None or threading.current_thread() is not threading.main_thread():
            return  # a handler runs in the main thread: only a collection there has it run inside
        sig, self.armed = self.armed, None
        if sig is not None:
            os.kill(os.getpid(), sig)
            sum(range(100))  # bytecodes: the handler runs here, inside the collection

    def one(self, sig: int, delay_s: float, in_gc: bool) -> str:
        """One run with `sig` sent after `delay_s` (from a garbage collection after it, with `in_gc`)."""
        from provision.errors import MoeTpuError
        from provision.kinds import for_config
        from provision.runs import Runner, terminate_on_signals

        target = for_config(self.context, output_dir=self.output_dir)
        runner = Runner(self.context, target, output_dir=self.output_dir, confirm_teardown=lambda: True)
        outside_before = len(self.outside)

        def send() -> None:
            time.sleep(delay_s)
            if in_gc:
                self.armed = sig
            else:
                os.kill(os.getpid(), sig)

        sender = threading.Thread(target=send, daemon=True)
        ended = None
        try:
            with terminate_on_signals():  # as run_cmd: the latch first, then the run
                sender.start()
                runner.run()
        except MoeTpuError as exc:
            ended = (type(exc).__name__, exc.exit_code)
        finally:
            sender.join()
        while in_gc and self.armed is not None:  # still armed: the run ended first; collect to send it
            gc.collect()
        left = target.left()
        if left:
            return "left up: " + ", ".join(r.name for r in left)
        if ended == EXPECTED[sig]:
            return "acted on"
        if len(self.outside) > outside_before:
            return "after the run" if ended is None else f"after the run, which ended {ended}"
        return f"LOST (the run ended {ended or 'normally'})"

    def close(self) -> None:
        gc.callbacks.remove(self._in_gc)
        self.app.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1000, help="SIGINTs, and as many SIGTERMs")
    parser.add_argument("--max-delay", type=float, default=1.5, help="seconds: each signal's moment is uniform "
                                                                     "in [0, this)")
    parser.add_argument("--gc-share", type=float, default=0.25, help="the share sent from a garbage collection")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    gc.set_threshold(100, 5, 5)  # frequent collections: signals land in them
    counts: Counter[tuple[str, str]] = Counter()
    start = time.perf_counter()
    for first in range(0, 2 * args.rounds, WORLD_ROUNDS):
        # A fresh emulated world every WORLD_ROUNDS rounds: its state file grows with every operation,
        # and with it the cost of each call (rounds of a long run slowed several-fold).
        with tempfile.TemporaryDirectory() as workdir:
            rounds = Rounds(workdir)
            try:
                for i in range(first, min(first + WORLD_ROUNDS, 2 * args.rounds)):
                    sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
                    verdict = rounds.one(sig, rng.uniform(0, args.max_delay), rng.random() < args.gc_share)
                    counts[(signal.Signals(sig).name, verdict)] += 1
                    if verdict.startswith(("LOST", "left up")):
                        print(f"round {i}: {signal.Signals(sig).name}: {verdict}", file=sys.stderr)
                    if (i + 1) % 100 == 0:  # a long run's progress, in case it is cut short
                        print(f"{i + 1} signals in {time.perf_counter() - start:.0f} s: {dict(counts)}",
                              file=sys.stderr, flush=True)
            finally:
                rounds.close()
    took = time.perf_counter() - start
    for (name, verdict), n in sorted(counts.items()):
        print(f"{name:8} {verdict:40} {n:5}")
    bad = sum(n for (_, verdict), n in counts.items() if verdict.startswith(("LOST", "left up")))
    print(f"{2 * args.rounds} signals in {took:.0f} s: {bad} lost or left up")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
