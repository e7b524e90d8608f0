"""`moe-tpu logs`: the run's trainer output and metrics, read from its output directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import click

from provision.cli.options import config_option
from trainer.outputs import ENDED

FOLLOW_INTERVAL_S = 2.0


@click.command("logs")
@config_option
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the trainer ends.")
@click.option("--tail", "tail", type=click.IntRange(min=0), default=20, show_default=True,
              help="How many metric rows to show first (0: all).")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="Also draw loss, eval loss, tokens/s, drop fraction and expert load to this PNG.")
@click.pass_obj
def logs(app, config_path: str, follow: bool, tail: int, plot_path: str | None) -> None:
    """The trainer's state, metrics and output, from the run's output directory.

    Reads status.json and metrics.jsonl that the trainer writes to trainer.output_dir
    (gs:// or local), and the trainer's console output where it is kept (a dry run keeps
    it under .moe-tpu/; on GKE it is the trainer pod's log while the JobSet exists).

    \b
    Examples:
      moe-tpu logs -c examples/v5e-64.yaml
      moe-tpu --dry-run logs --follow
      moe-tpu logs --plot run.png
    """
    from provision.clock import RealClock
    from provision.cloud import storage
    from provision.kinds import kind_of

    app.command = "logs"
    cfg = app.load_config(config_path)
    out = app.trainer_output_dir(cfg)
    store = storage.LOCAL if app.dry_run or not out.startswith("gs://") else app.session().storage
    pod_log = kind_of(cfg).log_source(app.context(cfg))
    alive = _alive(app, cfg, out) if follow else None
    seen = read_output(reader_of(store, out), pod_log, app.console, RealClock(), follow=follow, tail=tail,
                       alive=alive)
    rows, status, text = seen.rows, seen.status, seen.text
    if follow and status.get("state") not in ENDED:
        _nothing_to_follow(cfg, out, status)
    if not follow and text:
        for line in text.splitlines()[-tail or None:]:
            app.console.info(line)
    state = status.get("state", "no status yet")
    app.console.text(f"trainer: {state}" + (f" at step {status['step']}/{status.get('total_steps')}"
                                            if status.get("step") is not None else "")
                     + (f", eval loss {status['eval_loss']:.4f} at step {status.get('eval_step')}"
                        if _number(status.get("eval_loss")) else ""))
    if plot_path is not None:  # `--plot ''` too: a name to refuse, not a plot to leave out
        plot_path = _plot(app, cfg, rows, plot_path)
    app.console.emit(app.document("ok", output_dir=out, status=status or None, metrics=rows,
                                  **({"plot": plot_path} if plot_path else {})))


@dataclass
class Seen:
    """What `read_output` has read and shown so far."""

    rows: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    text: str = ""
    shown_rows: int = 0
    shown_lines: int = 0


def reader_of(store, output_dir: str) -> Callable[[str, Callable], object]:
    """`read_output`'s `read` on the output directory `output_dir`, through `store` (a
    provision.cloud.storage.Storage: the session's for gs://, else LOCAL)."""
    from provision.cloud import storage

    return lambda name, reader: reader(store, storage.join(output_dir, name))


def _alive(app, cfg, out: str) -> Callable[[], bool]:
    """Whether anything of the run is up (its placement: a trainer can still write), asked of its target."""
    from provision.kinds import for_config

    target = for_config(app.context(cfg), output_dir=out)
    return lambda: bool(target.left())


def _nothing_to_follow(cfg, out: str, status: dict) -> None:
    """`--follow` ended with the trainer not ended: nothing of the run is up, so nothing will write."""
    from provision.errors import CloudError, UsageError

    if not status:
        raise UsageError(f"nothing to follow: run {cfg.run} has no trainer output in {out} and nothing of it is up",
                         hint="start it with `moe-tpu run` (or check the config's run and trainer.output_dir)")
    step = f" at step {status['step']}" if status.get("step") is not None else ""
    raise CloudError(f"the trainer's status says {status.get('state')!r}{step}, but nothing of run {cfg.run} is "
                     "up: its trainer was stopped before it could write its end",
                     hint="`moe-tpu run` resumes it from its last checkpoint")


def read_output(read: Callable[[str, Callable], object], pod_log: Callable[[], str | None] | None, console, clock, *,
                follow: bool, tail: int, alive: Callable[[], bool] | None = None) -> Seen:
    """Print the metric rows (the last `tail` first) and, following, the new lines of the trainer's output,
    until the trainer ends (once without `follow`). `read(name, reader)` reads the output directory's file
    `name` with `reader` (provision.cloud.storage.Storage's read_jsonl, read_text or read_json, called on
    the Storage that reads the directory); the waits are waiting.poll's on `clock`, every FOLLOW_INTERVAL_S."""
    from provision.cloud.storage import Storage
    from provision.waiting import PollPolicy, poll
    from trainer.outputs import ENDED, METRICS_FILE, STATUS_FILE, TRAINER_LOG

    seen = Seen()
    first = read(METRICS_FILE, Storage.read_jsonl)
    if tail and len(first) > tail:
        seen.shown_rows = len(first) - tail

    def look() -> Seen:
        seen.rows = read(METRICS_FILE, Storage.read_jsonl)
        for row in seen.rows[seen.shown_rows:]:
            console.text(_row_line(row))
        seen.shown_rows = len(seen.rows)
        seen.text = (pod_log() if pod_log is not None else None) or read(TRAINER_LOG, Storage.read_text) or ""
        lines = seen.text.splitlines()
        for line in lines[seen.shown_lines:] if follow else []:
            console.info(line)
        seen.shown_lines = len(lines)
        seen.status = read(STATUS_FILE, Storage.read_json) or {}
        return seen

    every = PollPolicy(initial_s=FOLLOW_INTERVAL_S, factor=1.0, cap_s=FOLLOW_INTERVAL_S, jitter=0.0)
    def ended(s: Seen) -> bool:  # or nothing will write any more: no part of the run is up
        return not follow or s.status.get("state") in ENDED or (alive is not None and not alive())

    return poll(look, ended, clock, timeout_s=float("inf"), policy=every, what="the trainer to end")


def _plot(app, cfg, rows: list, path: str) -> str:
    from provision.errors import MissingDependency, UsageError

    try:
        import matplotlib  # noqa: F401

        from trainer.plot import plot_metrics
    except ImportError as exc:
        raise MissingDependency(exc.name or "matplotlib", "plot") from exc
    if not rows:
        raise UsageError(f"nothing to plot: the run has no metrics yet ({app.trainer_output_dir(cfg)})")
    model = cfg.dry_run.trainer_config + f" (dry run of {cfg.trainer.config})" if app.dry_run else cfg.trainer.config
    try:
        written = plot_metrics(rows, path, title=f"run {cfg.run}  -  model {model}")
    except OSError as e:
        raise UsageError(f"cannot write the plot {path}: {e.strerror or e}") from None
    for note in written.notes:
        app.console.info(note)
    app.console.info(f"plot: {written.path}")
    return written.path


ROW_FIELDS = (("loss", "loss {:.4f}"), ("eval_loss", "eval loss {:.4f}"), ("eval_perplexity", "ppl {:.2f}"),
              ("eval_drop_fraction", "eval drop {:.3f}"), ("aux_loss", "aux {:.4f}"),
              ("tokens_per_s", "{:,.0f} tok/s"), ("step_time_s", "{:.3f} s/step"))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _row_line(row: dict) -> str:
    parts = [f"step {row.get('step')}"]
    parts += [fmt.format(row[key]) for key, fmt in ROW_FIELDS if _number(row.get(key))]
    return "  ".join(parts)
