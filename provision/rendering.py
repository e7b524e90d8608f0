"""Pure rendering: config -> ids, labels, the TPU VM startup script and the QueuedResource request.

No file writes and no cloud calls here. Templates are Jinja, rendered by one Environment with
StrictUndefined and a `shquote` filter; they receive a typed spec, never a raw dict. The request
body is parsed into the real `google.cloud.tpu_v2` message (provision/cloud/messages.py), so a field
the API does not know is an error here rather than at the API.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.cloud import CLOUD_PLATFORM_SCOPE, messages
from provision.cloud.messages import proto_dict
from provision.errors import ConfigError, Problem
from provision.container import TRAINER_COMMAND, Container, trainer_container
from provision.resources import MANAGED_BY, RUN_LABEL, location_path, resolve_project
from provision.templates import render, where
from trainer import status as trainer_status

if TYPE_CHECKING:
    from provision.config import Config

QUEUED_RESOURCE_TEMPLATE = "queued_resource.yaml.j2"
STARTUP_TEMPLATE = "startup.sh.j2"
CUSTOM_JOB_TEMPLATE = "custom_job.yaml.j2"

# Fixed namespace for request ids: the same config always yields the same id, so a create
# re-sent after a crash is recognised by the API as the same request.
_REQUEST_NAMESPACE = uuid.UUID("6f1c3a52-5d1e-4c7e-9a43-1e0b7d6a2f10")


# --- names ---------------------------------------------------------------------------

# A metadata value (the startup script) holds at most 256 KiB.
MAX_METADATA_VALUE_BYTES = 256 * 1024

def labels(cfg: Config) -> dict[str, str]:
    """Labels on everything created: the tool and the run (valid GCP label values by construction)."""
    return {MANAGED_BY[0]: MANAGED_BY[1], RUN_LABEL: cfg.run}


def queued_resource_id(cfg: Config) -> str:
    return cfg.run


def node_id(cfg: Config) -> str:
    """The node id (one slice) or node_id_prefix (multislice; the service appends -0, -1, ...)."""
    return f"{cfg.run}-tpu"


def request_id(cfg: Config, zone: str, attempt: int = 0, project: str | None = None, content: Any = None) -> str:
    """Deterministic request id for CreateQueuedResource: the same request (project, zone, run, body)
    always gets the same id, so a create re-sent after a crash is recognised as the same request; a
    changed body, or `attempt` > 0 (a deliberate re-create), gets another."""
    key = f"{project or cfg.project}/{zone}/{cfg.run}/{cfg.slice.accelerator}"
    if content is not None:
        key += "/" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    if attempt:
        key += f"/{attempt}"
    return str(uuid.uuid5(_REQUEST_NAMESPACE, key))


def parent(cfg: Config, zone: str, project: str | None = None) -> str:
    return location_path(_project(cfg, project), zone)


def _project(cfg: Config, project: str | None = None) -> str:
    """The project a request goes to (see provision.resources.resolve_project)."""
    return resolve_project(cfg, project)


def trainer_argv(cfg: Config, status_file: str | None = None) -> list[str]:
    """The trainer container's whole argv (provision.container.trainer_container: the one place it is made)."""
    return list(trainer_container(cfg, "", status_file).argv)


@dataclass(frozen=True)
class Renderer:
    """The templates of one invocation (`--templates` first, then the builtin ones) and the image
    reference they render, given: every file of the run names the same image, and rendering never
    hashes the source tree (provision.context.renderer_for resolves the image, once per command)."""

    image: str
    templates_dir: Path | None = None


# --- specs the templates receive --------------------------------------------------------

@dataclass(frozen=True)
class StartupSpec:
    """What the TPU VM startup script needs."""

    config: Config
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
    """What the QueuedResource body needs, for one zone."""

    config: Config
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


@dataclass(frozen=True)
class CustomJobSpec:
    """What the Vertex AI CustomJob body needs."""

    config: Config
    display_name: str
    labels: dict[str, str]
    container: Container  # the trainer's: image, command, args, env
    timeout_seconds: int
    max_wait_seconds: int | None


def region_parent(cfg: Config, project: str | None = None) -> str:
    """The parent of Vertex AI resources: projects/P/locations/REGION."""
    return location_path(_project(cfg, project), cfg.region)


def custom_job_spec(cfg: Config, image: str) -> CustomJobSpec:
    container = trainer_container(cfg, image)
    max_wait = cfg.vertex.max_wait
    return CustomJobSpec(
        config=cfg, display_name=cfg.run, labels=labels(cfg), container=container,
        timeout_seconds=int(cfg.vertex.timeout.total_seconds()),
        max_wait_seconds=int(max_wait.total_seconds()) if max_wait is not None else None,
    )


# On every TPU VM (not the dry run's .moe-tpu/ here, provision.app.LOCAL_STATE_DIR): the trainer's status
# file, the watcher and the trainer's working directory.
VM_STATE_DIR = "/var/lib/moe-tpu"
STATUS_FILE = f"{VM_STATE_DIR}/status.json"


