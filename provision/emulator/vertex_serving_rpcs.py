"""Vertex AI online prediction's RPCs: ModelService, EndpointService and PredictionService (RawPredict,
StreamRawPredict) over the records, checks and changes of vertex_serving.py, and their operations' views.
Other methods of these services answer UNIMPLEMENTED.

Imports google-cloud-aiplatform, slow to import: loaded on the first call of one of these services.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from google.api import httpbody_pb2
from google.cloud import aiplatform_v1 as v1
from google.longrunning import operations_pb2

from provision.emulator import rpc, vertex
from provision.emulator.validate import ApiError
from provision.emulator.vertex import region
from provision.emulator.vertex_serving import (
    DEFAULT_PREDICT_ROUTE,
    create_endpoint,
    delete_endpoint,
    delete_model,
    deploy_model,
    endpoint_records,
    endpoint_view,
    live_endpoint,
    live_model,
    model_records,
    model_view,
    server_launch,
    settle,
    undeploy_model,
    upload_model,
)
from provision.emulator.world import Operation


# --- filters: labels.KEY="VALUE" and display_name="X", joined by AND (vertex.parse_filter's subset) ---


def _matches(record: dict, text: str) -> bool:
    from provision.emulator.vertex import parse_filter

    request = record["request"]
    return all(test(request, "") for test in parse_filter(text))


# --- RPCs --------------------------------------------------------------------------------


def operation_view(op: Operation, now: float) -> operations_pb2.Operation:
    """A serving operation as google.longrunning.Operation, with its method's own response and metadata types
    (OPERATION_TYPES); a delete as the other Vertex AI deletes (vertex.operation_view)."""
    types = OPERATION_TYPES.get(op.verb)
    if types is None:
        return vertex.operation_view(op, now)
    response_type, metadata_type = types

    def metadata(op: Operation, now: float):
        updated = op.done_at if op.done(now) else op.create_time
        return metadata_type.pb(metadata_type(generic_metadata=v1.GenericOperationMetadata(
            create_time=rpc.timestamp(op.create_time), update_time=rpc.timestamp(updated))))

    def response(op: Operation):
        return response_type.pb(response_type.from_json(json.dumps(op.response), ignore_unknown_fields=True))
    return rpc.longrunning(op, now, metadata, response)


def _started(op: Operation, now: float) -> operations_pb2.Operation:
    return rpc.started(operation_view(op, now))


def UploadModel(call: rpc.Call, req: v1.UploadModelRequest):
    return _started(upload_model(call.world, req, call.now), call.now)


def GetModel(call: rpc.Call, req: v1.GetModelRequest):
    return model_view(live_model(call.world, req.name), call.world)


def ListModels(call: rpc.Call, req: v1.ListModelsRequest):
    region(req.parent)
    found = [m for m in model_records(call.world).values() if m["name"].startswith(req.parent + "/models/")
             and _matches(m, req.filter)]
    items, token = rpc.page(sorted(found, key=lambda m: (m["create_time"], m["name"])), req.page_size, req.page_token)
    return v1.ListModelsResponse(models=[model_view(m, call.world) for m in items], next_page_token=token)


def DeleteModel(call: rpc.Call, req: v1.DeleteModelRequest):
    return _started(delete_model(call.world, req.name, call.now), call.now)


def CreateEndpoint(call: rpc.Call, req: v1.CreateEndpointRequest):
    return _started(create_endpoint(call.world, req, call.now), call.now)


def GetEndpoint(call: rpc.Call, req: v1.GetEndpointRequest):
    settle(call)
    return endpoint_view(live_endpoint(call.world, req.name))


def ListEndpoints(call: rpc.Call, req: v1.ListEndpointsRequest):
    region(req.parent)
    settle(call)
    found = [e for e in endpoint_records(call.world).values() if e["name"].startswith(req.parent + "/endpoints/")
             and _matches(e, req.filter)]
    items, token = rpc.page(sorted(found, key=lambda e: (e["create_time"], e["name"])), req.page_size, req.page_token)
    return v1.ListEndpointsResponse(endpoints=[endpoint_view(e) for e in items], next_page_token=token)


def DeleteEndpoint(call: rpc.Call, req: v1.DeleteEndpointRequest):
    settle(call)
    return _started(delete_endpoint(call.world, req.name, call.now), call.now)


def DeployModel(call: rpc.Call, req: v1.DeployModelRequest):
    settle(call)
    op = deploy_model(call, req)
    answer = _started(op, call.now)
    if call.servers is None or op.error is not None:
        return answer
    launch = server_launch(call, req.endpoint, op.response["deployed_model"]["id"])

    def then():
        # Started once the transaction is saved: no server runs for a deploy the world does not hold. A
        # kill -9 of the process that embeds the emulator, between the two, leaves it to `settle`.
        call.servers.start(*launch)
        return answer
    return rpc.Later(then)


def UndeployModel(call: rpc.Call, req: v1.UndeployModelRequest):
    settle(call)
    return _started(undeploy_model(call, req), call.now)


def _serving(call: rpc.Call, endpoint_name: str) -> tuple:
    """(the servers, the key of the endpoint's deployed model that serves) for a prediction."""
    settle(call)
    endpoint = live_endpoint(call.world, endpoint_name)
    ready = [d for d in endpoint["deployed"].values() if d["phase"] == "deployed"]
    if not ready:
        raise ApiError("FAILED_PRECONDITION", f"Endpoint {endpoint_name} has no deployed model to serve the request.")
    if call.servers is None:
        raise ApiError("UNAVAILABLE", "the emulator runs no model server (it has no state directory)")
    model = live_model(call.world, ready[0]["request"]["model"])
    route = model["request"].get("container_spec", {}).get("predict_route") or DEFAULT_PREDICT_ROUTE
    return call.servers, ready[0]["server_key"], route


def _forwarded(servers, key: str, route: str, body: httpbody_pb2.HttpBody, stream: bool):
    try:
        return servers.forward(key, "POST", route, body.data, stream=stream)
    except OSError as exc:
        raise ApiError("UNAVAILABLE", f"The model server is not reachable: {exc}") from None


def _http_error(status: int, data: bytes) -> ApiError:
    """A server's refusal as Vertex AI passes it on (unconfirmed: the HTTP status mapped to its gRPC code)."""
    code = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}.get(
        status, "INTERNAL")
    return ApiError(code, data.decode(errors="replace")[:2000] or f"HTTP {status}")


