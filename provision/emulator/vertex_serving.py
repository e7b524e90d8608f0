"""Vertex AI online prediction: google.cloud.aiplatform.v1 ModelService (models), EndpointService
(endpoints, deploy and undeploy) and PredictionService (RawPredict, StreamRawPredict): request checks,
the changes they make to the world, proto views. Their RPCs are vertex_serving_rpcs.py.

A deployed model runs the real server: DeployModel starts the model's container (its command, args and
environment, with Vertex's AIP_* variables) through the emulator's LocalServers (local_server.py), and its
operation ends once the server's health route answers 200, or fails with the server's last words when the
server exits first. RawPredict and StreamRawPredict forward the HTTP body to the container's predict route.
An emulator without a state directory (tests of the checks) has no servers: its deploys end after
DEPLOYING_S and its predictions answer UNAVAILABLE.

Imports google-cloud-aiplatform, slow to import: loaded on the first call of one of these services.
Messages marked "unconfirmed" have no public record; they are the most plausible shape.
"""

from __future__ import annotations

import json
import re

from google.cloud import aiplatform_v1 as v1
from google.rpc import error_details_pb2

from provision.emulator import rpc, validate
from provision.emulator.validate import ApiError, not_found
from provision.emulator.vertex import numeric_id, region
from provision.emulator.world import Operation, World, register_part
from trainer.outputs import Phase

# The single-host v5e machine types online prediction serves, with their one topology (Vertex AI docs,
# "Serve models with Cloud TPU": ct5lp-hightpu-1t 1x1, -4t 2x2, -8t 2x4).
SERVING_TOPOLOGY = {"ct5lp-hightpu-1t": "1x1", "ct5lp-hightpu-4t": "2x2", "ct5lp-hightpu-8t": "2x4"}
# The autoscaling metrics DedicatedResources.autoscaling_metric_specs documents.
AUTOSCALING_METRICS = ("aiplatform.googleapis.com/prediction/online/cpu/utilization",
                       "aiplatform.googleapis.com/prediction/online/accelerator/duty_cycle",
                       "aiplatform.googleapis.com/prediction/online/request_count")
QUOTA_ID = "TPUV5sLitepodServingPerProjectPerZoneForTPUAPI"
QUOTA_MESSAGE = "Quota limit '{quota}' has been exceeded. Limit: 0 in zone {zone}."
STOCKOUT_CODE = 8
STOCKOUT_MESSAGE = "Resources are insufficient in region: {region}. Please try a different region."
STOCKOUT_AFTER_S = 600.0  # unconfirmed: how long a deploy tries before it gives up on capacity
DEPLOYING_S = 300.0  # without servers (no state directory): how long a deploy takes
READY_TIMEOUT_S = 3600.0  # the server must answer its health route within this (deployment_timeout's default)
UPLOAD_S, CREATE_S, UNDEPLOY_S, DELETE_S = 30.0, 10.0, 60.0, 30.0  # unconfirmed, plausible
ENDPOINT_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/endpoints/([0-9]+)$")
MODEL_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/models/([0-9]+)(@[0-9]+)?$")
DEFAULT_PREDICT_ROUTE, DEFAULT_HEALTH_ROUTE = "/predict", "/health"


def _json(message) -> dict:
    return json.loads(type(message).to_json(message, preserving_proto_field_name=True,
                                            use_integers_for_enums=False))


def _name(name: str, pattern: re.Pattern, collection: str) -> str:
    """Check a model or endpoint name (messages unconfirmed); returns its parent."""
    match = pattern.match(name or "")
    if not match:
        raise ApiError("INVALID_ARGUMENT", f"Invalid resource field value in the request: name {name!r} is not of "
                                           "the form 'projects/{project}/locations/{location}/"
                                           f"{collection}/{{id}}'")
    region(match.group(1))
    return match.group(1)


# --- request checks ----------------------------------------------------------------------


