"""`moe-tpu emulator serve`: the Cloud TPU and Vertex AI API emulator as a standalone loopback gRPC server."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import click

from provision.errors import MissingDependency, UsageError
from provision.statefiles import check_regular, echo


@click.group("emulator")
def emulator() -> None:
    """The embedded Cloud TPU v2 and Vertex AI JobService emulator, as a standalone server."""


@emulator.command("serve")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port on 127.0.0.1 (0 picks a free one).")
@click.option("--state", "state_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Keep the emulated world in this JSON file (shared with other processes: every RPC locks it, "
                   "reloads it and saves it).")
@click.option("--speed", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
              help="Simulated seconds per real second (60: a minute of queueing per second).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the `flaky` scenario.")
@click.pass_obj
def serve(app, port: int, state_path: Path | None, speed: float, seed: int) -> None:
    """Serve google.cloud.tpu.v2.Tpu, google.cloud.aiplatform.v1.JobService (custom jobs) and
    google.longrunning.Operations on 127.0.0.1 until Ctrl-C.

    The scenario is the global --scenario. Point a TpuClient or a JobServiceClient at the printed
    address with grpc.insecure_channel(ADDRESS) and anonymous credentials.

    The emulated project holds no TPU reservation unless MOE_TPU_EMULATOR_RESERVATIONS declares
    some, as ZONE/NAME=CHIPS[,...] (dry runs read it too). Every emulated behaviour and its source:
    docs/emulator-fidelity.md.

    \b
    Examples:
      moe-tpu emulator serve --port 8470
      moe-tpu --scenario stockout emulator serve --port 8470 --speed 60
      moe-tpu --scenario flaky emulator serve --state world.json --seed 3
    """
    try:
        from provision.emulator import Emulator, ScaledClock
    except ImportError as exc:
        raise MissingDependency(exc.name or "grpcio", "control") from exc
    try:
        emu = Emulator(state_path=state_path, scenario=app.scenario, clock=ScaledClock(speed), seed=seed)
    except ValueError as exc:
        hint = ("set it as ZONE/NAME=CHIPS[,...]" if "RESERVATIONS" in str(exc) else "pick one with --scenario")
        raise UsageError(str(exc), hint=hint) from exc
    try:
        emu.start(host="127.0.0.1", port=port)
    except OSError as exc:
        raise UsageError(str(exc), hint="pick a free port with --port, or --port 0") from exc
    _serve_until_stopped(app, emu, speed)


def _serve_until_stopped(app, emu, speed: float) -> None:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    app.command = "emulator serve"
    app.console.text(f"emulator listening on {emu.address} (scenario {emu.scenario}, speed x{speed:g}); "
                     "Ctrl-C stops it")
    app.console.emit(app.document("serving", address=emu.address, resources=[]))
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        emu.stop()
    app.console.info("emulator stopped")


@emulator.command("reset")
@click.option("--state", "state_path", type=click.Path(dir_okay=False, path_type=Path),
              help="The emulated world's file (default: this directory's dry-run world, .moe-tpu/emulator.json).")
@click.pass_obj
def reset(app, state_path: Path | None) -> None:
    """Clear the emulated world: every emulated queued resource, node, custom job and endpoint is gone (the
    model servers its deployed models ran on this machine are stopped).

    Takes the lock that every emulator process takes for each RPC, so a server or a dry run
    that is running reloads an empty world on its next call. Without --state it also clears
    this directory's dry-run runs (.moe-tpu/runs/: their checkpoints and logs) and stops a
    local trainer that a killed dry run left running. A file that is not an emulated world
    is never deleted.

    \b
    Examples:
      moe-tpu emulator reset
      moe-tpu emulator reset --state world.json
    """
    from provision.emulator.store import Store

    app.command = "emulator reset"
    path = state_path if state_path is not None else app.state_dir / "emulator.json"
    if path.parent.is_file():
        raise UsageError(f"{echo(path)} is not an emulator state file", hint="name the state file with --state")
    existed = check_regular(path, "emulator state file")
    if existed:
        _check_is_world(path)
    try:
        with Store(path, notice=app.console.warn).locked():
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot clear {echo(path)}: {exc.strerror or exc}",
                         hint="check the file's permissions, or delete it by hand") from None
    app.console.text(f"emulated world cleared ({path})" if existed else f"emulated world already empty ({path})")
    from provision.emulator.local_server import LocalServers

    servers = LocalServers(path.parent)  # the model servers its deployed models ran: gone with the world
    stopped = servers.keys()
    for key in stopped:
        servers.stop(key)
    if stopped:
        app.console.text(f"model servers stopped: {len(stopped)}")
    runs = _clear_runs(app) if state_path is None else []
    if runs:
        app.console.text(f"dry-run runs cleared: {', '.join(runs)} ({app.state_dir / 'runs'})")
    app.console.emit(app.document("ok", state=str(path), cleared=existed, runs_cleared=runs, resources=[]))


def _check_is_world(path: Path) -> None:
    """Refuse (exit 2) to delete a file that is not an emulated world: a config, anything of the user's."""
    import json

    from provision.emulator.store import MAX_STATE_BYTES

    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(MAX_STATE_BYTES + 1))
    except (OSError, ValueError):
        data = None
    if not (isinstance(data, dict) and isinstance(data.get("version"), int) and "tpu" in data and "now" in data):
        raise UsageError(f"{echo(path)} is not an emulated world (not a file that the emulator wrote): not deleting it",
                         hint="name the emulator's state file with --state (the file given to "
                              "`emulator serve --state`)")


def _clear_runs(app) -> list[str]:
    """Delete the dry runs' directories under .moe-tpu/runs/ (stopping a trainer left running first)."""
    import shutil

    from provision.emulator.local_trainer import RUNS_DIR, stop_recorded

    runs_dir = app.state_dir / RUNS_DIR
    if runs_dir.is_symlink() or not runs_dir.is_dir():
        return []
    cleared = []
    for run_dir in sorted(runs_dir.iterdir()):
        if run_dir.is_dir() and not run_dir.is_symlink():
            stop_recorded(app.state_dir, run_dir.name)
            shutil.rmtree(run_dir, ignore_errors=True)
            cleared.append(run_dir.name)
    return cleared
