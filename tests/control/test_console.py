"""The one object that prints: plain lines when piped, a live status line on a terminal, JSON alone on stdout."""

from __future__ import annotations

import io
import json

from provision.console import Console


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_progress_is_one_plain_line_per_change():
    err = io.StringIO()
    console = Console(err=err, out=io.StringIO())
    with console.progress("waiting") as bar:
        bar.update("waiting")
        bar.update("state A")
        bar.update("state A")
        bar.update("state B")
    assert err.getvalue().splitlines() == ["waiting", "state A", "state B"]
    assert "\x1b" not in err.getvalue()


def test_a_terminal_gets_a_live_status_line_that_ends_on_the_last_state(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    err = Terminal()
    console = Console(err=err, out=io.StringIO())
    with console.progress("waiting") as bar:
        bar.update("state A")
        bar.update("state B")
    text = err.getvalue()
    assert "\x1b[" in text  # drawn in place with control sequences, not one line per change
    assert text.rstrip().splitlines()[-1].endswith("state B")
    assert text.count("state A\n") == 0


def test_json_mode_keeps_stdout_for_the_document():
    out, err = io.StringIO(), io.StringIO()
    console = Console(output="json", err=err, out=out)
    console.text("a result line")
    console.warn("careful")
    with console.progress("waiting") as bar:
        bar.update("done")
    console.emit({"result": "ok"})
    assert json.loads(out.getvalue()) == {"result": "ok"}
    assert err.getvalue().splitlines() == ["a result line", "warning: careful", "waiting", "done"]
