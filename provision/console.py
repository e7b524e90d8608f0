"""The one object that prints: messages and progress on stderr, the result on stdout.

In JSON mode stdout holds exactly one JSON document, written by `emit`; everything
else goes to stderr so scripts can parse stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class Console:
    def __init__(self, output: str = "text", verbose: int = 0,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.output = output
        self.verbose = verbose
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._color = "NO_COLOR" not in os.environ and self._err.isatty()

    @property
    def json_mode(self) -> bool:
        return self.output == "json"

    def _style(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self._color else text

    def info(self, message: str) -> None:
        print(message, file=self._err, flush=True)

    def detail(self, message: str) -> None:
        if self.verbose:
            print(self._style(message, "2"), file=self._err, flush=True)

    def warn(self, message: str) -> None:
        print(self._style("warning: ", "33") + message, file=self._err, flush=True)

    def error(self, message: str, hint: str | None = None) -> None:
        print(self._style("error: ", "31;1") + message, file=self._err, flush=True)
        if hint:
            print(self._style("hint: ", "36") + hint, file=self._err, flush=True)

    def text(self, message: str) -> None:
        """A line of the command's result: stdout in text mode, stderr in JSON mode."""
        print(message, file=self._err if self.json_mode else self._out, flush=True)

    def emit(self, document: dict[str, Any]) -> None:
        """The JSON document of a command (JSON mode only)."""
        if self.json_mode:
            json.dump(document, self._out, indent=2, sort_keys=False, default=str)
            self._out.write("\n")
            self._out.flush()

    @contextlib.contextmanager
    def progress(self, message: str) -> Iterator[Progress]:
        """A status line for a long wait; updated in place on a terminal, else one line per change."""
        bar = Progress(self, message)
        try:
            yield bar
        finally:
            bar.close()


class Progress:
    def __init__(self, console: Console, message: str) -> None:
        self._console = console
        self._live = console._err.isatty() and not console.json_mode
        self._last = ""
        self._width = 0
        self.update(message)

    def update(self, message: str) -> None:
        if message == self._last:
            return
        self._last = message
        err = self._console._err
        if self._live:
            pad = max(0, self._width - len(message))
            err.write("\r" + message + " " * pad)
            err.flush()
            self._width = len(message)
        else:
            print(message, file=err, flush=True)

    def close(self) -> None:
        if self._live and self._width:
            self._console._err.write("\n")
            self._console._err.flush()
