"""The one object that prints: messages and progress on stderr, the result on stdout.

Output goes through `rich`: on a terminal, colours and a live status line for long waits;
piped, plain lines (one per change of a progress line), so logs and tests read the same.
In JSON mode stdout holds exactly one JSON document, written by `emit`; everything else goes
to stderr so scripts can parse stdout. rich is imported on first output, not at start-up.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO


class Console:
    def __init__(self, output: str = "text", verbose: int = 0,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.output = output
        self.verbose = verbose
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._rich_err = None
        self.emitted = False  # the command's JSON document is out; an error must not print another

    @property
    def json_mode(self) -> bool:
        return self.output == "json"

    @property
    def interactive(self) -> bool:
        """A person watches stderr: live status lines instead of one line per change."""
        return self._err.isatty() and os.environ.get("TERM") != "dumb"

    def _stderr(self):
        if self._rich_err is None:
            from rich.console import Console as RichConsole

            self._rich_err = RichConsole(file=self._err, highlight=False, soft_wrap=True,
                                         no_color="NO_COLOR" in os.environ or None)
        return self._rich_err

    def _print(self, message: str, style: str | None = None, prefix: tuple[str, str] | None = None) -> None:
        from rich.text import Text

        text = Text()
        if prefix:
            text.append(prefix[0], style=prefix[1])
        text.append(_printable(message), style=style)
        self._stderr().print(text)

    def info(self, message: str) -> None:
        self._print(message)

    def detail(self, message: str) -> None:
        if self.verbose:
            self._print(message, style="dim")

    def warn(self, message: str) -> None:
        self._print(message, prefix=("warning: ", "yellow"))

    def error(self, message: str, hint: str | None = None) -> None:
        self._print(message, prefix=("error: ", "bold red"))
        if hint:
            self._print(hint, prefix=("hint: ", "cyan"))

    def text(self, message: str) -> None:
        """A line of the command's result: stdout in text mode, stderr in JSON mode."""
        if self.json_mode:
            self._print(message)
        else:
            print(message, file=self._out, flush=True)

    def table(self, rows: list[tuple[str, ...]], *, right: tuple[int, ...] = (), indent: int = 0) -> None:
        """Rows of cells as aligned columns (`table_lines`), each line a line of the result (`text`)."""
        for line in table_lines(rows, right=right):
            self.text(" " * indent + line)

    def emit(self, document: dict[str, Any]) -> None:
        """The JSON document of a command (JSON mode only)."""
        if self.json_mode:
            self.emitted = True
            json.dump(document, self._out, indent=2, sort_keys=False, default=str)
            self._out.write("\n")
            self._out.flush()

    @contextlib.contextmanager
    def progress(self, message: str) -> Iterator[Progress]:
        """A status line for a long wait: live on a terminal, else one line per change."""
        bar = Progress(self, message)
        try:
            yield bar
        finally:
            bar.close()


def table_lines(rows: list[tuple[str, ...]], *, right: tuple[int, ...] = (), min_widths: tuple[int, ...] = (),
                gap: int = 2) -> list[str]:
    """Rows of cells as the lines of a table laid out by rich (no borders, no header, `gap` spaces
    between columns; the columns numbered in `right` aligned right, column i at least min_widths[i]
    wide). Cells are plain text, never markup; a line never wraps, whatever the terminal's width,
    and ends without trailing spaces."""
    if not rows:
        return []
    from rich.console import Console as RichConsole
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, gap))
    for column in range(max(len(row) for row in rows)):
        grid.add_column(justify="right" if column in right else "left", no_wrap=True,
                        min_width=min_widths[column] if column < len(min_widths) else None)
    for row in rows:
        grid.add_row(*(Text(_printable(cell)) for cell in row))
    buffer = io.StringIO()
    RichConsole(file=buffer, width=TABLE_WIDTH, color_system=None, highlight=False, emoji=False).print(grid)
    return [line.rstrip() for line in buffer.getvalue().splitlines()]


def _printable(message: str) -> str:
    """The message with terminal control characters escaped (a value from a file or the command line
    never moves the cursor, clears the screen or rings the bell); line breaks stay."""
    if message.isprintable():
        return message
    return "".join(ch if ch.isprintable() or ch in "\n" else ch.encode("unicode_escape").decode("ascii")
                   for ch in message)


# Wide enough that no table line wraps (a resource name is at most a few hundred characters).
TABLE_WIDTH = 10_000
# Piped, a status line is printed when what it says changes (not its figures: waited times, steps, cost),
# and otherwise at most this often, so a log of a long queue holds its state changes, not every poll.
PLAIN_EVERY_S = 180.0
_FIGURES = re.compile(r"[0-9][0-9.,:]*")


class Progress:
    """A status line: a rich spinner on a terminal; piped, a plain line per change of state (and one every
    PLAIN_EVERY_S of real time while the figures alone change), and the last one at the end."""

    def __init__(self, console: Console, message: str) -> None:
        self._console = console
        self._last = ""
        self._status = None
        self._shown = ""  # piped: the last line printed, its state and when
        self._shown_state: str | None = None
        self._shown_at = 0.0
        if console.interactive and not console.json_mode:
            self._status = console._stderr().status(message, spinner="dots")
            self._status.start()
        self.update(message)

    def update(self, message: str) -> None:
        if message == self._last:
            return
        self._last = message
        if self._status is not None:
            self._status.update(message)
            return
        state, now = _FIGURES.sub("#", message), time.monotonic()
        if state != self._shown_state or now - self._shown_at >= PLAIN_EVERY_S:
            self._print_plain(message, state, now)

    def _print_plain(self, message: str, state: str, now: float) -> None:
        self._shown, self._shown_state, self._shown_at = message, state, now
        self._console.info(message)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
            if self._last:  # leave the last state on screen
                self._console.info(self._last)
        elif self._last and self._last != self._shown:  # piped: end on where the wait ended
            self._print_plain(self._last, _FIGURES.sub("#", self._last), time.monotonic())
