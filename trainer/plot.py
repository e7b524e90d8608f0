"""A run's metrics rows as one PNG (matplotlib, headless): loss and eval loss, tokens per second, drop
fraction, and each expert's share of the routed tokens over the steps as a heatmap.

`moe-tpu logs --plot FILE.png` draws it from the run's metrics.jsonl, finished, running or dry run;
`python -m trainer.plot metrics.jsonl FILE.png` does the same with a file at hand.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import numpy as np

SIZE_IN, DPI = (12.8, 8.0), 100  # 1280 x 800 pixels


def latest_rows(rows: Sequence[dict]) -> list[dict]:
    """One row per step, the last one written (a resumed run repeats the steps after its checkpoint)."""
    by_step = {r["step"]: r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_metrics(rows: Sequence[dict], path: str, *, title: str) -> None:
    """Writes the four panels of `rows` (metrics.jsonl rows) to the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = latest_rows(rows)
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

    loaded = [(r["step"], r["expert_load"]) for r in rows
              if isinstance(r.get("expert_load"), list) and r["expert_load"]]
    if loaded:
        width = max(len(v) for _, v in loaded)
        grid = np.array([v + [0.0] * (width - len(v)) for _, v in loaded], float).T  # experts x steps
        image = load.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                            extent=(loaded[0][0] - 0.5, loaded[-1][0] + 0.5, -0.5, width - 0.5))
        fig.colorbar(image, ax=load, label="share of routed tokens")
        load.set_ylabel("expert")
    _decorate(load, "expert load", grid=False)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


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
    try:
        with open(argv[0]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        print(f"cannot read {argv[0]}: {e}", file=sys.stderr)
        return 2
    plot_metrics(rows, argv[1], title=argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
