"""A service on GKE through the real ClusterManagerClient and kubernetes client against the emulator: the
emulated API's Deployments, Services, PodMonitorings and HPAs (409, 404, label selectors, a stale
replace, what the API server refuses), the Deployment controller with a local server behind the Service's
proxy (ready, predict, streamed, a crash with its last words), a re-run adopting, quota and stockout on
the serving pool, and `down` leaving nothing (and no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cli_helpers import loaded_config

from provision.errors import CloudError, QuotaError, StockoutError, UsageError
from provision.kinds.gke import gke_serve_render
from provision.kinds.gke.gke import cluster_of, gke_down, managed_gke
from provision.services import ServiceFollower
from tests.control import render_calls as calls

ROOT = Path(__file__).resolve().parents[2]
SERVE_GKE = ROOT / "examples" / "serve-gke.yaml"
FAKE = str(Path(__file__).with_name("fake_server.py"))


def fake_adapt(fail: bool = False):
    """The dry run's seam for how a server runs here: the stand-in server instead of trainer.serve."""
    def adapt(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        at = argv.index("trainer.serve")
        return [sys.executable, FAKE, *argv[at + 1:], *(["--fail"] if fail else [])], env
    return adapt


class Emulated:
    """An emulator (with local servers when `adapt` is given) and a cloud session on it."""

    def __init__(self, tmp_path: Path, scenario: str, adapt) -> None:
        from provision.cloud import Endpoint, Session
        from provision.console import Console
        from provision.emulator import Emulator
        from provision.emulator.local_server import LocalServers

        state = tmp_path / ".moe-tpu"
        state.mkdir(exist_ok=True)
        self.servers = LocalServers(state, adapt) if adapt is not None else None
        self.emulator = Emulator(state_path=state / "emulator.json", scenario=scenario, servers=self.servers)
        self.emulator.start()
        self.calls: list[dict] = []
        self.console = Console(output="json")
        self.session = Session(Endpoint(clock=self.emulator.clock, address=self.emulator.address), self.calls,
                               self.console)

    def context(self, cfg):
        from provision.context import RunContext

        return RunContext.on(cfg, self.session, self.console)

    def kube(self, cfg):
        return self.session.kube(cluster_of(cfg, self.session))

    def rpcs(self, word: str) -> list[tuple[str, str]]:
        return [(c["rpc"], c["status"]) for c in self.calls if word in c["rpc"]]

    def close(self) -> None:
        if self.servers is not None:
            for key in self.servers.keys():
                self.servers.stop(key)
        self.session.close()
        self.emulator.stop()


@pytest.fixture
def emulated(tmp_path):
    made: list[Emulated] = []

    def start(scenario: str = "happy", adapt=None) -> Emulated:
        made.append(Emulated(tmp_path, scenario, adapt))
        return made[-1]

    yield start
    for one in made:
        one.close()


@pytest.fixture
def cfg(tmp_path):
    return loaded_config(SERVE_GKE, tmp_path)


def test_the_objects_through_the_kubernetes_client(cfg, emulated):
    app = emulated()
    kube = app.kube(cfg)
    manifests = calls.serving_manifests(cfg, 600.0)
    for kind, body in manifests.items():
        made = kube.create_object(kind, "default", body)
        assert made["metadata"]["name"] == "moe-demo-gke" and made["metadata"]["uid"]
        assert kube.create_object(kind, "default", body) is None  # 409 AlreadyExists
        assert kube.get_object(kind, "default", "moe-demo-gke")["kind"] == kind
        assert len(kube.list_objects(kind, "default", "moe-tpu-run=moe-demo-gke")) == 1
        assert kube.list_objects(kind, "default", "moe-tpu-run=another") == []
        first = {**body, "metadata": {**body["metadata"], "resourceVersion": made["metadata"]["resourceVersion"]}}
        replaced = kube.replace_object(kind, "default", "moe-demo-gke", first)
        assert replaced["metadata"]["resourceVersion"] != made["metadata"]["resourceVersion"]
        with pytest.raises(CloudError, match="409 Conflict.*the object has been modified"):
            kube.replace_object(kind, "default", "moe-demo-gke", first)  # now stale
    assert ("k8s create HorizontalPodAutoscaler", "409 Conflict") in app.rpcs("create")
    service = kube.get_object("Service", "default", "moe-demo-gke")
    assert service["spec"]["clusterIP"].startswith("10.") and service["spec"]["ports"][0]["port"] == 8000
    hpa = kube.get_object("HorizontalPodAutoscaler", "default", "moe-demo-gke")
    assert hpa["status"]["desiredReplicas"] == 1
    with pytest.raises(CloudError, match='503.*no endpoints available for service "moe-demo-gke:8000"'):
        list(kube.proxy(gke_serve_render.proxy_path(cfg.gke, cfg.run, "/v1/completions"), {"prompt": "x"}))
    for kind in manifests:
        assert kube.delete_object(kind, "default", "moe-demo-gke") is True
        assert kube.delete_object(kind, "default", "moe-demo-gke") is False  # 404
        assert kube.get_object(kind, "default", "moe-demo-gke") is None


def test_a_client_that_connects_and_says_nothing_does_not_stop_the_api_server(cfg, emulated):
    import socket

    app = emulated()
    kube = app.kube(cfg)
    host, port = app.emulator.kube_endpoint()[0].rsplit(":", 1)
    with socket.create_connection((host, int(port))):  # no TLS hello: its handshake waits in its own thread
        assert kube.list_objects("Deployment", "default", "moe-tpu-run=x") == []


def test_an_api_server_that_never_answers_is_a_cloud_error_not_a_hang(cfg, emulated, monkeypatch):
    import threading

    from provision.cloud import kube as kube_client
    from provision.emulator import kube as kube_server

    app = emulated()
    kube = app.kube(cfg)
    release, answer = threading.Event(), kube_server.handle
    monkeypatch.setattr(kube_server, "handle", lambda *a: (release.wait(30), answer(*a))[1])
    monkeypatch.setattr(kube_client, "API_TIMEOUT_S", (5.0, 0.5))
    try:
        with pytest.raises(CloudError, match="get Deployment: cannot reach the cluster's API server.*timed out"):
            kube.get_object("Deployment", "default", "moe-demo-gke")
    finally:
        release.set()


@pytest.mark.parametrize("kind, change, words", [
    ("HorizontalPodAutoscaler", lambda m: m["spec"].update(maxReplicas=1, minReplicas=2),
     r'HorizontalPodAutoscaler.autoscaling "moe-demo-gke" is invalid: spec.maxReplicas: .*`minReplicas`'),
    ("Deployment", lambda m: m["spec"]["template"]["metadata"]["labels"].pop("app.kubernetes.io/component"),
     "spec.template.metadata.labels: .*`selector` does not match template `labels`"),
    ("Service", lambda m: m["spec"].update(ports=[]), "spec.ports: Required value"),
    ("PodMonitoring", lambda m: m["spec"].update(endpoints=[]), "spec.endpoints: Required value"),
])
def test_the_api_server_refuses_what_kubernetes_refuses(cfg, emulated, kind, change, words):
    body = calls.serving_manifests(cfg, 600.0)[kind]
    change(body)
    with pytest.raises(UsageError, match=words):
        emulated().kube(cfg).create_object(kind, "default", body)


def test_deploy_predict_stream_rerun_and_down(cfg, emulated):
    app = emulated(adapt=fake_adapt())
    context = app.context(cfg)
    service = cfg.kind.service(context)
    outcome = ServiceFollower(context, service).deploy()
    assert outcome.ok, outcome.report
    assert outcome.report.url.endswith("/api/v1/namespaces/default/services/moe-demo-gke:8000/proxy")
    assert {r.kind for r in outcome.resources} == {"deployment", "service", "podmonitoring", "hpa", "node_pool"}
    pods = app.kube(cfg).list_pods("default", "app.kubernetes.io/component=server")
    assert len(pods) == 1 and pods[0].spec.node_name.startswith("gke-moe-cluster-moe-demo-gke-serve-")
    assert pods[0].status.container_statuses[0].ready
    [answer] = service.predict({"prompt": "one two"})
    assert answer == {"choices": [{"text": "one two"}], "path": "/v1/completions"}
    assert [c["choices"][0]["text"] for c in service.predict({"prompt": "one two"}, stream=True)] == ["one", "two"]
    assert app.rpcs("service proxy") == [("k8s service proxy", "OK")] * 2
    again = emulated(adapt=fake_adapt())  # a re-run adopts all four (and the pool), and the pod stays
    cfg.kind.service(again.context(cfg)).provision()
    assert [s for _, s in again.rpcs("k8s create")] == ["409 Conflict"] * 4
    assert len(again.rpcs("k8s replace")) == 4
    assert [p.metadata.name for p in again.kube(cfg).list_pods("default", "app.kubernetes.io/component=server")] \
        == [pods[0].metadata.name]
    listed = {r.kind for r in managed_gke(cfg, again.session, run=cfg.run)}
    assert listed == {"deployment", "service", "podmonitoring", "hpa", "node_pool"}
    deleted = gke_down(again.context(cfg))
    assert sorted(r.kind for r in deleted) == ["deployment", "hpa", "node_pool", "podmonitoring", "service"]
    assert managed_gke(cfg, again.session, run=cfg.run) == [] and again.servers.keys() == []


def test_a_server_that_exits_fails_the_deploy_with_its_last_words(cfg, emulated):
    app = emulated(adapt=fake_adapt(fail=True))
    context = app.context(cfg)
    outcome = ServiceFollower(context, cfg.kind.service(context)).deploy()
    assert not outcome.ok and outcome.report.phase == "failed"
    assert "CrashLoopBackOff" in outcome.report.detail and "checkpoint is of another model" in outcome.report.detail
    assert managed_gke(cfg, app.session, run=cfg.run) == [] and app.servers.keys() == []


@pytest.mark.parametrize("scenario, error, words", [
    ("quota", QuotaError, "PREEMPTIBLE_TPU_LITE_PODSLICE_V5"),
    ("stockout", StockoutError, "no capacity for the serving node pool"),
])
def test_the_serving_pool_refused_leaves_nothing(cfg, emulated, scenario, error, words):
    app = emulated(scenario)
    with pytest.raises(error, match=words):
        cfg.kind.service(app.context(cfg)).provision()
    assert managed_gke(cfg, app.session, run=cfg.run) == []
    assert app.rpcs("k8s create") == []
