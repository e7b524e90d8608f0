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


def test_a_long_piped_wait_prints_its_state_changes_not_every_poll():
    err = io.StringIO()
    console = Console(err=err, out=io.StringIO())
    with console.progress("waiting for qr") as bar:
        for seconds in range(0, 190 * 30, 30):  # 190 polls of one state, its waited time growing
            bar.update(f"  qr in us-west4-a: WAITING_FOR_RESOURCES (waited {seconds // 60}m{seconds % 60:02d}s)")
        bar.update("  qr in us-west4-a: PROVISIONING (waited 95m00s)")
        bar.update("  qr in us-west4-a: ACTIVE (waited 96m30s)")
    assert err.getvalue().splitlines() == ["waiting for qr", "  qr in us-west4-a: WAITING_FOR_RESOURCES (waited 0m00s)",
                                           "  qr in us-west4-a: PROVISIONING (waited 95m00s)",
                                           "  qr in us-west4-a: ACTIVE (waited 96m30s)"]


def test_a_piped_wait_ends_on_its_last_figures_and_control_characters_are_escaped():
    err = io.StringIO()
    console = Console(err=err, out=io.StringIO())
    with console.progress("step 1/40") as bar:
        bar.update("step 2/40")
        bar.update("step 40/40")
    console.error("bad value 'a\x1b[2Jb\x07'")
    assert err.getvalue().splitlines() == ["step 1/40", "step 40/40", "error: bad value 'a\\x1b[2Jb\\x07'"]


def test_a_table_aligns_its_columns_prints_cells_as_plain_text_and_never_wraps():
    out, err = io.StringIO(), io.StringIO()
    console = Console(out=out, err=err)
    long = "projects/p/locations/us-west4-a/queuedResources/" + "x" * 150
    console.table([("queued_resource", long, "ACTIVE", "$1.50"), ("node", "n-[bold]1[/bold]", "READY", "$12.00")],
                  right=(3,), indent=2)
    lines = out.getvalue().splitlines()
    assert lines == [f"  queued_resource  {long}  ACTIVE   $1.50",
                     f"  node             {'n-[bold]1[/bold]':<{len(long)}}  READY   $12.00"]
    assert err.getvalue() == ""


def test_in_json_mode_a_table_goes_to_stderr():
    out, err = io.StringIO(), io.StringIO()
    Console(output="json", out=out, err=err).table([("a", "b")])
    assert out.getvalue() == "" and err.getvalue() == "a  b\n"
