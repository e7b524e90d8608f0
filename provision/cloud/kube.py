"""A GKE cluster's Kubernetes API as a run needs it: the official `kubernetes` client, configured from
the cluster itself (GetCluster's endpoint and CA certificate) and the session's google-auth
credentials, never from kubectl or a kubeconfig. JobSets, PodMonitorings and LeaderWorkerSets through
CustomObjectsApi; Deployments (AppsV1Api), Services, pods, their logs, events and nodes (CoreV1Api), HPAs
(AutoscalingV2Api); a Service's proxy path; transient answers retried on our clock."""

from __future__ import annotations

import base64
import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

from provision.errors import CloudError, UsageError
from provision.waiting import call_with_retry

T = TypeVar("T")
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
POD_MONITORING = ("monitoring.googleapis.com", "v1", "podmonitorings")
LEADER_WORKER_SET = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
# A service's custom resources (CustomObjectsApi): kind -> (group, version, plural).
CUSTOM = {"PodMonitoring": POD_MONITORING, "LeaderWorkerSet": LEADER_WORKER_SET}
# A service's objects with a typed API in the client: kind -> (KubeApi's attribute, the method suffix).
SERVING = {"Deployment": ("apps", "namespaced_deployment"), "Service": ("core", "namespaced_service"),
           "HorizontalPodAutoscaler": ("autoscaling", "namespaced_horizontal_pod_autoscaler")}
# Kubernetes API answers worth another try (ApiException.status).
TRANSIENT_HTTP = (429, 500, 502, 503, 504)
# (connect, read) seconds for an API call: the client waits forever by default, so an API server that
# takes a request and never answers would hang the command. The API server ends a request itself after
# a minute (its --request-timeout default); urllib3 retries an idempotent call's read timeout. A completion
# through a Service's proxy may wait its turn behind others: its read timeout (between chunks) is longer.
API_TIMEOUT_S = (15.0, 60.0)
PROXY_TIMEOUT_S = (15.0, 600.0)


def is_transient(exc: BaseException) -> bool:
    from kubernetes.client.exceptions import ApiException

    return isinstance(exc, ApiException) and exc.status in TRANSIENT_HTTP


def model_problem(node: Any, model: str, where: str) -> tuple[str, str] | None:
    """(where, what) of the first field of `node` (camelCase JSON) that the kubernetes client's
    model `model` (e.g. V1JobTemplateSpec) does not have or cannot hold; None when it fits.
    Hand-written because the client's own deserialiser drops unknown fields silently."""
    from kubernetes import client

    if node is None:
        return None
    klass = getattr(client, model)
    if not isinstance(node, dict):
        return where, f"must be a mapping (a {model})"
    by_json = {json_key: attr for attr, json_key in klass.attribute_map.items()}
    for key, value in node.items():
        if key not in by_json:
            return where, f"unknown field {key!r} (not in {model})"
        problem = _value_problem(value, klass.openapi_types[by_json[key]], f"{where}.{key}")
        if problem is not None:
            return problem
    return None


def _value_problem(value: Any, type_name: str, where: str) -> tuple[str, str] | None:
    from kubernetes import client

    if value is None:
        return None
    if type_name.startswith("list["):
        if not isinstance(value, list):
            return where, "must be a list"
        for i, item in enumerate(value):
            if (problem := _value_problem(item, type_name[5:-1], f"{where}[{i}]")) is not None:
                return problem
    elif type_name.startswith("dict["):
        if not isinstance(value, dict):
            return where, "must be a mapping"
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            if (problem := _value_problem(item, inner, f"{where}.{key}")) is not None:
                return problem
    elif hasattr(client, type_name):
        return model_problem(value, type_name, where)
    elif type_name == "str" and not isinstance(value, str):
        return where, f"must be a string, got {value!r}"
    elif type_name == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return where, f"must be an integer, got {value!r}"
    elif type_name == "bool" and not isinstance(value, bool):
        return where, f"must be true or false, got {value!r}"
    return None


@functools.cache
def _timed_client():
    """The client's ApiClient with API_TIMEOUT_S on every request that names no timeout of its own (a
    class made on first use: the kubernetes client is imported late)."""
    from kubernetes import client

    class TimedClient(client.ApiClient):
        def request(self, *args, _request_timeout=None, **kwargs):
            return super().request(*args, _request_timeout=_request_timeout or API_TIMEOUT_S, **kwargs)

    return TimedClient


