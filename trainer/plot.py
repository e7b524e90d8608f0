"""A run's metrics rows as one PNG (matplotlib, headless): loss and eval loss, tokens per second, drop
fraction, and each expert's share of the routed tokens over the steps as a heatmap.

`moe-tpu logs --plot FILE.png` draws it from the run's metrics.jsonl, finished, running or dry run;
`python -m trainer.plot metrics.jsonl FILE.png` does the same with a file at hand.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

from trainer.files import kind_of

SIZE_IN, DPI = (12.8, 8.0), 100  # 1280 x 800 pixels


PLOTTABLE = 1e100  # past this a panel's range (largest less smallest) may overflow to infinity


def _readable(row) -> bool:
    """A row with a step a trainer could have written (a hand-edited one may hold anything: 10**30 is no step
    that matplotlib can place)."""
    return (isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
            and 0 <= row["step"] < 2**53)


def latest_rows(rows: Sequence[dict]) -> list[dict]:
    """One row per step, the last one written (a resumed run repeats the steps after its checkpoint)."""
    by_step = {r["step"]: r for r in rows if _readable(r)}
    return [by_step[s] for s in sorted(by_step)]


@dataclasses.dataclass(frozen=True)
class Written:
    path: str  # the file written (FILE.png when FILE was given without a suffix)
    skipped: int  # metric rows that could not be read (no step, not an object), left out
    notes: tuple[str, ...] = ()  # what to tell the user: the suffix added, the rows skipped


def png_path(path: str) -> tuple[str, tuple[str, ...]]:
    """The PNG path to write for `path`, and notes: '.png' added to a name without a suffix; any other
    format, a directory, a device or a FIFO refused (an OSError whose strerror says why)."""
    root, suffix = os.path.splitext(os.path.basename(path))
    if not path.strip() or not root:
        raise OSError(errno.EINVAL, "name a file, e.g. run.png")
    _no_special_file(path)
    if suffix.lower() == ".png":
        return path, ()
    if suffix:
        raise OSError(errno.EINVAL, f"the plot is a PNG; '{suffix}' is not a format it writes: name it {root}.png")
    _no_special_file(path + ".png")
    return path + ".png", (f"wrote PNG: added .png to the name ({path}.png)",)


def _no_special_file(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    kind = kind_of(mode)
    if kind:
        raise OSError(errno.EINVAL, f"it is {kind}, not a file")


def _number(value) -> bool:
    """A value to plot: a finite number of a size a figure can hold (a hand-edited row may hold 1e308, whose
    range across a panel overflows, or NaN, which no axis can place)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and abs(value) < PLOTTABLE and math.isfinite(value))


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in rows if _number(r.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_metrics(rows: Sequence[dict], path: str, *, title: str) -> Written:
    """Writes the four panels of `rows` (metrics.jsonl rows) to the PNG `path` (see png_path), whole: to a
    temporary file beside it, then renamed over it, so that a link there is replaced, never written through."""
    path, notes = png_path(path)
    skipped = sum(not _readable(r) for r in rows)
    if skipped:
        notes += (f"skipped {skipped} metric row(s) that could not be read (no step)",)
    figure = _figure(latest_rows(rows), title)
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            figure.savefig(f, dpi=DPI, format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
    return Written(path, skipped, notes)


def _figure(rows: list[dict], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=SIZE_IN, dpi=DPI, constrained_layout=True)
    fig.suptitle(title, fontsize=14)
    loss, speed, drop, load = axes.ravel()

    loss.plot(*_series(rows, "loss"), label="train loss", color="tab:blue")
    steps, values = _series(rows, "eval_loss")
    if steps:
        loss.plot(steps, values, "o-", label="eval loss", color="tab:orange")
    steps, values = _series(rows, "entropy_floor")
    if steps:
        loss.plot(steps, values, "--", label="entropy floor", color="gray")
    _decorate(loss, "loss (nats)", legend=True)

    speed.plot(*_series(rows, "tokens_per_s"), color="tab:green")
    _decorate(speed, "tokens per second")

    drop.plot(*_series(rows, "drop_fraction"), label="train", color="tab:red")
    steps, values = _series(rows, "eval_drop_fraction")
    if steps:
        drop.plot(steps, values, "o-", label="eval", color="tab:purple")
    _decorate(drop, "dropped token fraction", legend=True)

    loaded = [(r["step"], r["expert_load"]) for r in rows  # a list of numbers (a hand-edited row may hold anything)
              if isinstance(r.get("expert_load"), list) and r["expert_load"] and all(map(_number, r["expert_load"]))]
    if loaded:
        width = max(len(v) for _, v in loaded)
        grid = np.array([v + [0.0] * (width - len(v)) for _, v in loaded], float).T  # experts x steps
        image = load.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                            extent=(loaded[0][0] - 0.5, loaded[-1][0] + 0.5, -0.5, width - 0.5))
        fig.colorbar(image, ax=load, label="share of routed tokens")
        load.set_ylabel("expert")
    _decorate(load, "expert load", grid=False)
    return fig


def _decorate(ax, title: str, *, legend: bool = False, grid: bool = True) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    if grid:
        ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m trainer.plot METRICS.jsonl OUT.png", file=sys.stderr)
        return 2
    kind = kind_of(os.stat(argv[0]).st_mode) if os.path.exists(argv[0]) else None
    if kind:  # found without opening it: a FIFO would wait for a writer for ever
        print(f"cannot read {argv[0]}: it is {kind}, not a file", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            rows = [_row(line) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        print(f"cannot read {argv[0]}: {e}", file=sys.stderr)
        return 2
    try:
        written = plot_metrics(rows, argv[1], title=argv[0])
    except OSError as e:
        print(f"cannot write the plot {argv[1]}: {e.strerror or e}", file=sys.stderr)
        return 2
    for note in written.notes:
        print(note, file=sys.stderr)
    print(f"plot: {written.path}", file=sys.stderr)
    return 0


def _row(line: str):
    """A metrics row, or None for a line that is not JSON (a torn last line): plot_metrics counts those."""
    try:
        return json.loads(line)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
