"""The cloud behind one small interface.

`Session.open(app)` is the only place that decides where requests go: Google Cloud
(Application Default Credentials) or, in dry run, the embedded emulator on
127.0.0.1 with anonymous credentials. Everything after that is the same code.
The Google client libraries are imported here, lazily, and nowhere else in the
control plane's logic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from provision.clock import RealClock, SimClock
from provision.errors import CloudError, MissingDependency

if TYPE_CHECKING:
    from provision.app import App

TPU_HOST = "tpu.googleapis.com:443"


def _require_control_deps() -> None:
    try:
        import grpc  # noqa: F401
        from google.cloud import tpu_v2  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise MissingDependency(exc.name or "google-cloud-tpu", "control") from exc


class Session:
    """An open channel to the TPU API, with the clock that waits on it and the call log."""

    def __init__(self, channel, clock, calls: list[dict[str, Any]], console, emulator=None,
                 default_project: str | None = None) -> None:
        from google.cloud import tpu_v2
        from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

        from provision.cloud.tpu import TpuApi

        self.channel = channel
        self.clock = clock
        self.calls = calls
        self.emulator = emulator
        self.default_project = default_project
        client = tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel))
        self.tpu = TpuApi(client, clock, console)

    @classmethod
    def open(cls, app: App) -> Session:
        _require_control_deps()
        from provision.cloud.calls import CallRecorder

        def show(entry: dict[str, Any]) -> None:
            if app.verbose >= 2:
                app.console.detail(f"rpc {entry['rpc']} -> {entry['status']}")

        recorder = CallRecorder(app.calls, show)
        if app.dry_run:
            return cls._open_emulator(app, recorder)
        return cls._open_google(app, recorder)

    @classmethod
    def _open_emulator(cls, app: App, recorder) -> Session:
        import grpc

        from provision.emulator import Emulator

        app.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            emulator = Emulator(state_path=app.state_dir / "emulator.json", scenario=app.scenario,
                                clock=SimClock())
        except ValueError as exc:
            from provision.errors import UsageError

            raise UsageError(str(exc), hint="pick one with --scenario") from exc
        emulator.start(host="127.0.0.1", port=0)
        channel = grpc.intercept_channel(grpc.insecure_channel(emulator.address), recorder)
        app.console.detail(f"dry run: emulator on {emulator.address}, scenario {app.scenario}")
        return cls(channel, emulator.clock, app.calls, app.console, emulator=emulator)

    @classmethod
    def _open_google(cls, app: App, recorder) -> Session:
        import google.auth
        import grpc
        from google.auth import exceptions as auth_exceptions
        from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

        try:
            credentials, project = google.auth.default(
                scopes=["https://www.googleapis.com/auth/cloud-platform"])
        except auth_exceptions.DefaultCredentialsError as exc:
            raise CloudError("no Google Cloud credentials found",
                             hint="run `gcloud auth application-default login`, or use --dry-run") from exc
        channel = TpuGrpcTransport.create_channel(TPU_HOST, credentials=credentials)
        channel = grpc.intercept_channel(channel, recorder)
        return cls(channel, RealClock(), app.calls, app.console, default_project=project)

    def close(self) -> None:
        try:
            self.channel.close()
        finally:
            if self.emulator is not None:
                self.emulator.stop()
                self.emulator = None
