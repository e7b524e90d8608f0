"""`init`, `validate` and `render`: thin wrappers over provision.config and provision.rendering."""

from __future__ import annotations

from pathlib import Path

import click

from provision.cli.options import config_option
from provision.errors import UsageError


@click.command("init")
@config_option
@click.option("--force", is_flag=True, help="Overwrite the file if it exists.")
@click.option("--from-terraform", "terraform_path", type=click.Path(exists=True), default=None,
              help="Fill it from terraform/'s outputs: a directory (runs `terraform output -json` there) "
                   "or a file saved from that command.")
@click.pass_obj
def init(app, config_path: str, force: bool, terraform_path: str | None) -> None:
    """Write a commented starter config.

    With --from-terraform, the project, zones, network, service accounts, image
    repository, staging and output locations come from the foundation that
    terraform/ made (the run's output_dir is RUNS-DIRECTORY/RUN).

    \b
    Examples:
      moe-tpu init                       # writes moe-tpu.yaml
      moe-tpu init -c runs/big.yaml      # somewhere else
      moe-tpu init --force               # replace an existing file
      moe-tpu init --from-terraform terraform/
      moe-tpu init --from-terraform outputs.json   # saved `terraform output -json`
    """
    from provision.config import starter_config

    app.command = "init"
    path = Path(config_path)
    if path.exists() and not force:
        raise UsageError(f"{path} already exists; not overwriting it", hint="pass --force to replace it")
    text = starter_config()
    if terraform_path is not None:
        from provision import foundation

        outputs = foundation.read_outputs(Path(terraform_path))
        for name in foundation.config_keys(outputs)[1]:
            app.console.warn(f"terraform output {name!r} is not a config key; left out")
        text = foundation.config_text(outputs, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    app.console.text(f"wrote {path}")
    if terraform_path is None:
        app.console.info("next: set project, zones, image and trainer in it, then run `moe-tpu validate`")
    else:
        app.console.info("next: choose the run's name, slice and trainer in it, then run `moe-tpu validate`")
    app.console.emit(app.document("ok", config=str(path)))


@click.command("validate")
@config_option
@click.pass_obj
def validate(app, config_path: str) -> None:
    """Check the config and render every template; list every problem at once.

    Exit code 0 when all is well, 2 when the config or a template has a problem.
    A zone Google does not document for TPU v5e is a warning; the API's list of
    accelerator types in that zone decides (with --dry-run, the emulator's, here).

    \b
    Examples:
      moe-tpu validate                           # moe-tpu.yaml
      moe-tpu validate -c examples/v5e-64.yaml
      moe-tpu --templates my-templates/ validate # check your own template copies
    """
    app.command = "validate"
    cfg = app.load_config(config_path, check_trainer=True)
    files = _rendered(app, cfg)
    if app.dry_run and cfg.warnings():  # zones the catalogue does not list: the emulator's answer decides
        cfg.kind.check_offer(cfg, app.session())
    app.console.text(f"config OK: {cfg.source}")
    app.console.text(f"  run {cfg.run}: {_summary(cfg)}")
    app.console.text(f"  rendered {len(files)} files: {', '.join(files)}")
    app.console.emit(app.document("ok", config=str(cfg.source), files=list(files)))


def _rendered(app, cfg) -> dict[str, str]:
    """Every rendered file of the config's target, by name (its kind's `render`)."""
    from provision.kinds import kind_of

    return kind_of(cfg).render(cfg, app.context(cfg).renderer)


def _summary(cfg) -> str:
    """One line on what the config asks for (its kind's `summary`)."""
    from provision.kinds import kind_of

    return kind_of(cfg).summary(cfg)


@click.command("render")
@config_option
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write the rendered files to (created if missing).")
@click.pass_obj
def render(app, config_path: str, out_dir: str) -> None:
    """Write every rendered template and request body to a directory.

    Writes the TPU VM startup script, and for each zone the QueuedResource body
    and the CreateQueuedResource request as proto JSON: exactly what would be sent.

    \b
    Examples:
      moe-tpu render --out rendered/
      moe-tpu render -c examples/v5e-64.yaml --out /tmp/moe
      moe-tpu --templates my-templates/ render --out rendered/
    """
    from provision.statefiles import ensure_dir, write_atomic

    app.command = "render"
    cfg = app.load_config(config_path, plan_mesh=True)  # what would be sent: the trainer's mesh decided
    files = _rendered(app, cfg)
    out = Path(out_dir)
    written = []
    try:
        ensure_dir(out)
        for name, text in files.items():
            write_atomic(out / name, text, "rendered file")  # never through a symlink, a FIFO or a device
            written.append(str(out / name))
    except OSError as exc:
        raise UsageError(f"cannot write to {out}: {exc.strerror or exc}") from None
    for path in written:
        app.console.text(path)
    app.console.emit(app.document("ok", config=str(cfg.source), files=written))