def check_model(model: v1.Model) -> None:
    """What UploadModel refuses (messages unconfirmed)."""
    if not model.display_name:
        raise ApiError("INVALID_ARGUMENT", "model.display_name is required")
    if not model.container_spec.image_uri:
        raise ApiError("INVALID_ARGUMENT", "model.container_spec.image_uri is required")
    for route in ("predict_route", "health_route"):
        value = getattr(model.container_spec, route)
        if value and not value.startswith("/"):
            raise ApiError("INVALID_ARGUMENT", f"model.container_spec.{route} must start with '/', got {value!r}")
    validate.labels(dict(model.labels))


def check_dedicated(resources: v1.DedicatedResources) -> str:
    """What DeployModel refuses in dedicated resources; returns the topology in effect."""
    spec = resources.machine_spec
    if spec.machine_type not in SERVING_TOPOLOGY:
        # The message is the one confirmed for custom jobs (docs/api-facts.md); prediction's is unconfirmed.
        raise ApiError("INVALID_ARGUMENT", f'Machine type "{spec.machine_type}" is not supported.')
    if spec.tpu_topology and spec.tpu_topology != SERVING_TOPOLOGY[spec.machine_type]:
        raise ApiError("INVALID_ARGUMENT", f'TPU topology "{spec.tpu_topology}" is not supported for machine type '
                                           f'"{spec.machine_type}" in online prediction (single host: '
                                           f'{SERVING_TOPOLOGY[spec.machine_type]})')
    if resources.min_replica_count < 1:
        raise ApiError("INVALID_ARGUMENT", "deployed_model.dedicated_resources.min_replica_count must be at least 1")
    if resources.max_replica_count and resources.max_replica_count < resources.min_replica_count:
        raise ApiError("INVALID_ARGUMENT", f"deployed_model.dedicated_resources.max_replica_count "
                                           f"({resources.max_replica_count}) must be greater than or equal to "
                                           f"min_replica_count ({resources.min_replica_count})")
    for metric in resources.autoscaling_metric_specs:
        if metric.metric_name not in AUTOSCALING_METRICS:
            raise ApiError("INVALID_ARGUMENT", f"Unsupported autoscaling metric {metric.metric_name!r}; supported: "
                                               f"{', '.join(AUTOSCALING_METRICS)}")
        if not 0 < metric.target <= 100:
            raise ApiError("INVALID_ARGUMENT", f"autoscaling target {metric.target} for {metric.metric_name} must "
                                               "be between 1 and 100")
    return spec.tpu_topology or SERVING_TOPOLOGY[spec.machine_type]


def quota_error(project: str, where: str) -> ApiError:
    """The v5e serving quota, refused at once with a QuotaFailure detail; the message is the TPU API's
    confirmed shape (docs/api-facts.md), unconfirmed for Vertex AI's DeployModel."""
    zone = f"{where}-a"
    message = QUOTA_MESSAGE.format(quota=QUOTA_ID, zone=zone)
    failure = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
        subject=f"project:{project}", description=message, api_service="tpu.googleapis.com",
        quota_metric=QUOTA_ID, quota_id=QUOTA_ID, quota_dimensions={"zone": zone}, quota_value=0)])
    return ApiError("RESOURCE_EXHAUSTED", message, [failure])


# --- the world's records -----------------------------------------------------------------

@register_part
class OnlineServing:
    """Vertex AI's models and endpoints in the emulated world (its part, saved under "vertex_serving"), plain
    JSON: `records` is {"models": {name: record}, "endpoints": {name: record}, "first_region": str | None};
    a record is {"name", "request" (the proto JSON as created), "create_time"}; an endpoint's record has
    "deployed": {id: {"request", "create_time", "operation", "server_key", "phase": deploying | deployed,
    "ready": true once its server answered}}."""

    KEY = "vertex_serving"

    def __init__(self, records: dict | None = None) -> None:
        self.records: dict = records or {}

    @classmethod
    def of(cls, world: World) -> OnlineServing:
        return world.part(cls.KEY)

    def to_json(self) -> dict:
        return self.records

    @classmethod
    def from_json(cls, d: dict | None) -> OnlineServing:
        return cls(dict(d or {}))

    def prune(self, now: float) -> None:
        pass  # a deleted model or endpoint leaves the records at once


