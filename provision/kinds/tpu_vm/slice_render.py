"""Pure rendering of a TPU VM slice: ids, the startup script and the QueuedResource request.

The request body is parsed into the real `google.cloud.tpu_v2` message (provision/cloud/messages.py), so a
field the API does not know is an error here rather than at the API.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.cloud import CLOUD_PLATFORM_SCOPE, messages
from provision.cloud.messages import proto_dict
from provision.container import TRAINER_COMMAND, Container
from provision.errors import ConfigError, Problem
from provision.rendering import RenderContext, Renderer
from provision.resources import location_path, resolve_project
from provision.templates import render, where
from trainer import status as trainer_status

if TYPE_CHECKING:
    from provision.kinds.slice_section import SliceConfig


QUEUED_RESOURCE_TEMPLATE = "queued_resource.yaml.j2"


STARTUP_TEMPLATE = "startup.sh.j2"


# Fixed namespace for request ids: the same config always yields the same id, so a create
# re-sent after a crash is recognised by the API as the same request.
_REQUEST_NAMESPACE = uuid.UUID("6f1c3a52-5d1e-4c7e-9a43-1e0b7d6a2f10")


# A metadata value (the startup script) holds at most 256 KiB.
MAX_METADATA_VALUE_BYTES = 256 * 1024


def queued_resource_id(run: str) -> str:
    return run


def node_id(run: str) -> str:
    """The node id (one slice) or node_id_prefix (multislice; the service appends -0, -1, ...)."""
    return f"{run}-tpu"


def request_id(slice: SliceConfig, ctx: RenderContext, zone: str, attempt: int = 0, content: Any = None) -> str:
    """Deterministic request id for CreateQueuedResource: the same request (project, zone, run, body)
    always gets the same id, so a create re-sent after a crash is recognised as the same request; a
    changed body, or `attempt` > 0 (a deliberate re-create), gets another."""
    key = f"{ctx.project}/{zone}/{ctx.run}/{slice.accelerator}"
    if content is not None:
        key += "/" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    if attempt:
        key += f"/{attempt}"
    return str(uuid.uuid5(_REQUEST_NAMESPACE, key))


def parent(ctx: RenderContext, zone: str) -> str:
    return location_path(resolve_project(ctx), zone)


@dataclass(frozen=True)
class StartupSpec:
    """What the TPU VM startup script needs."""

    run: str
    image_uri: str
    registry_host: str
    container_name: str
    log_file: str
    trainer_log_file: str
    container: Container  # the trainer's, run with the image's own entry point (its command)
    labels: dict[str, str]
    # The host directory mounted at the same path in the container: the trainer's status file
    # (read by the watcher, which sets the guest attributes) and its working directory, so a
    # relative trainer.output_dir lives on the VM's disk, not in the container.
    state_dir: str
    status_file: str
    work_dir: str
    watcher_file: str
    watch_interval_s: int
    trainer_uid: int
    # The guest attributes the watcher sets: (status field, key) pairs, under guest_namespace.
    guest_namespace: str
    guest_fields: tuple[tuple[str, str], ...]
    # An absolute local trainer.output_dir, mounted at the same path (None: gs:// or relative).
    output_mount: str | None
    # The watcher's final state by the trainer's exit code, and for any other code (trainer/status.py).
    final_states: tuple[tuple[int, str], ...] = tuple(trainer_status.STATE_OF_EXIT.items())
    failed_state: str = trainer_status.FAILED

    @property
    def trainer_argv(self) -> tuple[str, ...]:
        return self.container.argv

    @property
    def trainer_args(self) -> tuple[str, ...]:
        """The arguments after the image: the image's entry point is the trainer command itself."""
        assert self.container.command == TRAINER_COMMAND, "docker run starts the image's entry point: the trainer"
        return self.container.args

    @property
    def trainer_argv_lines(self) -> list[tuple[str, ...]]:
        """The trainer's arguments split for display: each option with its value."""
        lines: list[list[str]] = []
        for arg in self.trainer_args:
            if not lines or arg.startswith("--"):
                lines.append([arg])
            else:
                lines[-1].append(arg)
        return [tuple(line) for line in lines]


@dataclass(frozen=True)
class QueuedResourceSpec:
    """What the QueuedResource body needs, for one zone: the slice section (the kind's own), and its
    values resolved for the zone."""

    slice: SliceConfig
    accelerator: catalogue.AcceleratorType
    zone: str
    parent: str
    node_id: str
    multislice: bool
    node_count: int
    labels: dict[str, str]
    reservation_name: str | None
    max_wait_seconds: int
    startup_script: str
    service_account_scopes: tuple[str, ...]


# On every TPU VM (not the dry run's .moe-tpu/ here, provision.app.LOCAL_STATE_DIR): the trainer's status
# file, the watcher and the trainer's working directory.
VM_STATE_DIR = "/var/lib/moe-tpu"


STATUS_FILE = f"{VM_STATE_DIR}/status.json"