def startup_spec(cfg: Config, image: str) -> StartupSpec:
    from provision import guest_attributes
    from provision.image import TRAINER_UID

    output_dir = cfg.trainer.output_dir
    return StartupSpec(
        config=cfg, run=cfg.run, image_uri=image, registry_host=cfg.image.registry_host,
        container_name="moe-tpu-trainer", log_file="/var/log/moe-tpu/startup.log",
        trainer_log_file="/var/log/moe-tpu/trainer.log",
        container=trainer_container(cfg, image, status_file=STATUS_FILE), labels=labels(cfg),
        state_dir=VM_STATE_DIR, status_file=STATUS_FILE, work_dir=f"{VM_STATE_DIR}/work",
        watcher_file=f"{VM_STATE_DIR}/watch-status.py", watch_interval_s=10, trainer_uid=TRAINER_UID,
        guest_namespace=guest_attributes.NAMESPACE, guest_fields=guest_attributes.pairs(),
        output_mount=output_dir if output_dir.startswith("/") else None,
    )


def queued_resource_spec(cfg: Config, zone: str, renderer: Renderer,
                         project: str | None = None) -> QueuedResourceSpec:
    reservation = cfg.slice.reservation if cfg.slice.capacity == "reserved" else None
    if reservation and "/" not in reservation:
        reservation = f"{parent(cfg, zone, project)}/reservations/{reservation}"
    return QueuedResourceSpec(
        config=cfg, accelerator=cfg.accelerator_type(), zone=zone,
        parent=parent(cfg, zone, project), node_id=node_id(cfg),
        multislice=cfg.slice.count > 1, node_count=cfg.slice.count, labels=labels(cfg),
        reservation_name=reservation, max_wait_seconds=int(cfg.slice.max_wait.total_seconds()),
        startup_script=startup_script(cfg, renderer),
        service_account_scopes=(CLOUD_PLATFORM_SCOPE,),
    )


# --- templates ---------------------------------------------------------------------------

def startup_script(cfg: Config, renderer: Renderer) -> str:
    """The script every TPU VM worker runs as root at boot (metadata key startup-script)."""
    templates_dir = renderer.templates_dir
    script = render(STARTUP_TEMPLATE, startup_spec(cfg, renderer.image), templates_dir)
    size = len(script.encode("utf-8"))
    if size > MAX_METADATA_VALUE_BYTES:
        overrides = len(" ".join(cfg.trainer.set_flags()).encode("utf-8"))
        limit_kib = MAX_METADATA_VALUE_BYTES // 1024
        head = f"the startup script it renders is {size / 1024:.0f} KiB; a TPU VM metadata value holds at most " \
               f"{limit_kib} KiB"
        if overrides > MAX_METADATA_VALUE_BYTES // 2:
            problem = Problem(str(cfg.source), "trainer.overrides", f"{head} (the overrides take {overrides // 1024} "
                              "KiB of it: put them in a trainer config file named by trainer.config)")
        else:
            problem = Problem(str(cfg.source), "", f"{head} ({STARTUP_TEMPLATE} makes most of it; "
                              f"{where(templates_dir)})")
        raise ConfigError([problem])
    return script


def queued_resource_body(cfg: Config, zone: str, renderer: Renderer,
                         project: str | None = None) -> str:
    """The rendered QueuedResource body (YAML text) for one zone."""
    spec = queued_resource_spec(cfg, zone, renderer, project)
    return render(QUEUED_RESOURCE_TEMPLATE, spec, renderer.templates_dir)


def create_queued_resource_request(cfg: Config, zone: str, renderer: Renderer,
                                   attempt: int = 0, project: str | None = None) -> Any:
    """The CreateQueuedResourceRequest for one zone, body parsed strictly into the real message.

    `project` overrides cfg.project (for a config without one, the credentials' project);
    without either it is a UsageError.
    """
    body = messages.queued_resource(queued_resource_body(cfg, zone, renderer, project), QUEUED_RESOURCE_TEMPLATE)
    return messages.create_queued_resource_request(
        parent(cfg, zone, project), queued_resource_id(cfg),
        request_id(cfg, zone, attempt, project, content=proto_dict(body)), body)


def custom_job_body(cfg: Config, renderer: Renderer) -> str:
    """The rendered CustomJob body (YAML text)."""
    return render(CUSTOM_JOB_TEMPLATE, custom_job_spec(cfg, renderer.image), renderer.templates_dir)


def create_custom_job_request(cfg: Config, renderer: Renderer, project: str | None = None) -> Any:
    """The CreateCustomJobRequest, body parsed strictly into google.cloud.aiplatform.v1.CustomJob."""
    return messages.create_custom_job_request(region_parent(cfg, project), custom_job_body(cfg, renderer),
                                              CUSTOM_JOB_TEMPLATE)


