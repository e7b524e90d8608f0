"""The cloud behind one small interface.

A `Session` talks to an `Endpoint`: Google Cloud (Application Default Credentials, the
services' own hosts) or any address given to it (the emulator, in dry run, with an
insecure loopback channel). It never asks which: `provision.app.App` decides and hands
over the endpoint. The Google client libraries are imported here and in the modules of
this package (the adapters, messages, storage, Cloud Build), lazily, and nowhere else in the
control plane (tests/control/test_house.py checks it). Credentials come from one place
(`default_credentials`), and the session hands them to every client it makes: the TPU API,
Vertex AI, GKE's ClusterManager and Cloud Build (`session.build`) on gRPC channels whose calls go
through the retry policy of provision.cloud.api; a cluster's Kubernetes API; Cloud Storage
(`session.storage`), whose client retries its own reads and conditional writes
(provision.cloud.storage). Every call of each lands in the session's calls log
(provision.cloud.calls).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from provision.cloud.credentials import CLOUD_PLATFORM_SCOPE, default_credentials  # noqa: F401 - the API
from provision.errors import CloudError, MissingDependency

TPU_HOST = "tpu.googleapis.com:443"
VERTEX_HOST = "{region}-aiplatform.googleapis.com:443"
CONTAINER_HOST = "container.googleapis.com:443"
CLOUD_BUILD_HOST = "cloudbuild.googleapis.com:443"


def require_control_deps() -> None:
    try:
        import grpc  # noqa: F401
        from google.cloud import tpu_v2  # noqa: F401
    except ImportError as exc:  # depends on the install
        raise MissingDependency(exc.name or "google-cloud-tpu", "control") from exc


@dataclass(frozen=True)
class Endpoint:
    """Where requests go and on which clock the caller waits.

    `address` None means Google's own hosts (TLS, `credentials`); an address means every
    service is served there on a plain channel (loopback only: the emulator).
    """

    clock: Any
    address: str | None = None
    credentials: Any = None
    default_project: str | None = None

    @classmethod
    def google(cls, clock) -> Endpoint:
        """Google Cloud with Application Default Credentials."""
        require_control_deps()
        from google.auth import exceptions as auth_exceptions

        try:
            credentials, project = default_credentials()
        except auth_exceptions.DefaultCredentialsError as exc:
            path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
            if path:
                raise CloudError(f"cannot use the credentials file {path} (GOOGLE_APPLICATION_CREDENTIALS): {exc}",
                                 hint="point GOOGLE_APPLICATION_CREDENTIALS at a valid key file, or unset it") from exc
            raise CloudError("no Google Cloud credentials found",
                             hint="run `gcloud auth application-default login`, or use --dry-run") from exc
        return cls(clock=clock, credentials=credentials, default_project=project)


class Session:
    """The clients of one command: gRPC channels to the TPU API, Vertex AI (jobs; models, endpoints and
    predictions), GKE and Cloud Build, the
    clusters' Kubernetes APIs, Cloud Storage; the clock that waits on them; the calls log they write."""

    def __init__(self, endpoint: Endpoint, calls: list[dict[str, Any]], console) -> None:
        require_control_deps()
        from provision.cloud.calls import CallLog, CallRecorder

        def show(entry: dict[str, Any]) -> None:
            if console.verbose >= 2:
                console.detail(f"rpc {entry['rpc']} -> {entry['status']}")

        self.endpoint = endpoint
        self.clock = endpoint.clock
        self.default_project = endpoint.default_project
        self.calls = calls
        self.console = console
        self.log = CallLog(calls, show)  # what every client of the session writes its calls to
        self._recorder = CallRecorder(self.log)
        self._channels: list[Any] = []
        self._tpu = None
        self._vertex: dict[str, Any] = {}
        self._serving: dict[str, Any] = {}
        self._container = None
        self._kube: dict[str, Any] = {}
        self._build = None
        self._storage = None

    def _channel(self, google_host: str, create):
        import grpc

        if self.endpoint.address is not None:
            channel = grpc.insecure_channel(self.endpoint.address)
        else:
            channel = create(google_host, credentials=self.endpoint.credentials)
        self._channels.append(channel)
        return grpc.intercept_channel(channel, self._recorder)

    def _gapic(self, host: str, classes: Callable[[], tuple[Any, Any]], package: str, extra: str):
        """A Google client library's client on a session channel to `host` (the calls log, the emulator
        in dry run). `classes` imports (client, gRPC transport) only now: a command that never calls a
        service never imports its library."""
        try:
            client, transport = classes()
        except ImportError as exc:  # depends on the install
            raise MissingDependency(exc.name or package, extra) from exc
        return client(transport=transport(channel=self._channel(host, transport.create_channel)))

    @property
    def tpu(self):
        """The Cloud TPU v2 API (provision.cloud.tpu.TpuApi)."""
        if self._tpu is None:
            from provision.cloud.tpu import TpuApi

            self._tpu = TpuApi(self._gapic(TPU_HOST, _tpu_classes, "google-cloud-tpu", "control"),
                               self.clock, self.console)
        return self._tpu

    def vertex(self, region: str):
        """Vertex AI's JobService on the region's endpoint (provision.cloud.vertex.VertexApi)."""
        if region not in self._vertex:
            from provision.cloud.vertex import VertexApi

            client = self._gapic(VERTEX_HOST.format(region=region), _vertex_classes, "google-cloud-aiplatform",
                                 "control")
            self._vertex[region] = VertexApi(client, self.clock, self.console)
        return self._vertex[region]

    def serving(self, region: str):
        """Vertex AI online prediction on the region's endpoint: ModelService, EndpointService and
        PredictionService (provision.cloud.vertex.ServingApi)."""
        if region not in self._serving:
            from provision.cloud.vertex import ServingApi

            host = VERTEX_HOST.format(region=region)
            models, endpoints, predictions = (
                self._gapic(host, classes, "google-cloud-aiplatform", "control")
                for classes in (_model_classes, _endpoint_classes, _prediction_classes))
            self._serving[region] = ServingApi(models, endpoints, predictions, self.clock, self.console)
        return self._serving[region]

    @property
    def container(self):
        """GKE's ClusterManager (provision.cloud.container.ContainerApi)."""
        if self._container is None:
            from provision.cloud.container import ContainerApi

            client = self._gapic(CONTAINER_HOST, _container_classes, "google-cloud-container", "control")
            self._container = ContainerApi(client, self.clock, self.console)
        return self._container

    @property
    def build(self):
        """Cloud Build (provision.cloud.build.CloudBuildApi)."""
        if self._build is None:
            from provision.cloud.build import CloudBuildApi

            client = self._gapic(CLOUD_BUILD_HOST, _build_classes, "google-cloud-build", "image")
            self._build = CloudBuildApi(client, self.clock, self.console)
        return self._build

    @property
    def storage(self):
        """Cloud Storage on the session's credentials (provision.cloud.storage.Storage), its client made
        on the first request to a gs:// URL."""
        if self._storage is None:
            from provision.cloud.storage import Storage

            self._storage = Storage(self.log, self.endpoint.credentials, self.default_project)
        return self._storage

    def kube(self, cluster):
        """The Kubernetes API of a GKE cluster (a container_v1.Cluster from GetCluster), through the
        official client configured from its endpoint and CA (provision.cloud.kube.KubeApi)."""
        # A cluster made anew under the same name has another endpoint and CA: another client.
        key = (cluster.self_link or cluster.name, cluster.endpoint, cluster.master_auth.cluster_ca_certificate)
        if key not in self._kube:
            try:
                import kubernetes  # noqa: F401
            except ImportError as exc:  # depends on the install
                raise MissingDependency(exc.name or "kubernetes", "control") from exc
            from provision.cloud.kube import KubeApi

            self._kube[key] = KubeApi(cluster, self.endpoint.credentials, self.clock, self.console, self.calls)
        return self._kube[key]

    def close(self) -> None:
        if self._storage is not None:
            self._storage.close()
        for api in self._kube.values():
            api.close()
        self._kube.clear()
        for channel in self._channels:
            channel.close()
        self._channels.clear()