def model_records(world: World) -> dict:
    return OnlineServing.of(world).records.setdefault("models", {})


def endpoint_records(world: World) -> dict:
    return OnlineServing.of(world).records.setdefault("endpoints", {})


def live_model(world: World, name: str) -> dict:
    _name(name, MODEL_RE, "models")
    record = model_records(world).get(name.split("@")[0])
    if record is None:
        raise not_found(name)
    return record


def live_endpoint(world: World, name: str) -> dict:
    _name(name, ENDPOINT_RE, "endpoints")
    record = endpoint_records(world).get(name)
    if record is None:
        raise not_found(name)
    return record


def _operation(world: World, parent: str, verb: str, target: str, now: float, after: float,
               response: dict | None = None, error: dict | None = None) -> Operation:
    op = Operation(name=f"{parent}/operations/{numeric_id(world)}", service="vertex", verb=verb, target=target,
                   create_time=now, done_at=now + after, response=response, error=error)
    return world.add_operation(op)


def upload_model(world: World, req: v1.UploadModelRequest, now: float) -> Operation:
    region(req.parent)
    model = v1.Model(req.model)
    check_model(model)
    name = f"{req.parent}/models/{numeric_id(world)}"
    model_records(world)[name] = {"name": name, "request": _json(model), "create_time": now}
    return _operation(world, req.parent, "upload_model", name, now, UPLOAD_S,
                      response={"model": name, "model_version_id": "1"})


def create_endpoint(world: World, req: v1.CreateEndpointRequest, now: float) -> Operation:
    region(req.parent)
    endpoint = v1.Endpoint(req.endpoint)
    if not endpoint.display_name:
        raise ApiError("INVALID_ARGUMENT", "endpoint.display_name is required")
    validate.labels(dict(endpoint.labels))
    name = f"{req.parent}/endpoints/{req.endpoint_id or numeric_id(world)}"
    if name in endpoint_records(world):
        raise ApiError("ALREADY_EXISTS", f"Endpoint {name} already exists.")
    record = {"name": name, "request": _json(endpoint), "create_time": now, "deployed": {}}
    endpoint_records(world)[name] = record
    return _operation(world, req.parent, "create_endpoint", name, now, CREATE_S, response=_json(endpoint_view(record)))


def _container_env(spec: v1.ModelContainerSpec, endpoint: str, deployed_id: str) -> dict[str, str]:
    """The container's environment as Vertex AI sets it (AIP_* per the custom container requirements)."""
    port = spec.ports[0].container_port if spec.ports else 8080
    env = {e.name: e.value for e in spec.env}
    return {**env, "AIP_HTTP_PORT": str(port), "AIP_PREDICT_ROUTE": spec.predict_route or DEFAULT_PREDICT_ROUTE,
            "AIP_HEALTH_ROUTE": spec.health_route or DEFAULT_HEALTH_ROUTE,
            "AIP_ENDPOINT_ID": endpoint.rsplit("/", 1)[-1],
            "AIP_DEPLOYED_MODEL_ID": deployed_id, "AIP_MODE": "PREDICTION"}