# Stands in for the project in rendered files when the config names none (the real one
# comes from the credentials at run time).
PROJECT_PLACEHOLDER = "PROJECT"


def render_all(cfg: Config, renderer: Renderer) -> dict[str, str]:
    """Every rendered file of the config's target, by file name (its kind's `render`)."""
    return cfg.kind.render(cfg, renderer)


def render_custom_job_files(cfg: Config, renderer: Renderer) -> dict[str, str]:
    """A Vertex AI job's files: the CustomJob body and its request."""
    request = create_custom_job_request(cfg, renderer, project=cfg.project or PROJECT_PLACEHOLDER)
    return {"custom_job.yaml": custom_job_body(cfg, renderer),
            "create_custom_job.json": json.dumps(proto_dict(request), indent=2, sort_keys=True) + "\n"}


def render_slice_files(cfg: Config, renderer: Renderer) -> dict[str, str]:
    """A TPU VM slice's files: the startup script and, per zone, the QueuedResource body and request."""
    project = cfg.project or PROJECT_PLACEHOLDER
    files = {"startup.sh": startup_script(cfg, renderer)}
    for zone in cfg.zones:
        files[f"queued_resource.{zone}.yaml"] = queued_resource_body(cfg, zone, renderer, project)
        request = create_queued_resource_request(cfg, zone, renderer, project=project)
        text = json.dumps(proto_dict(request), indent=2, sort_keys=True) + "\n"
        files[f"create_queued_resource.{zone}.json"] = text
    return files


# --- Vertex AI online prediction: the model, the endpoint, the deployed model (issue 33) -------------------
# The metric Vertex AI autoscales a TPU deployment on (DedicatedResources.autoscaling_metric_specs).
DUTY_CYCLE_METRIC = "aiplatform.googleapis.com/prediction/online/accelerator/duty_cycle"
HEALTH_ROUTE = "/health"
PREDICT_ROUTE = "/v1/completions"  # RawPredict passes an OpenAI completions body through as it is
PROBE_PERIOD_S = 10


def serving_model_body(cfg: Config, image: str, startup_s: float) -> dict[str, Any]:
    """The Model to upload (aiplatform.v1.Model, proto JSON): the server's container with Vertex AI's
    custom-container contract (its port, the predict and health routes) and a startup probe on the health
    route that waits `startup_s` (the load-and-compile estimate) before the replica counts as failed."""
    from provision.container import server_container

    server = server_container(cfg, image)
    probe = {"http_get": {"path": HEALTH_ROUTE, "port": server.ports[0]}, "period_seconds": PROBE_PERIOD_S,
             "timeout_seconds": 5, "failure_threshold": max(3, -(-int(startup_s) // PROBE_PERIOD_S))}
    return {"display_name": cfg.run, "labels": labels(cfg),
            "container_spec": {"image_uri": server.image, "command": list(server.command), "args": list(server.args),
                               "env": [{"name": k, "value": v} for k, v in sorted(server.env.items())],
                               "ports": [{"container_port": port} for port in server.ports],
                               "predict_route": PREDICT_ROUTE, "health_route": HEALTH_ROUTE,
                               "startup_probe": probe}}


def serving_endpoint_body(cfg: Config) -> dict[str, Any]:
    """The Endpoint (dedicated: streaming predictions need one)."""
    return {"display_name": cfg.run, "labels": labels(cfg), "dedicated_endpoint_enabled": True}


def deployed_model_body(cfg: Config, model: str) -> dict[str, Any]:
    """The DeployedModel: dedicated resources on the serve section's single-host v5e machine, its replicas,
    autoscaled on the accelerators' duty cycle, spot if asked."""
    serve = cfg.serve
    return {"model": model, "display_name": cfg.run,
            "dedicated_resources": {
                "machine_spec": {"machine_type": serve.machine_type, "tpu_topology": serve.replica_topology},
                "min_replica_count": serve.min_replicas, "max_replica_count": serve.max_replicas,
                "autoscaling_metric_specs": [{"metric_name": DUTY_CYCLE_METRIC, "target": serve.autoscale_target}],
                "spot": serve.spot}}


def render_serving_files(cfg: Config, renderer: Renderer, startup_s: float) -> dict[str, str]:
    """A Vertex AI endpoint's files: the Model, the Endpoint and the DeployedModel, checked against the API's
    types (MODEL stands in for the uploaded model's name)."""
    project = cfg.project or PROJECT_PLACEHOLDER
    parent = region_parent(cfg, project)
    model = messages.serving_model(serving_model_body(cfg, renderer.image, startup_s))
    endpoint = messages.serving_endpoint(serving_endpoint_body(cfg))
    deployed = messages.deployed_model(deployed_model_body(cfg, f"{parent}/models/MODEL"))
    return {f"{name}.json": json.dumps(proto_dict(message), indent=2, sort_keys=True) + "\n"
            for name, message in (("serving_model", model), ("serving_endpoint", endpoint),
                                  ("deployed_model", deployed))}