# (client, gRPC transport) of each service, imported when its first call is made.

def _tpu_classes():
    from google.cloud import tpu_v2
    from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

    return tpu_v2.TpuClient, TpuGrpcTransport


def _vertex_classes():
    from google.cloud.aiplatform_v1.services.job_service import JobServiceClient
    from google.cloud.aiplatform_v1.services.job_service.transports import JobServiceGrpcTransport

    return JobServiceClient, JobServiceGrpcTransport


def _model_classes():
    from google.cloud.aiplatform_v1.services.model_service import ModelServiceClient
    from google.cloud.aiplatform_v1.services.model_service.transports import ModelServiceGrpcTransport

    return ModelServiceClient, ModelServiceGrpcTransport


def _endpoint_classes():
    from google.cloud.aiplatform_v1.services.endpoint_service import EndpointServiceClient
    from google.cloud.aiplatform_v1.services.endpoint_service.transports import EndpointServiceGrpcTransport

    return EndpointServiceClient, EndpointServiceGrpcTransport


def _prediction_classes():
    from google.cloud.aiplatform_v1.services.prediction_service import PredictionServiceClient
    from google.cloud.aiplatform_v1.services.prediction_service.transports import PredictionServiceGrpcTransport

    return PredictionServiceClient, PredictionServiceGrpcTransport


def _container_classes():
    from google.cloud import container_v1
    from google.cloud.container_v1.services.cluster_manager.transports import ClusterManagerGrpcTransport

    return container_v1.ClusterManagerClient, ClusterManagerGrpcTransport


def _build_classes():
    from google.cloud.devtools import cloudbuild_v1
    from google.cloud.devtools.cloudbuild_v1.services.cloud_build.transports import CloudBuildGrpcTransport

    return cloudbuild_v1.CloudBuildClient, CloudBuildGrpcTransport