def deploy_model(call: rpc.Call, req: v1.DeployModelRequest) -> Operation:
    world, now = call.world, call.now
    parent = _name(req.endpoint, ENDPOINT_RE, "endpoints")
    endpoint = live_endpoint(world, req.endpoint)
    deployed = v1.DeployedModel(req.deployed_model)
    live_model(world, deployed.model)  # NOT_FOUND for a model that is not there
    if deployed.model.split("/models/")[0] != parent:
        raise ApiError("INVALID_ARGUMENT", f"Model {deployed.model} is not in the endpoint's location {parent}")
    if "dedicated_resources" not in deployed:
        # TPU serving takes dedicated resources only (automatic resources are for pre-built containers).
        raise ApiError("INVALID_ARGUMENT", "deployed_model.dedicated_resources is required for a custom container "
                                           "on Cloud TPU")
    check_dedicated(deployed.dedicated_resources)
    project, where = region(parent)
    if call.scenario == "quota":
        raise quota_error(project, where)
    serving = OnlineServing.of(world).records
    if serving.get("first_region") is None:
        serving["first_region"] = where
    deployed_id = str(numeric_id(world))[:16]
    deployed.id = deployed_id
    stocked_out = call.scenario == "stockout" and where == serving["first_region"]
    key = f"{req.endpoint}/deployedModels/{deployed_id}"
    op = _operation(world, req.endpoint, "deploy", req.endpoint, now,
                    STOCKOUT_AFTER_S if stocked_out else (READY_TIMEOUT_S if call.servers else DEPLOYING_S),
                    response={"deployed_model": {**_json(deployed), "create_time": rpc.timestamp(now).ToJsonString()}})
    if stocked_out:
        op.response, op.error = None, {"code": STOCKOUT_CODE, "message": STOCKOUT_MESSAGE.format(region=where)}
    endpoint["deployed"][deployed_id] = {"request": _json(deployed), "create_time": now, "operation": op.name,
                                         "server_key": key, "phase": "deploying"}
    return op


def server_launch(call: rpc.Call, endpoint_name: str, deployed_id: str) -> tuple:
    """LocalServers.start's arguments for a deployed model's server: its model's container, as Vertex AI
    runs it (key, argv, environment, log path)."""
    record = live_endpoint(call.world, endpoint_name)["deployed"][deployed_id]
    model = live_model(call.world, record["request"]["model"])
    spec = v1.Model.from_json(json.dumps(model["request"]), ignore_unknown_fields=True).container_spec
    key = record["server_key"]
    return (key, [*spec.command, *spec.args], _container_env(spec, endpoint_name, deployed_id),
            call.servers.dir / f"{key.replace('/', '_')}.log")


def settle(call: rpc.Call) -> None:
    """Bring every deploy in progress up to date: ended once its server is ready (or failed, with the
    server's last words), or at its operation's end without servers or on a stockout."""
    for endpoint in list(endpoint_records(call.world).values()):
        for deployed_id, record in list(endpoint["deployed"].items()):
            if record["phase"] != "deploying":
                continue
            op = call.world.operations.get(record["operation"])
            if op is None:
                continue
            if call.servers is not None and op.error is None and not op.done(call.now):
                phase, _, last_words = call.servers.state(record["server_key"])
                if phase == Phase.STOPPED:
                    # Its server was never started: the process that made the deploy (and embedded this
                    # emulator) ended between saving it and starting the server. The cloud would go on.
                    call.servers.start(*server_launch(call, endpoint["name"], deployed_id))
                elif phase == Phase.READY:
                    op.done_at, record["ready"] = call.now, True
                elif phase == Phase.FAILED:
                    call.servers.stop(record["server_key"])
                    op.done_at, op.response = call.now, None
                    op.error = {"code": 3, "message": f"Model server never became ready: the container exited. "
                                                      f"Its last log lines:\n{last_words}"}
            if op.done(call.now):
                if op.error is None and call.servers is not None and not record.get("ready"):
                    # Its deployment timeout passed with the server still starting: Vertex AI fails it.
                    call.servers.stop(record["server_key"])
                    op.response = None
                    op.error = {"code": 4, "message": f"Model server never became ready within the deployment "
                                                      f"timeout ({READY_TIMEOUT_S:.0f}s)."}
                if op.error is None:
                    record["phase"] = "deployed"
                else:
                    del endpoint["deployed"][deployed_id]  # a failed deploy leaves no deployed model


