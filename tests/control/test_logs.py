"""`moe-tpu logs`: what it reads from the run's output directory and prints, and `--follow`'s waits,
on a clock the test gives it (the command itself runs end to end in test_run.py)."""

from __future__ import annotations

import io

from provision.cli import logs_cmd
from provision.console import Console


class Clock:
    """Simulated time that counts its waits: each one lets the scripted trainer write more."""

    def __init__(self) -> None:
        self.t, self.waits = 0.0, []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.t += seconds


def output_dir(clock: Clock, states: list[tuple[int, list[str], str]]):
    """read(name, reader) over an output directory that is at states[i] after i waits: (metric rows,
    trainer output lines, state)."""

    def read(name: str, reader):
        rows, lines, state = states[min(len(clock.waits), len(states) - 1)]
        return {"metrics.jsonl": [{"step": s, "loss": 1.0 / s} for s in range(1, rows + 1)],
                "trainer.log": "".join(f"{line}\n" for line in lines),
                "status.json": {"state": state, "step": rows}}[name]
    return read


def console() -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(out=out, err=err), out, err


def test_follow_prints_each_new_row_and_line_once_and_waits_on_the_clock_until_the_trainer_ends():
    clock = Clock()
    read = output_dir(clock, [(3, ["a"], "running"), (4, ["a", "b"], "running"),
                              (5, ["a", "b", "c"], "finished")])
    con, out, err = console()
    seen = logs_cmd.read_output(read, None, con, clock, follow=True, tail=2)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["2", "3", "4", "5"]
    assert err.getvalue().splitlines() == ["a", "b", "c"]
    assert clock.waits == [logs_cmd.FOLLOW_INTERVAL_S] * 2 and seen.status["state"] == "finished"
    assert len(seen.rows) == 5 and seen.text == "a\nb\nc\n"


def test_without_follow_it_reads_once_and_never_waits():
    clock = Clock()
    con, out, err = console()
    seen = logs_cmd.read_output(output_dir(clock, [(3, ["a"], "running")]), None, con, clock, follow=False, tail=0)
    assert clock.waits == [] and seen.status["state"] == "running"
    assert len(out.getvalue().splitlines()) == 3 and err.getvalue() == ""  # the caller prints the output's tail


def test_a_gke_run_reads_the_pods_log_before_the_output_directorys():
    clock = Clock()
    con, _, err = console()
    seen = logs_cmd.read_output(output_dir(clock, [(1, ["file"], "finished")]), lambda: "pod line\n", con, clock,
                                follow=True, tail=0)
    assert err.getvalue().splitlines() == ["pod line"] and seen.text == "pod line\n"
