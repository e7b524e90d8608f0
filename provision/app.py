"""The state of one CLI invocation: options, the console, the cloud session, the call log.

Commands get it as `ctx.obj`. It is the only place that decides between the real
cloud and the emulator; everything below it receives an endpoint and a clock.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from provision.console import Console
from provision.errors import ConfigError, MoeTpuError

STATE_DIR = ".moe-tpu"
LAST_CONFIG = "last-config"


class App:
    current: App | None = None

    def __init__(self, *, dry_run: bool = False, scenario: str = "happy", output: str = "text",
                 verbose: int = 0, templates_dir: str | None = None, workdir: Path | None = None) -> None:
        self.dry_run = dry_run
        self.scenario = scenario
        self.output = output
        self.verbose = verbose
        self.templates_dir = Path(templates_dir) if templates_dir else None
        self.workdir = Path(workdir) if workdir else Path.cwd()
        self.console = Console(output=output, verbose=verbose)
        self.calls: list[dict[str, Any]] = []
        self.command: str | None = None
        self._session = None
        self._emulator = None
        # what a command asks of the emulator before the session opens (dry run only): "workloads",
        # a provision.emulator.local_trainer.LocalTrainer that runs the trainer while a slice or job is up
        self.emulator_options: dict[str, Any] = {}
        App.current = self

    @property
    def state_dir(self) -> Path:
        """Where dry-run state lives: one emulated world per working directory."""
        return self.workdir / STATE_DIR

    def load_config(self, path: str, check_trainer: bool = False):
        """Load and validate the config. Without `--config` and with no moe-tpu.yaml here, the
        config that the last command in this directory used is taken (so `down` after
        `slice up -c examples/v5e-64.yaml` finds the run); each load records itself for that."""
        from provision.config import DEFAULT_CONFIG, load_config

        config_path = Path(path)
        remembered = self.state_dir / LAST_CONFIG
        if path == DEFAULT_CONFIG and not config_path.exists() and remembered.exists():
            config_path = Path(remembered.read_text().strip())
            self.console.info(f"using {config_path} (the config last used in this directory)")
        cfg = load_config(config_path, check_trainer=check_trainer)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        remembered.write_text(str(config_path.resolve()) + "\n")
        return cfg

    def trainer_output_dir(self, cfg, train_locally: bool = False) -> str:
        """Where the run's trainer writes: trainer.output_dir, or in a dry run a directory under
        .moe-tpu/ where the trainer runs on this machine. `train_locally` makes the emulator run
        it there whenever an emulated slice or job is up (what `run` does)."""
        if not self.dry_run:
            return cfg.trainer.output_dir
        from provision.emulator.local_trainer import LocalTrainer, local_output_dir

        output_dir = local_output_dir(self.state_dir, cfg.run)
        if train_locally:
            self.emulator_options["workloads"] = LocalTrainer(cfg, output_dir, console=self.console)
        return str(output_dir)

    def session(self):
        """The cloud session, opened on first use on the endpoint `endpoint()` chooses."""
        if self._session is None:
            from provision.cloud import Session

            self._session = Session(self.endpoint(), self.calls, self.console)
        return self._session

    def endpoint(self):
        """The one place that decides dry run: Google Cloud, or the emulator started here."""
        from provision.cloud import Endpoint, require_control_deps

        if not self.dry_run:
            from provision.clock import RealClock

            return Endpoint.google(RealClock())
        if self._emulator is None:
            require_control_deps()
            self._emulator = self._start_emulator()
            self.console.detail(f"dry run: emulator on {self._emulator.address}, scenario {self.scenario}")
        return Endpoint(clock=self._emulator.clock, address=self._emulator.address)

    def _start_emulator(self):
        from provision.clock import SimClock
        from provision.emulator import Emulator
        from provision.errors import UsageError

        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {self.state_dir}: {exc.strerror or exc}",
                             hint="run dry runs in a directory you can write to") from None
        workloads = self.emulator_options.get("workloads")
        try:
            emulator = Emulator(state_path=self.state_dir / "emulator.json", scenario=self.scenario,
                                clock=SimClock(), external_workloads=workloads is not None)
        except ValueError as exc:
            raise UsageError(str(exc), hint="pick one with --scenario") from exc
        emulator.start(host="127.0.0.1", port=0)
        if workloads is not None:
            workloads.attach(emulator)
        return emulator

    def close(self) -> None:
        try:
            if self._session is not None:
                self._session.close()
                self._session = None
        finally:
            if self._emulator is not None:
                workloads = self.emulator_options.get("workloads")
                try:
                    if workloads is not None:
                        workloads.stop()
                finally:
                    self._emulator.stop()
                    self._emulator = None

    # --- reporting -------------------------------------------------------
    def document(self, result: str, **fields: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {"command": self.command, "dry_run": self.dry_run}
        if self.dry_run:
            doc["scenario"] = self.scenario
        doc["calls"] = self.calls
        doc.update(fields)
        doc["result"] = result
        return doc

    @classmethod
    def report_error(cls, exc: MoeTpuError) -> None:
        app = cls.current
        console = app.console if app else Console()
        if app is not None:
            app.close()
            if console.json_mode and app.command and not console.emitted:
                extra: dict[str, Any] = {"error": exc.message, "exit_code": exc.exit_code}
                if isinstance(exc, ConfigError):
                    extra["problems"] = [p.__dict__ for p in exc.problems]
                console.emit(app.document("error", resources=[], **extra))
        console.error(exc.message, exc.hint)

    @classmethod
    def report_unexpected(cls, exc: BaseException) -> None:
        app = cls.current
        console = app.console if app else Console()
        if app is not None:
            try:
                app.close()
            except Exception:  # noqa: BLE001 - already failing; report the first error
                pass
        if console.verbose:
            console.info("".join(traceback.format_exception(exc)))
        console.error(f"internal error: {type(exc).__name__}: {exc}",
                      "this is a bug in moe-tpu; rerun with -v for details and report it")
