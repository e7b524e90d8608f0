"""Vertex AI's JobService as the job lifecycle needs it: a real JobServiceClient (aiplatform_v1 only)
behind our retry policy and errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from provision.cloud.api import RetryingApi
from provision.errors import UsageError

# What to do about a request the model's server refused (the same words on every kind that serves).
PREDICT_HINT = "change --prompt, --max-tokens or --temperature as the message says (`moe-tpu predict --help`)"


def server_message(exc: BaseException) -> str:
    """The message of the OpenAI error object a refusal carries ({"error": {"message": ...}}), else the
    error's own."""
    import json

    text = getattr(exc, "message", None) or str(exc)
    try:
        error = json.loads(text).get("error")
        return str(error.get("message")) if isinstance(error, dict) and error.get("message") else text
    except (ValueError, AttributeError):
        return text


class VertexApi(RetryingApi):
    """Thin, retrying wrapper over google.cloud.aiplatform_v1.JobServiceClient."""

    quota_hint = ("request more Vertex AI TPU v5e training quota in the console (IAM & Admin > Quotas), "
                  "or try another region")

    def create_custom_job(self, request, find_existing: Callable[[], Any | None]) -> Any:
        """Submit the job exactly once. A create has no request id, and a retried create whose
        first answer was lost would make a second job: every retry first looks for the job
        the lost attempt may have made (`find_existing`) and returns that one if it exists."""
        attempts = 0

        def once():
            nonlocal attempts
            attempts += 1
            if attempts > 1 and (found := find_existing()) is not None:
                return found
            return self.client.create_custom_job(request=request)

        return self._call("create custom job", once)

    def get_custom_job(self, name: str):
        return self._get_or_none("get custom job", lambda: self.client.get_custom_job(name=name))

    def list_custom_jobs(self, parent: str, server_filter: str = "") -> list:
        """Every custom job under `parent` that matches the API filter expression (all pages)."""
        request = {"parent": parent, "filter": server_filter}
        return self._call("list custom jobs", lambda: list(self.client.list_custom_jobs(request=request)))

    def cancel_custom_job(self, name: str) -> bool:
        """Ask for the cancel; False when the job is already gone."""
        return self._get_or_none("cancel custom job", lambda: self.client.cancel_custom_job(name=name) or True) is True

    def delete_custom_job(self, name: str):
        """Start the delete (a long-running operation); None when the job is already gone."""
        return self._get_or_none("delete custom job", lambda: self.client.delete_custom_job(name=name))


class ServingApi(RetryingApi):
    """Vertex AI online prediction: real aiplatform_v1 ModelService, EndpointService and PredictionService
    clients (`models`, `endpoints`, `predictions`) behind our retry policy and errors. Creates and deploys
    are long-running operations, returned for the caller to follow (`wait_operation`)."""

    quota_hint = ("request more Vertex AI TPU v5e serving quota (TPUV5sLitepodServingPerProjectPerZoneForTPUAPI) "
                  "in the console (IAM & Admin > Quotas), or try another region")

    def __init__(self, models, endpoints, predictions, clock, console) -> None:
        super().__init__(endpoints, clock, console)
        self.models, self.endpoints, self.predictions = models, endpoints, predictions

    # --- models ---------------------------------------------------------------------------
    def upload_model(self, parent: str, model):
        return self._call("upload model", lambda: self.models.upload_model(parent=parent, model=model))

    def list_models(self, parent: str, server_filter: str = "") -> list:
        request = {"parent": parent, "filter": server_filter}
        return self._call("list models", lambda: list(self.models.list_models(request=request)))

    def delete_model(self, name: str):
        """Start the delete; None when the model is already gone."""
        return self._get_or_none("delete model", lambda: self.models.delete_model(name=name))

    # --- endpoints --------------------------------------------------------------------------
    def create_endpoint(self, parent: str, endpoint):
        return self._call("create endpoint", lambda: self.endpoints.create_endpoint(parent=parent, endpoint=endpoint))

    def get_endpoint(self, name: str):
        return self._get_or_none("get endpoint", lambda: self.endpoints.get_endpoint(name=name))

    def list_endpoints(self, parent: str, server_filter: str = "") -> list:
        request = {"parent": parent, "filter": server_filter}
        return self._call("list endpoints", lambda: list(self.endpoints.list_endpoints(request=request)))

    def deploy_model(self, endpoint: str, deployed_model, traffic_split: dict[str, int]):
        return self._call("deploy model", lambda: self.endpoints.deploy_model(
            endpoint=endpoint, deployed_model=deployed_model, traffic_split=traffic_split))

    def undeploy_model(self, endpoint: str, deployed_model_id: str):
        """Start the undeploy; None when the endpoint or its deployed model is already gone."""
        return self._get_or_none("undeploy model", lambda: self.endpoints.undeploy_model(
            endpoint=endpoint, deployed_model_id=deployed_model_id))

    def delete_endpoint(self, name: str):
        return self._get_or_none("delete endpoint", lambda: self.endpoints.delete_endpoint(name=name))

    # --- predictions ----------------------------------------------------------------------
    def raw_predict(self, endpoint: str, body: bytes, content_type: str = "application/json"):
        """One request to the deployed model's predict route; the google.api.HttpBody it answers. Not
        retried: a prediction is not idempotent for the one who pays for its tokens."""
        from google.api import httpbody_pb2

        http_body = httpbody_pb2.HttpBody(content_type=content_type, data=body)
        try:
            return self.predictions.raw_predict(request={"endpoint": endpoint, "http_body": http_body})
        except Exception as exc:  # noqa: BLE001 - translated, original chained
            self._raise_prediction(exc, "raw predict")

    def stream_raw_predict(self, endpoint: str, body: bytes, content_type: str = "application/json"):
        """The same, the answer as a stream of HttpBody chunks (server-sent events from the server)."""
        from google.api import httpbody_pb2

        http_body = httpbody_pb2.HttpBody(content_type=content_type, data=body)
        try:
            yield from self.predictions.stream_raw_predict(request={"endpoint": endpoint, "http_body": http_body})
        except Exception as exc:  # noqa: BLE001 - translated, original chained
            self._raise_prediction(exc, "stream raw predict")

    def _raise_prediction(self, exc: BaseException, action: str):
        """A request the model's server refused (INVALID_ARGUMENT carrying its OpenAI error object) as a usage
        error in the server's own words, with what to change; anything else as every call's errors."""
        from google.api_core import exceptions as gexc

        if isinstance(exc, gexc.InvalidArgument):
            raise UsageError(f"{action}: the model's server refused the request: {server_message(exc)}",
                             hint=PREDICT_HINT) from exc
        self._raise_translated(exc, action)
