"""Bounded YAML reading, shared by the control plane's config and the trainer's.

A config is a few kilobytes and a few levels of keys, but its text comes from the user (a file,
a `--set` value, `trainer.overrides`), and a YAML parser's work is not bounded by the size of
its input: deep flow nesting (`[[[[...`) makes PyYAML's pure-Python scanner quadratic, deep
nesting overflows the composer's stack, and a few kilobytes of nested aliases expand to
billions of values. So every text passes three checks before anything is constructed, each
linear in the input and each stopping at the first place past its limit:

1. `prescan`, on the characters, before any parser sees them: an upper bound of the nesting
   (block indentation levels, compact `- ` entries, open flow brackets).
2. `check_events`, on libyaml's event stream, before any node is built: the real nesting and
   the number of values once every alias is expanded (each anchored value's size and height
   counted once, then added wherever an alias names it), and aliases that contain themselves.
3. only then the composer and the constructor, whose work is now bounded.

PyYAML offers no limits of its own for any of these (libyaml refuses some very deep texts,
depending on its version, but not aliases), hence this module. It imports only PyYAML, so the
trainer keeps it without the control plane.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_NESTING = 64
# Once aliases are expanded, a document may hold at most this many values per character of its
# text (plus a small allowance), which any hand-written config keeps far below.
MAX_NODES_PER_CHAR = 2
MAX_NODES_SLACK = 1000
# Above this size a syntax error keeps libyaml's wording: the pure-Python parser words it
# better but costs about a microsecond per character.
PYTHON_MESSAGE_MAX_CHARS = 1 << 20

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Characters that can open or close a level or a quoted scalar, or start a comment.
_INTERESTING = re.compile(r"[\[\]{}\"'#]")
# A line whose value is a block scalar (`key: |`, `- >-`, `|2+`), comment stripped.
_BLOCK_SCALAR = re.compile(r"(?:^|[\s:-])[|>][-+0-9]*\s*$")
# Where a quote may open a quoted scalar: after these (spaces skipped; in a block, after a space),
# or first on its line.
_BEFORE_FLOW_SCALAR = set("[{,:?")
_BEFORE_BLOCK_SCALAR = set(":-?")


class Unbounded(Exception):
    """Well-formed or not, the text is no config: too deep, too big once aliases expand, or
    cyclic. The message says which, and where."""


def prescan(text: str, max_depth: int = MAX_NESTING) -> None:
    """Raise Unbounded at the first place where the text may nest more than `max_depth` levels.

    One pass over the lines with a stack of indentation levels; within a line only the
    characters that matter are visited (a regular expression finds them). It over-counts a
    little (a key's indentation and its flow value both count), never under-counts a real
    level, and skips the contents of quoted and block scalars and comments, so brackets in a
    string or a script are not levels."""
    indents: list[int] = []
    flow = 0
    quote = ""  # the open quoted scalar's quote character, across lines
    scalar_indent = -1  # inside a block scalar: its parent line's indentation
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if scalar_indent >= 0:
            if not stripped.strip() or indent > scalar_indent:
                continue
            scalar_indent = -1
        if not quote and flow == 0:
            if not stripped or stripped.startswith("#"):
                continue
            while indents and indents[-1] > indent:
                indents.pop()
            if not indents or indents[-1] < indent:
                indents.append(indent)
        start, entries = indent, 0
        while not quote and flow == 0 and line.startswith("-", start) and (
                start + 1 == len(line) or line[start + 1] == " "):
            entries += 1
            if len(indents) + entries > max_depth:
                raise Unbounded(_too_deep(max_depth, number, start))
            start += 1
            while start < len(line) and line[start] == " ":
                start += 1
        base = len(indents) + entries
        if base > max_depth:
            raise Unbounded(_too_deep(max_depth, number, indent))
        flow, quote, comment_at = _scan_flow(line, start, flow, quote, base, max_depth, number)
        if not quote and flow == 0 and _BLOCK_SCALAR.search(line[:comment_at]):
            scalar_indent = indent


def _scan_flow(line: str, start: int, flow: int, quote: str, base: int, max_depth: int,
               number: int) -> tuple[int, str, int]:
    """(open flow levels, open quote, where a comment starts) after one line."""
    at = start
    while at < len(line):
        if quote:
            at = _quote_end(line, at, quote)
            if at < 0:
                return flow, quote, len(line)
            quote = ""
            continue
        match = _INTERESTING.search(line, at)
        if match is None:
            break
        char, at = match.group(), match.start()
        if char == "#" and (at == 0 or line[at - 1] in " \t"):
            return flow, quote, at
        if char in "[{":
            flow += 1
            if base + flow > max_depth:
                raise Unbounded(_too_deep(max_depth, number, at))
        elif char in "]}":
            flow = max(0, flow - 1)
        elif char in "\"'" and _opens_scalar(line, at, start, flow):
            quote = char
        at += 1
    return flow, quote, len(line)


def _opens_scalar(line: str, at: int, start: int, flow: int) -> bool:
    """Whether a quote at `at` opens a quoted scalar (elsewhere it is part of a plain one)."""
    before = line[start:at].rstrip(" \t")
    if not before:
        return True
    if flow:
        return before[-1] in _BEFORE_FLOW_SCALAR
    return before[-1] in _BEFORE_BLOCK_SCALAR and line[at - 1] in " \t"


def _quote_end(line: str, at: int, quote: str) -> int:
    """The index after the closing `quote` from `at` on, or -1 when the scalar goes on."""
    while True:
        end = line.find(quote, at)
        if end < 0:
            return -1
        if quote == "'" and line.startswith("''", end):  # '' is a quote inside single quotes
            at = end + 2
            continue
        if quote == '"':
            backslashes = len(line[:end]) - len(line[:end].rstrip("\\"))
            if backslashes % 2:
                at = end + 1
                continue
        return end + 1


def _too_deep(limit: int, line: int, column: int | None = None) -> str:
    where = f"line {line}" if column is None else f"line {line}, column {column + 1}"
    return f"nested more than {limit} levels deep (at {where}); a config is a few levels of keys"


def check_events(text: str, limit: int, max_depth: int = MAX_NESTING) -> None:
    """The real nesting and size, from libyaml's events (no tree built), aliases included.

    An alias adds its anchor's values and levels where it stands, as the composer would expand
    it: each anchored node's size and height are counted once, when it closes. Stops at the
    first event past a bound, and at an alias of a node that is still open (it contains itself).
    """
    loader = _Loader(text)
    frames: list[list[Any]] = []  # per open collection: [anchor, height, size]
    heights: dict[str, int] = {}
    sizes: dict[str, int] = {}
    total = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, yaml.AliasEvent):
                if any(frame[0] == event.anchor for frame in frames):
                    raise Unbounded(f"an alias refers to the value that contains it (at line "
                                    f"{_line(event)}); a config cannot be recursive")
                height, size = heights.get(event.anchor, 0), sizes.get(event.anchor, 1)
                if len(frames) + height > max_depth:
                    raise Unbounded(f"its aliases nest it more than {max_depth} levels deep (at line "
                                    f"{_line(event)}); a config is a few levels of keys")
                total += size
            elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                frames.append([event.anchor, 1, 1])
                if len(frames) > max_depth:
                    raise Unbounded(_too_deep(max_depth, _line(event)))
                total += 1
                continue  # its height and size reach its parent when it ends
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                anchor, height, size = frames.pop()
                if anchor is not None:
                    heights[anchor], sizes[anchor] = height, size
            elif isinstance(event, yaml.ScalarEvent):
                height, size = 0, 1
                if event.anchor is not None:
                    heights[event.anchor], sizes[event.anchor] = 0, 1
                total += 1
            else:
                continue
            if total > limit:
                raise Unbounded(f"its aliases expand to more than {limit} values (a config this long has "
                                "far fewer); write the values out or use fewer nested aliases")
            if frames:
                frames[-1][1] = max(frames[-1][1], height + 1)
                frames[-1][2] += size
    finally:
        loader.dispose()


def _python_parse(text: str, max_depth: int = MAX_NESTING) -> None:
    """Parse with the pure-Python parser for its error, events only (its composer recurses),
    stopping one level past the limit (its scanner's work per token grows with the depth)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > max_depth:
                raise Unbounded(_too_deep(max_depth, _line(event)))
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1 if event.start_mark else 0


def compose(text: str) -> yaml.Node | None:
    """The node graph of one document, every bound checked (Unbounded), or the parser's
    yaml.YAMLError for a text that is not YAML."""
    prescan(text)
    try:
        check_events(text, MAX_NODES_PER_CHAR * len(text) + MAX_NODES_SLACK)
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError:
        if _Loader is not yaml.SafeLoader and len(text) <= PYTHON_MESSAGE_MAX_CHARS:
            _python_parse(text)  # the pure-Python parser words syntax errors better
        raise
    return root


def construct(root: yaml.Node | None) -> Any:
    """The Python value of a node graph from `compose` (safe types only)."""
    return yaml.SafeLoader("").construct_document(root) if root is not None else None


def load(text: str) -> Any:
    """yaml.safe_load with every bound checked: Unbounded, or yaml.YAMLError."""
    return construct(compose(text))


def describe(exc: yaml.YAMLError) -> str:
    """A parser error in one line: where, and what."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"YAML syntax error{where}: {exc.problem or exc.context}"
    return f"YAML syntax error: {exc}"