def undeploy_model(call: rpc.Call, req: v1.UndeployModelRequest) -> Operation:
    endpoint = live_endpoint(call.world, req.endpoint)
    record = endpoint["deployed"].pop(req.deployed_model_id, None)
    if record is None:
        raise ApiError("NOT_FOUND", f"Deployed model {req.deployed_model_id} not found in endpoint {req.endpoint}.")
    pending = call.world.operations.get(record["operation"])
    if pending is not None and not pending.done(call.now):
        # Unconfirmed: undeploying a model whose deploy has not ended cancels that deploy.
        pending.done_at, pending.response = call.now, None
        pending.error = {"code": 1, "message": "The deployment was cancelled: the model was undeployed."}
    if call.servers is not None:
        call.servers.stop(record["server_key"])
    return _operation(call.world, req.endpoint, "undeploy", req.endpoint, call.now, UNDEPLOY_S, response={})


def delete_endpoint(world: World, name: str, now: float) -> Operation:
    endpoint = live_endpoint(world, name)
    if endpoint["deployed"]:
        raise ApiError("FAILED_PRECONDITION", f"Endpoint {name} has deployed models; undeploy them first.")
    del endpoint_records(world)[name]
    return _operation(world, name.rsplit("/endpoints/", 1)[0], "delete", name, now, DELETE_S)


def delete_model(world: World, name: str, now: float) -> Operation:
    record = live_model(world, name)
    users = [e["name"] for e in endpoint_records(world).values()
             if any(d["request"].get("model", "").split("@")[0] == record["name"] for d in e["deployed"].values())]
    if users:
        # The docs: a model deployed to an endpoint cannot be deleted; the message is unconfirmed.
        raise ApiError("FAILED_PRECONDITION", f"Model {name} is deployed to endpoint(s) {', '.join(users)}; "
                                              "undeploy it first.")
    del model_records(world)[record["name"]]
    return _operation(world, record["name"].rsplit("/models/", 1)[0], "delete", name, now, DELETE_S)


# --- views -------------------------------------------------------------------------------


def model_view(record: dict, world: World) -> v1.Model:
    model = v1.Model.from_json(json.dumps(record["request"]), ignore_unknown_fields=True)
    model.name, model.version_id = record["name"], "1"
    model.create_time = model.update_time = rpc.timestamp(record["create_time"])
    for endpoint in endpoint_records(world).values():
        for deployed_id, deployed in endpoint["deployed"].items():
            if deployed["request"].get("model", "").split("@")[0] == record["name"]:
                model.deployed_models.append(v1.DeployedModelRef(endpoint=endpoint["name"],
                                                                  deployed_model_id=deployed_id))
    return model


def endpoint_view(record: dict) -> v1.Endpoint:
    endpoint = v1.Endpoint.from_json(json.dumps(record["request"]), ignore_unknown_fields=True)
    endpoint.name = record["name"]
    endpoint.create_time = endpoint.update_time = rpc.timestamp(record["create_time"])
    if endpoint.dedicated_endpoint_enabled:
        project, where = region(record["name"].split("/endpoints/")[0])
        number = record["name"].rsplit("/", 1)[-1]
        endpoint.dedicated_endpoint_dns = f"{number}.{where}-{project}.prediction.vertexai.goog"
    for deployed_id, deployed in record["deployed"].items():
        view = v1.DeployedModel.from_json(json.dumps(deployed["request"]), ignore_unknown_fields=True)
        view.create_time = rpc.timestamp(deployed["create_time"])
        ready = deployed["phase"] == "deployed"
        view.status = v1.DeployedModel.Status(
            message="Deployed" if ready else "Deploying", last_update_time=rpc.timestamp(deployed["create_time"]),
            available_replica_count=view.dedicated_resources.min_replica_count if ready else 0)
        endpoint.deployed_models.append(view)
        if ready:
            endpoint.traffic_split[deployed_id] = 100 // max(1, sum(
                d["phase"] == "deployed" for d in record["deployed"].values()))
    return endpoint
