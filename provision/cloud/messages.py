"""The API messages the rendered files become: parsed strictly into the real protobuf types.

A rendered body (YAML text) is parsed into google.cloud.tpu_v2, aiplatform_v1 or container_v1 messages with
unknown fields refused, so a template that renders a field the API does not know fails here,
before any call. `proto_dict` is how a message appears in the calls log and rendered files.
"""

from __future__ import annotations

from typing import Any

from provision.errors import UsageError


def parse_body(text: str, template: str, message_type: Any) -> Any:
    """Rendered YAML parsed strictly into a proto-plus message: an unknown field is an error here."""
    import yaml
    from google.protobuf import json_format

    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"template {template} does not render valid YAML: {exc}") from None
    if not isinstance(body, dict):
        raise UsageError(f"template {template} must render a mapping (a {message_type.__name__})")
    pb = message_type.pb(message_type())
    try:
        json_format.ParseDict(body, pb, ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        raise UsageError(f"template {template} does not render a valid {pb.DESCRIPTOR.full_name}: {exc}") from None
    return message_type.wrap(pb)


def queued_resource(text: str, template: str) -> Any:
    """A rendered QueuedResource body as google.cloud.tpu_v2.QueuedResource."""
    from google.cloud import tpu_v2

    return parse_body(text, template, tpu_v2.QueuedResource)


def create_queued_resource_request(parent: str, queued_resource_id: str, request_id: str, body: Any) -> Any:
    from google.cloud import tpu_v2

    return tpu_v2.CreateQueuedResourceRequest(parent=parent, queued_resource_id=queued_resource_id,
                                              request_id=request_id, queued_resource=body)


def create_custom_job_request(parent: str, text: str, template: str) -> Any:
    """The CreateCustomJobRequest with a rendered body parsed into aiplatform.v1.CustomJob."""
    from google.cloud.aiplatform_v1.types import custom_job, job_service

    return job_service.CreateCustomJobRequest(parent=parent, custom_job=parse_body(text, template,
                                                                                   custom_job.CustomJob))


def node_pool(text: str, template: str) -> Any:
    """A rendered NodePool body as google.cloud.container_v1.NodePool."""
    from google.cloud import container_v1

    return parse_body(text, template, container_v1.NodePool)


def create_node_pool_request(parent: str, body: Any) -> Any:
    from google.cloud import container_v1

    return container_v1.CreateNodePoolRequest(parent=parent, node_pool=body)


def create_cluster_request(parent: str, text: str, template: str) -> Any:
    """The CreateClusterRequest with a rendered body parsed into container.v1.Cluster."""
    from google.cloud import container_v1

    return container_v1.CreateClusterRequest(parent=parent, cluster=parse_body(text, template, container_v1.Cluster))


def proto_dict(message: Any) -> dict[str, Any]:
    """A message (proto-plus or raw protobuf) as proto JSON with the proto's field names (for calls
    logs and files); {} for anything that is not a message."""
    from google.protobuf import json_format
    from google.protobuf.message import Message

    pb = type(message).pb(message) if hasattr(type(message), "pb") else message
    if not isinstance(pb, Message):
        return {}
    return json_format.MessageToDict(pb, preserving_proto_field_name=True)


def _strict(body: dict, message_type: Any) -> Any:
    """A body built in code parsed strictly into a proto-plus message (an unknown field is a bug here)."""
    from google.protobuf import json_format

    pb = message_type.pb(message_type())
    json_format.ParseDict(body, pb, ignore_unknown_fields=False)
    return message_type.wrap(pb)


def serving_model(body: dict) -> Any:
    from google.cloud.aiplatform_v1.types import model

    return _strict(body, model.Model)


def serving_endpoint(body: dict) -> Any:
    from google.cloud.aiplatform_v1.types import endpoint

    return _strict(body, endpoint.Endpoint)


def deployed_model(body: dict) -> Any:
    from google.cloud.aiplatform_v1.types import endpoint

    return _strict(body, endpoint.DeployedModel)