def RawPredict(call: rpc.Call, req: v1.RawPredictRequest):
    servers, key, route = _serving(call, req.endpoint)

    def forward():
        status, content_type, data = _forwarded(servers, key, route, req.http_body, stream=False)
        if status >= 400:
            raise _http_error(status, data)
        return httpbody_pb2.HttpBody(content_type=content_type, data=data)
    return rpc.Later(forward)


def StreamRawPredict(call: rpc.Call, req: v1.StreamRawPredictRequest):
    servers, key, route = _serving(call, req.endpoint)

    def forward():
        status, content_type, chunks = _forwarded(servers, key, route, req.http_body, stream=True)
        if status >= 400:
            raise _http_error(status, b"".join(chunks))
        return (httpbody_pb2.HttpBody(content_type=content_type, data=chunk) for chunk in chunks)
    return rpc.Later(forward)


def _op(fn, request_type) -> tuple[Callable, Callable, Callable]:
    return fn, request_type.deserialize, operations_pb2.Operation.SerializeToString


MODEL_METHODS: rpc.Methods = {
    "UploadModel": _op(UploadModel, v1.UploadModelRequest),
    "GetModel": (GetModel, v1.GetModelRequest.deserialize, v1.Model.serialize),
    "ListModels": (ListModels, v1.ListModelsRequest.deserialize, v1.ListModelsResponse.serialize),
    "DeleteModel": _op(DeleteModel, v1.DeleteModelRequest),
}
ENDPOINT_METHODS: rpc.Methods = {
    "CreateEndpoint": _op(CreateEndpoint, v1.CreateEndpointRequest),
    "GetEndpoint": (GetEndpoint, v1.GetEndpointRequest.deserialize, v1.Endpoint.serialize),
    "ListEndpoints": (ListEndpoints, v1.ListEndpointsRequest.deserialize, v1.ListEndpointsResponse.serialize),
    "DeleteEndpoint": _op(DeleteEndpoint, v1.DeleteEndpointRequest),
    "DeployModel": _op(DeployModel, v1.DeployModelRequest),
    "UndeployModel": _op(UndeployModel, v1.UndeployModelRequest),
}
PREDICTION_METHODS: rpc.Methods = {
    "RawPredict": (RawPredict, v1.RawPredictRequest.deserialize, httpbody_pb2.HttpBody.SerializeToString),
    "StreamRawPredict": (StreamRawPredict, v1.StreamRawPredictRequest.deserialize,
                         httpbody_pb2.HttpBody.SerializeToString, "stream"),
}

# An operation's verb -> (its response type, its metadata type), for vertex.operation_view.
OPERATION_TYPES: dict[str, tuple[type, type]] = {
    "upload_model": (v1.UploadModelResponse, v1.UploadModelOperationMetadata),
    "create_endpoint": (v1.Endpoint, v1.CreateEndpointOperationMetadata),
    "deploy": (v1.DeployModelResponse, v1.DeployModelOperationMetadata),
    "undeploy": (v1.UndeployModelResponse, v1.UndeployModelOperationMetadata),
}