def startup_spec(ctx: RenderContext) -> StartupSpec:
    """`ctx`: a training workload's, its trainer writing its status to STATUS_FILE
    (provision.rendering.trainer_context's `status_file`), which the watcher reads."""
    from provision import guest_attributes
    from provision.image import TRAINER_UID

    if STATUS_FILE not in ctx.container.args:
        raise ValueError(f"a TPU VM's trainer is started with --status-file {STATUS_FILE}: make its context so")
    output_dir = ctx.output_dir
    return StartupSpec(
        run=ctx.run, image_uri=ctx.container.image, registry_host=ctx.registry_host,
        container_name="moe-tpu-trainer", log_file="/var/log/moe-tpu/startup.log",
        trainer_log_file="/var/log/moe-tpu/trainer.log",
        container=ctx.container, labels=ctx.labels,
        state_dir=VM_STATE_DIR, status_file=STATUS_FILE, work_dir=f"{VM_STATE_DIR}/work",
        watcher_file=f"{VM_STATE_DIR}/watch-status.py", watch_interval_s=10, trainer_uid=TRAINER_UID,
        guest_namespace=guest_attributes.NAMESPACE, guest_fields=guest_attributes.pairs(),
        output_mount=output_dir if output_dir.startswith("/") else None,
    )


def queued_resource_spec(slice: SliceConfig, ctx: RenderContext, zone: str, renderer: Renderer) -> QueuedResourceSpec:
    reservation = slice.reservation if slice.capacity == "reserved" else None
    if reservation and "/" not in reservation:
        reservation = f"{parent(ctx, zone)}/reservations/{reservation}"
    return QueuedResourceSpec(
        slice=slice, accelerator=catalogue.accelerator(slice.accelerator), zone=zone,
        parent=parent(ctx, zone), node_id=node_id(ctx.run),
        multislice=slice.count > 1, node_count=slice.count, labels=ctx.labels,
        reservation_name=reservation, max_wait_seconds=int(slice.max_wait.total_seconds()),
        startup_script=startup_script(ctx, renderer),
        service_account_scopes=(CLOUD_PLATFORM_SCOPE,),
    )


def startup_script(ctx: RenderContext, renderer: Renderer) -> str:
    """The script every TPU VM worker runs as root at boot (metadata key startup-script)."""
    templates_dir = renderer.templates_dir
    script = render(STARTUP_TEMPLATE, startup_spec(ctx), templates_dir)
    size = len(script.encode("utf-8"))
    if size > MAX_METADATA_VALUE_BYTES:
        overrides = len(" ".join(ctx.overrides).encode("utf-8"))
        limit_kib = MAX_METADATA_VALUE_BYTES // 1024
        head = f"the startup script it renders is {size / 1024:.0f} KiB; a TPU VM metadata value holds at most " \
               f"{limit_kib} KiB"
        if overrides > MAX_METADATA_VALUE_BYTES // 2:
            problem = Problem(ctx.source, "trainer.overrides", f"{head} (the overrides take {overrides // 1024} "
                              "KiB of it: put them in a trainer config file named by trainer.config)")
        else:
            problem = Problem(ctx.source, "", f"{head} ({STARTUP_TEMPLATE} makes most of it; "
                              f"{where(templates_dir)})")
        raise ConfigError([problem])
    return script


def queued_resource_body(slice: SliceConfig, ctx: RenderContext, zone: str, renderer: Renderer) -> str:
    """The rendered QueuedResource body (YAML text) for one zone."""
    spec = queued_resource_spec(slice, ctx, zone, renderer)
    return render(QUEUED_RESOURCE_TEMPLATE, spec, renderer.templates_dir)


def create_queued_resource_request(slice: SliceConfig, ctx: RenderContext, zone: str, renderer: Renderer,
                                   attempt: int = 0) -> Any:
    """The CreateQueuedResourceRequest for one zone, body parsed strictly into the real message.

    Its project is the context's (the config's, else the one the context was made with: the credentials');
    without one it is a UsageError.
    """
    body = messages.queued_resource(queued_resource_body(slice, ctx, zone, renderer), QUEUED_RESOURCE_TEMPLATE)
    return messages.create_queued_resource_request(
        parent(ctx, zone), queued_resource_id(ctx.run),
        request_id(slice, ctx, zone, attempt, content=proto_dict(body)), body)


def render_slice_files(slice: SliceConfig, ctx: RenderContext, renderer: Renderer) -> dict[str, str]:
    """A TPU VM slice's files: the startup script and, per zone, the QueuedResource body and request (`ctx`
    made with the project placeholder where the config names none)."""
    files = {"startup.sh": startup_script(ctx, renderer)}
    for zone in ctx.zones:
        files[f"queued_resource.{zone}.yaml"] = queued_resource_body(slice, ctx, zone, renderer)
        request = create_queued_resource_request(slice, ctx, zone, renderer)
        text = json.dumps(proto_dict(request), indent=2, sort_keys=True) + "\n"
        files[f"create_queued_resource.{zone}.json"] = text
    return files