class KubeApi:
    """One cluster's API server (close() removes the CA file the client reads)."""

    def __init__(self, cluster, credentials, clock, console, calls: list | None = None) -> None:
        from kubernetes import client

        self.clock, self.console = clock, console
        self.calls = calls if calls is not None else []
        self.cluster = cluster.name
        if not cluster.endpoint or not cluster.master_auth.cluster_ca_certificate:
            raise CloudError(f"cluster {cluster.name} has no endpoint yet (status {cluster.status.name})",
                             hint="wait until the cluster is RUNNING (`moe-tpu gke status`)")
        handle, self._ca_path = tempfile.mkstemp(prefix="moe-tpu-ca-", suffix=".pem")
        with os.fdopen(handle, "wb") as ca:
            ca.write(base64.b64decode(cluster.master_auth.cluster_ca_certificate))
        conf = client.Configuration()
        conf.host = f"https://{cluster.endpoint}"
        conf.ssl_ca_cert = self._ca_path
        if credentials is not None:
            conf.api_key_prefix = {"authorization": "Bearer"}
            conf.refresh_api_key_hook = lambda c: c.api_key.update(authorization=_token(credentials))
            conf.api_key = {"authorization": _token(credentials)}
        self._client = _timed_client()(conf)
        self.custom = client.CustomObjectsApi(self._client)
        self.core = client.CoreV1Api(self._client)
        self.apps = client.AppsV1Api(self._client)
        self.autoscaling = client.AutoscalingV2Api(self._client)

    def close(self) -> None:
        self._client.close()
        if os.path.exists(self._ca_path):
            os.unlink(self._ca_path)

    def _call(self, action: str, fn: Callable[[], T], missing_ok: bool = False, exists_ok: bool = False,
              request: dict | None = None) -> T | None:
        """fn() retried on our clock, logged in the calls as "k8s ACTION" (like the RPCs), its errors
        as ours; None for a 404 (`missing_ok`) or a 409 (`exists_ok`)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        def on_retry(attempt: int, exc: BaseException | None) -> None:
            self.console.detail(f"{action}: transient error ({getattr(exc, 'status', type(exc).__name__)}), "
                                f"retry {attempt}")

        entry = {"rpc": f"k8s {action}", "request": request or {}, "status": "OK"}
        self.calls.append(entry)
        try:
            return call_with_retry(fn, self.clock, on_retry=on_retry, transient=is_transient)
        except ApiException as exc:
            entry["status"] = f"{exc.status} {exc.reason}"
            if (missing_ok and exc.status == 404) or (exists_ok and exc.status == 409):
                return None
            message = _status_message(exc)
            if exc.status in (400, 422):
                raise UsageError(f"{action}: the cluster rejected it: {message}",
                                 hint="check the config against `moe-tpu validate`") from exc
            if exc.status in (401, 403):
                raise CloudError(f"{action}: {exc.status} {exc.reason}: {message}",
                                 hint="your account needs the Kubernetes Engine Developer role on the cluster") from exc
            raise CloudError(f"{action}: {exc.status} {exc.reason}: {message}") from exc
        except HTTPError as exc:
            raise CloudError(f"{action}: cannot reach the cluster's API server: {exc}") from exc

    # --- JobSets ----------------------------------------------------------------------------
    def create_jobset(self, namespace: str, body: dict) -> dict | None:
        """Create; None when one of that name exists (409: the caller adopts or refuses it)."""
        return self._call("create JobSet", lambda: self.custom.create_namespaced_custom_object(
            *JOBSET[:2], namespace, JOBSET[2], body), exists_ok=True, request=body)

    def get_jobset(self, namespace: str, name: str) -> dict | None:
        return self._call("get JobSet", lambda: self.custom.get_namespaced_custom_object(
            *JOBSET[:2], namespace, JOBSET[2], name), missing_ok=True, request={"namespace": namespace, "name": name})

    def list_jobsets(self, namespace: str, label_selector: str) -> list[dict]:
        answer = self._call("list JobSets", lambda: self.custom.list_namespaced_custom_object(
            *JOBSET[:2], namespace, JOBSET[2], label_selector=label_selector),
            request={"namespace": namespace, "labelSelector": label_selector})
        return list(answer.get("items", []))

    def delete_jobset(self, namespace: str, name: str) -> bool:
        """Delete it with its pods (foreground); False when it was already gone."""
        from kubernetes import client

        options = client.V1DeleteOptions(propagation_policy="Foreground")
        answer = self._call("delete JobSet", lambda: self.custom.delete_namespaced_custom_object(
            *JOBSET[:2], namespace, JOBSET[2], name, body=options), missing_ok=True,
            request={"namespace": namespace, "name": name, "propagationPolicy": "Foreground"})
        return answer is not None

    # --- a service's objects: Deployments, Services, PodMonitorings, HPAs ------------------------
    def _typed(self, kind: str, verb: str) -> Callable[..., Any]:
        api, suffix = SERVING[kind]
        return getattr(getattr(self, api), f"{verb}_{suffix}")

    def _plain(self, answer: Any) -> dict:
        """A typed answer (V1Deployment...) as the API's JSON (camelCase keys), like a custom object's."""
        return answer if isinstance(answer, dict) else self._client.sanitize_for_serialization(answer)

    def create_object(self, kind: str, namespace: str, body: dict) -> dict | None:
        """Create a Deployment, LeaderWorkerSet, Service, PodMonitoring or HorizontalPodAutoscaler; None when
        one of that name exists (409: the caller adopts or refuses it)."""
        if kind in CUSTOM:
            fn = lambda: self.custom.create_namespaced_custom_object(*CUSTOM[kind][:2], namespace,  # noqa: E731
                                                                     CUSTOM[kind][2], body)
        else:
            fn = lambda: self._typed(kind, "create")(namespace, body)  # noqa: E731
        answer = self._call(f"create {kind}", fn, exists_ok=True, request=body)
        return None if answer is None else self._plain(answer)

    def get_object(self, kind: str, namespace: str, name: str) -> dict | None:
        if kind in CUSTOM:
            fn = lambda: self.custom.get_namespaced_custom_object(*CUSTOM[kind][:2], namespace,  # noqa: E731
                                                                  CUSTOM[kind][2], name)
        else:
            fn = lambda: self._typed(kind, "read")(name, namespace)  # noqa: E731
        answer = self._call(f"get {kind}", fn, missing_ok=True, request={"namespace": namespace, "name": name})
        return None if answer is None else self._plain(answer)

    def list_objects(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        """The objects of `kind` the selector picks ([] for a custom resource the cluster does not serve:
        a cluster without the LeaderWorkerSet controller has none)."""
        if kind in CUSTOM:
            fn = lambda: self.custom.list_namespaced_custom_object(  # noqa: E731
                *CUSTOM[kind][:2], namespace, CUSTOM[kind][2], label_selector=label_selector)
        else:
            fn = lambda: self._typed(kind, "list")(namespace, label_selector=label_selector)  # noqa: E731
        answer = self._call(f"list {kind}s", fn, request={"namespace": namespace, "labelSelector": label_selector},
                            missing_ok=kind in CUSTOM)
        return list(self._plain(answer).get("items") or []) if answer is not None else []

    def serves(self, kind: str, namespace: str) -> bool:
        """Whether the cluster's API serves `kind` (a custom resource's CRD is installed): a list answers."""
        group, version, plural = CUSTOM[kind]
        answer = self._call(f"list {kind}s", lambda: self.custom.list_namespaced_custom_object(
            group, version, namespace, plural, limit=1), missing_ok=True, request={"namespace": namespace})
        return answer is not None

    def replace_object(self, kind: str, namespace: str, name: str, body: dict) -> dict:
        if kind in CUSTOM:
            fn = lambda: self.custom.replace_namespaced_custom_object(  # noqa: E731
                *CUSTOM[kind][:2], namespace, CUSTOM[kind][2], name, body)
        else:
            fn = lambda: self._typed(kind, "replace")(name, namespace, body)  # noqa: E731
        return self._plain(self._call(f"replace {kind}", fn, request=body))

    def delete_object(self, kind: str, namespace: str, name: str) -> bool:
        """Delete it (a Deployment with its pods, foreground); False when it was already gone."""
        from kubernetes import client

        options = client.V1DeleteOptions(propagation_policy="Foreground")
        if kind in CUSTOM:
            fn = lambda: self.custom.delete_namespaced_custom_object(  # noqa: E731
                *CUSTOM[kind][:2], namespace, CUSTOM[kind][2], name, body=options)
        else:
            fn = lambda: self._typed(kind, "delete")(name, namespace, body=options)  # noqa: E731
        answer = self._call(f"delete {kind}", fn, missing_ok=True,
                            request={"namespace": namespace, "name": name, "propagationPolicy": "Foreground"})
        return answer is not None

    def proxy(self, path: str, body: dict, stream: bool = False) -> Any:
        """POST `body` (JSON) to `path`, a Service's proxy path on the API server
        (/api/v1/namespaces/NS/services/NAME:PORT/proxy/...): the answer's JSON, or with `stream` an
        iterator of its server-sent events' JSON documents. Written on the client's own call_api because
        its generated proxy methods send no body. The upstream's refusal is a CloudError with its message."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        entry = {"rpc": "k8s service proxy", "request": {"path": path, "body": body}, "status": "OK"}
        self.calls.append(entry)
        try:
            response = self._client.call_api(
                path, "POST", header_params={"Content-Type": "application/json", "Accept": "*/*"}, body=body,
                auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True,
                _request_timeout=PROXY_TIMEOUT_S)
        except ApiException as exc:
            entry["status"] = f"{exc.status} {exc.reason}"
            if exc.status in (400, 422):  # the server refused the request: the prompt or a limit is the user's
                from provision.cloud.vertex import PREDICT_HINT

                raise UsageError(f"the service answered {exc.status} {exc.reason}: {_status_message(exc)}",
                                 hint=PREDICT_HINT) from exc
            raise CloudError(f"the service answered {exc.status} {exc.reason}: {_status_message(exc)}") from exc
        except HTTPError as exc:
            raise CloudError(f"service proxy: cannot reach the cluster's API server: {exc}") from exc
        if not stream:
            import json

            try:
                return json.loads(response.data)
            finally:
                response.release_conn()
        return _events(response)

    # --- pods, logs, events, nodes ------------------------------------------------------------
    def list_pods(self, namespace: str, label_selector: str) -> list[Any]:
        return list(self._call("list pods", lambda: self.core.list_namespaced_pod(
            namespace, label_selector=label_selector),
            request={"namespace": namespace, "labelSelector": label_selector}).items)

    def pod_log(self, namespace: str, name: str, container: str, tail_lines: int | None = None) -> str:
        kwargs = {"container": container} | ({"tail_lines": tail_lines} if tail_lines else {})
        return self._call("read pod log", lambda: self.core.read_namespaced_pod_log(name, namespace, **kwargs),
                          request={"namespace": namespace, "name": name, **kwargs}) or ""

    def list_events(self, namespace: str, involved: str) -> list[Any]:
        selector = f"involvedObject.name={involved}"
        return list(self._call("list events", lambda: self.core.list_namespaced_event(
            namespace, field_selector=selector), request={"namespace": namespace, "fieldSelector": selector}).items)

    def list_nodes(self, label_selector: str = "") -> list[Any]:
        return list(self._call("list nodes", lambda: self.core.list_node(label_selector=label_selector),
                               request={"labelSelector": label_selector}).items)


def _events(response) -> Any:
    """The JSON documents of a server-sent event stream (`data: {...}` lines), until `data: [DONE]`."""
    import json

    buffer = b""
    try:
        for chunk in response.stream(4096, decode_content=True):
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
    finally:
        response.release_conn()


def _token(credentials) -> str:
    """A current access token from google-auth credentials (refreshed when it has expired)."""
    import google.auth.transport.requests

    if not credentials.valid:
        credentials.refresh(google.auth.transport.requests.Request())
    return credentials.token


def _status_message(exc) -> str:
    import json

    try:
        doc = json.loads(exc.body)
        error = doc.get("error")  # the server's own (OpenAI-shaped) error, through a Service's proxy
        return doc.get("message") or (error.get("message") if isinstance(error, dict) else error) or str(exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)
