"""Pure rendering of Vertex AI's requests: the CustomJob that trains, and the Model, Endpoint and
DeployedModel that serve; each parsed into the API's own message (provision/cloud/messages.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision.cloud import messages
from provision.cloud.messages import proto_dict
from provision.container import Container
from provision.rendering import RenderContext, Renderer
from provision.resources import location_path, resolve_project
from provision.templates import render

if TYPE_CHECKING:
    from provision.config_sections import ServeConfig
    from provision.kinds.vertex.vertex_sections import VertexConfig


CUSTOM_JOB_TEMPLATE = "custom_job.yaml.j2"


@dataclass(frozen=True)
class CustomJobSpec:
    """What the Vertex AI CustomJob body needs: the vertex section (the kind's own), the container and
    where the trainer writes."""

    vertex: VertexConfig
    output_dir: str
    display_name: str
    labels: dict[str, str]
    container: Container  # the trainer's: image, command, args, env
    timeout_seconds: int
    max_wait_seconds: int | None


def region_parent(ctx: RenderContext) -> str:
    """The parent of Vertex AI resources: projects/P/locations/REGION."""
    return location_path(resolve_project(ctx), ctx.region)


def custom_job_spec(vertex: VertexConfig, ctx: RenderContext) -> CustomJobSpec:
    """`ctx`: a training workload's (its container the trainer's)."""
    max_wait = vertex.max_wait
    return CustomJobSpec(
        vertex=vertex, output_dir=ctx.output_dir, display_name=ctx.run, labels=ctx.labels,
        container=ctx.container,
        timeout_seconds=int(vertex.timeout.total_seconds()),
        max_wait_seconds=int(max_wait.total_seconds()) if max_wait is not None else None,
    )


def custom_job_body(vertex: VertexConfig, ctx: RenderContext, renderer: Renderer) -> str:
    """The rendered CustomJob body (YAML text)."""
    return render(CUSTOM_JOB_TEMPLATE, custom_job_spec(vertex, ctx), renderer.templates_dir)


def create_custom_job_request(vertex: VertexConfig, ctx: RenderContext, renderer: Renderer) -> Any:
    """The CreateCustomJobRequest, body parsed strictly into google.cloud.aiplatform.v1.CustomJob."""
    return messages.create_custom_job_request(region_parent(ctx), custom_job_body(vertex, ctx, renderer),
                                              CUSTOM_JOB_TEMPLATE)


def render_custom_job_files(vertex: VertexConfig, ctx: RenderContext, renderer: Renderer) -> dict[str, str]:
    """A Vertex AI job's files: the CustomJob body and its request (`ctx` made with the project
    placeholder where the config names none)."""
    request = create_custom_job_request(vertex, ctx, renderer)
    return {"custom_job.yaml": custom_job_body(vertex, ctx, renderer),
            "create_custom_job.json": json.dumps(proto_dict(request), indent=2, sort_keys=True) + "\n"}


# The metric Vertex AI autoscales a TPU deployment on (DedicatedResources.autoscaling_metric_specs).
DUTY_CYCLE_METRIC = "aiplatform.googleapis.com/prediction/online/accelerator/duty_cycle"


HEALTH_ROUTE = "/health"


PREDICT_ROUTE = "/v1/completions"  # RawPredict passes an OpenAI completions body through as it is


PROBE_PERIOD_S = 10


def serving_model_body(ctx: RenderContext, startup_s: float) -> dict[str, Any]:
    """The Model to upload (aiplatform.v1.Model, proto JSON): the server's container (a serving context's)
    with Vertex AI's custom-container contract (its port, the predict and health routes) and a startup probe
    on the health route that waits `startup_s` (the load-and-compile estimate) before the replica counts as
    failed."""
    server = ctx.container
    probe = {"http_get": {"path": HEALTH_ROUTE, "port": server.ports[0]}, "period_seconds": PROBE_PERIOD_S,
             "timeout_seconds": 5, "failure_threshold": max(3, -(-int(startup_s) // PROBE_PERIOD_S))}
    return {"display_name": ctx.run, "labels": ctx.labels,
            "container_spec": {"image_uri": server.image, "command": list(server.command), "args": list(server.args),
                               "env": [{"name": k, "value": v} for k, v in sorted(server.env.items())],
                               "ports": [{"container_port": port} for port in server.ports],
                               "predict_route": PREDICT_ROUTE, "health_route": HEALTH_ROUTE,
                               "startup_probe": probe}}


def serving_endpoint_body(ctx: RenderContext) -> dict[str, Any]:
    """The Endpoint (dedicated: streaming predictions need one)."""
    return {"display_name": ctx.run, "labels": ctx.labels, "dedicated_endpoint_enabled": True}


def deployed_model_body(serve: ServeConfig, ctx: RenderContext, model: str) -> dict[str, Any]:
    """The DeployedModel: dedicated resources on the serve section's single-host v5e machine, its replicas,
    autoscaled on the accelerators' duty cycle, spot if asked."""
    return {"model": model, "display_name": ctx.run,
            "dedicated_resources": {
                "machine_spec": {"machine_type": serve.machine_type, "tpu_topology": serve.replica_topology},
                "min_replica_count": serve.min_replicas, "max_replica_count": serve.max_replicas,
                "autoscaling_metric_specs": [{"metric_name": DUTY_CYCLE_METRIC, "target": serve.autoscale_target}],
                "spot": serve.spot}}


def render_serving_files(serve: ServeConfig, ctx: RenderContext, startup_s: float) -> dict[str, str]:
    """A Vertex AI endpoint's files: the Model, the Endpoint and the DeployedModel, checked against the API's
    types (MODEL stands in for the uploaded model's name; `ctx` a serving context, made with the project
    placeholder where the config names none)."""
    parent = region_parent(ctx)
    model = messages.serving_model(serving_model_body(ctx, startup_s))
    endpoint = messages.serving_endpoint(serving_endpoint_body(ctx))
    deployed = messages.deployed_model(deployed_model_body(serve, ctx, f"{parent}/models/MODEL"))
    return {f"{name}.json": json.dumps(proto_dict(message), indent=2, sort_keys=True) + "\n"
            for name, message in (("serving_model", model), ("serving_endpoint", endpoint),
                                  ("deployed_model", deployed))}
