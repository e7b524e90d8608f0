"""The state of one CLI invocation: options, the console, the cloud session, the call log.

Commands get it as `ctx.obj`. It is the only place that decides between the real
cloud and the emulator; everything below it receives an endpoint and a clock.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any

from provision.console import Console
from provision.errors import ConfigError, MoeTpuError, UsageError

# This machine's state, in the working directory: the remembered config, the dry run's emulated
# world and trainer output, the image build context (a TPU VM's own: provision.rendering.VM_STATE_DIR).
LOCAL_STATE_DIR = ".moe-tpu"
LAST_CONFIG = "last-config"
# A config is a few kilobytes; past this a file is not one (and is not read whole).
# A config is a few kilobytes; past a mebibyte, reading it (YAML in Python, a message for each unknown key) would
# take minutes: a 50 MB flow mapping seemed to hang.
MAX_CONFIG_BYTES = 1 << 20
# Commands that only read: a look at another config (`plan -c other.yaml`) must not change which run a
# later `down` without --config finds, so these leave .moe-tpu/last-config as it was.
READ_ONLY_COMMANDS = frozenset({"logs", "list", "render", "plan", "validate"})


def dry_run_commands(text: str) -> str:
    """A message for a dry run: every `moe-tpu ...` command it suggests carries --dry-run, so that
    following the hint acts on the emulated world, not on Google Cloud."""
    return re.sub(r"`moe-tpu (?!--dry-run)", "`moe-tpu --dry-run ", text)


class App:
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
        self._contexts: dict[int, Any] = {}  # id(config) -> (the config, kept alive, its RunContext)
        self._emulator = None
        # dry run only: a provision.emulator.local_trainer.LocalTrainer that runs the trainer while
        # the run's slice or job is up (`run` sets it before the session opens)
        self.workloads = None
        self.config = None  # the config this command loaded, once loaded
        self.used_cloud = False  # a cloud session was opened (an interrupt may have left resources)

    @property
    def state_dir(self) -> Path:
        """Where dry-run state lives: one emulated world per working directory."""
        return self.workdir / LOCAL_STATE_DIR

    def load_config(self, path: str, check_trainer: bool = False, plan_mesh: bool = False,
                    serve_mesh: bool = False):
        """Load and validate the config. Without `--config` and with no moe-tpu.yaml here, the
        config that the last command in this directory used is taken (so `down` after
        `slice up -c examples/v5e-64.yaml` finds the run); each load records itself for that, except
        in READ_ONLY_COMMANDS."""
        from provision.config import DEFAULT_CONFIG, load_config
        from provision.errors import Problem
        from provision.statefiles import echo, input_problem

        config_path = Path(path)
        if path == DEFAULT_CONFIG and not config_path.exists():
            remembered_path = self.remembered_config()
            if remembered_path is not None:
                config_path = remembered_path
                self.console.info(f"using {config_path} (the config last used in this directory)")
        problem = input_problem(config_path, MAX_CONFIG_BYTES)
        if problem is not None:
            raise ConfigError([Problem(echo(config_path), "", problem)])
        cfg = load_config(config_path, check_trainer=check_trainer, plan_mesh=plan_mesh, serve_mesh=serve_mesh)
        for warning in cfg.warnings():
            self.console.warn(warning)
        if self.command not in READ_ONLY_COMMANDS:
            self.remember_config(config_path)
        self.config = cfg
        return cfg

    def remembered_config(self) -> Path | None:
        """The config the last command here used, from .moe-tpu/last-config; None when there is
        none. A file that cannot be read as a path is a usage error that says how to fix it."""
        from provision.statefiles import check_regular

        remembered = self.state_dir / LAST_CONFIG
        try:
            if not check_regular(remembered, "remembered config path"):
                return None
            text = remembered.read_text(encoding="utf-8").strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{remembered}: cannot read the remembered config path: "
                             f"{getattr(exc, 'strerror', None) or exc}",
                             hint=f"delete {remembered}, or name the config with --config") from None
        if not text or "\n" in text or "\0" in text or not text.isprintable():
            raise UsageError(f"{remembered}: does not hold a config path",
                             hint=f"delete {remembered}, or name the config with --config")
        return Path(text)

    def remember_config(self, config_path: Path) -> None:
        """Record the config for later commands here; a directory that cannot take it only loses that."""
        from provision.statefiles import check_regular, write_atomic

        remembered = self.state_dir / LAST_CONFIG
        try:
            check_regular(remembered)
        except UsageError as exc:  # a symlink, a FIFO, a directory...: never written through
            self.console.warn(f"not remembering the config: {exc.message}")
            return
        try:
            write_atomic(remembered, str(config_path.resolve()) + "\n")
        except (UsageError, OSError, UnicodeEncodeError) as exc:
            why = exc.message if isinstance(exc, UsageError) else getattr(exc, "strerror", None) or exc
            self.console.detail(f"not remembering the config in {remembered}: {why}")

    def context(self, cfg=None):
        """The command's provision.context.RunContext for `cfg` (by default the config it loaded),
        built once per config: the templates (`--templates` first) and the image are resolved on
        it once, and its session is this invocation's."""
        cfg = self.config if cfg is None else cfg
        if id(cfg) not in self._contexts:
            from provision.context import RunContext

            self._contexts[id(cfg)] = (cfg, RunContext(cfg, self.console, self.session, self.templates_dir))
        return self._contexts[id(cfg)][1]

    def trainer_output_dir(self, cfg, train_locally: bool = False) -> str:
        """Where the run's trainer writes: trainer.output_dir, or in a dry run a directory under
        .moe-tpu/ where the trainer runs on this machine. `train_locally` makes the emulator run
        it there whenever an emulated slice or job is up (what `run` does)."""
        if not self.dry_run:
            return cfg.trainer.output_dir
        from provision.emulator.local_trainer import LocalTrainer, local_output_dir

        output_dir = local_output_dir(self.state_dir, cfg.run)
        if train_locally:
            self.workloads = LocalTrainer(cfg, output_dir, console=self.console)
        return str(output_dir)

    def session(self):
        """The cloud session, opened on first use on the endpoint `endpoint()` chooses."""
        if self._session is None:
            from provision.cloud import Session

            self._session = Session(self.endpoint(), self.calls, self.console)
            self.used_cloud = True
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

        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise UsageError(f"{self.state_dir} is a file, not the directory where dry runs keep their state",
                             hint=f"move or delete the file {self.state_dir}") from None
        except OSError as exc:
            raise UsageError(f"cannot create {self.state_dir}: {exc.strerror or exc}",
                             hint="run dry runs in a directory you can write to") from None
        from provision.emulator.local_server import LocalServers, dry_run_adapter

        workloads = self.workloads
        # The model servers a deployed model runs here, adapted to this machine by the command's config.
        servers = LocalServers(self.state_dir, dry_run_adapter(self.config, self.state_dir)
                               if self.config is not None else None)
        try:
            emulator = Emulator(state_path=self.state_dir / "emulator.json", scenario=self.scenario,
                                clock=SimClock(), external_workloads=workloads is not None,
                                lock_notice=self.console.warn, servers=servers)
        except ValueError as exc:
            hint = ("set it as ZONE/NAME=CHIPS[,...]" if "RESERVATIONS" in str(exc) else "pick one with --scenario")
            raise UsageError(str(exc), hint=hint) from exc
        emulator.start(host="127.0.0.1", port=0)
        if workloads is not None:
            workloads.attach(emulator)
        else:  # no trainer of its own: its waits follow real time while a model server loads and compiles
            # here, as it would in the cloud, or while another run's trainer runs here
            from provision.clock import AnyGate
            from provision.emulator.local_trainer import OthersGate

            others = OthersGate(self.state_dir, self.config.run if self.config is not None else None)
            emulator.clock.gate = AnyGate(servers, others)
        return emulator

    def close(self) -> None:
        try:
            if self._session is not None:
                self._session.close()
                self._session = None
        finally:
            if self._emulator is not None:
                workloads = self.workloads
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

    @staticmethod
    def report_error(app: App | None, exc: MoeTpuError) -> None:
        """A failure as its message (and in JSON mode one document); `app`: the command's, if it got one."""
        console = app.console if app else Console()
        if app is not None:
            app.close()
            if console.json_mode and app.command and not console.emitted:
                extra: dict[str, Any] = {"error": exc.message, "exit_code": exc.exit_code}
                if isinstance(exc, ConfigError):
                    extra["problems"] = [p.__dict__ for p in exc.problems]
                console.emit(app.document("error", resources=[], **extra))
        dry = app is not None and app.dry_run
        console.error(dry_run_commands(exc.message) if dry else exc.message,
                      dry_run_commands(exc.hint) if dry and exc.hint else exc.hint)

    def _what_exists(self) -> list[dict[str, Any]]:
        """The run's resources as they stand (after an interrupt); [] when none can be read."""
        cfg = self.config
        if cfg is None or not self.used_cloud:
            return []
        try:
            context = self.context(cfg)  # its session: the command's own may be closed already
            found = cfg.kind.status(context)  # everything of the run, whichever workload was interrupted
            now = context.clock.now()
            return [r.as_dict(now) for r in found]
        except BaseException:  # noqa: BLE001 - interrupted again, or the cloud is gone: report what we know
            return []

    @staticmethod
    def report_interrupt(app: App | None) -> None:
        """Ctrl-C: keep the documented promises (the hint to run `down`; in JSON mode, one document
        with result "interrupted" and what exists)."""
        console = app.console if app else Console()
        touched_cloud = app is not None and app.used_cloud
        hint = "run `moe-tpu down` to delete anything this run created" if touched_cloud else None
        if app is not None:
            resources = app._what_exists()
            try:
                app.close()
            except BaseException:  # noqa: BLE001 - already interrupted; report what we know
                pass
            if console.json_mode and app.command and not console.emitted:
                console.emit(app.document("interrupted", resources=resources, error="interrupted", hint=hint,
                                          exit_code=130))
        console.error("interrupted" if touched_cloud else "aborted",
                      dry_run_commands(hint) if hint and app is not None and app.dry_run else hint)

    @staticmethod
    def report_unexpected(app: App | None, exc: BaseException) -> None:
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
