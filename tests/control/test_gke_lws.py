"""target: gke serving a replica over several hosts (examples/serve-gke-multihost.yaml: moe-1.2t on 8x8): the
LeaderWorkerSet held to its CRD's OpenAPI schema (tests/control/schemas/leaderworkerset.v1.json: the
LeaderWorkerSet project's v0.9.0 CRD, kubernetes-sigs/lws config/crd/bases/, trimmed to the v1 version's
openAPIV3Schema and subresources with every `description` removed), every pod's server argv against `plan
--serve`'s mesh, the Pathways variant against the layout of Google's Pathways serving recipe role by role,
the pools, `plan --serve`'s hosts, the refusals (Vertex AI naming GKE, a replica too small naming the shape
that holds the model, a cluster without the controller naming its install) and the emulator's groups."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml
from cli_helpers import ROOT, config_from, invoke

from provision.config import load_config
from provision.container import server_container
from provision.context import renderer_for
from provision.emulator.local_server import flag_value
from provision.kinds.gke import gke_lws_render, gke_render
from tests.control import render_calls as calls

EXAMPLE = ROOT / "examples" / "serve-gke-multihost.yaml"
SCHEMA = Path(__file__).resolve().parent / "schemas" / "leaderworkerset.v1.json"
GOLDENS = Path(__file__).resolve().parent / "goldens" / "gke"
STARTUP_S = 600.0
TPU = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice", "cloud.google.com/gke-tpu-topology": "8x8"}


def strict(schema):
    """The CRD's schema as the API server's strict field validation applies it: an object with properties
    takes no other field (the schema itself lets the server prune them; kubectl and this tool refuse them)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    doc = json.loads(SCHEMA.read_text())
    return jsonschema.Draft7Validator(strict(doc["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def loaded():
    return load_config(EXAMPLE, serve_mesh=True)


@pytest.fixture(scope="module")
def pathways(loaded):
    return loaded.model_copy(update={"gke": loaded.gke.model_copy(update={"runtime": "pathways"})})


def objects(cfg):
    return calls.group_manifests(cfg, STARTUP_S)


def containers(lws: dict, role: str) -> dict[str, dict]:
    spec = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def test_goldens(loaded, pathways):
    """The rendered files as goldens (tests/control/goldens/gke/serve-gke-multihost.*); regenerate with
    MOE_TPU_UPDATE_GOLDENS=1 (then read the diff)."""
    every = ("leaderworkerset.yaml", "service.yaml", "podmonitoring.yaml", "hpa.yaml")
    for prefix, cfg, names in (("serve-gke-multihost", loaded, every),
                               ("serve-gke-multihost-pathways", pathways, every[:1])):  # the rest: the same
        files = calls.group_files(cfg, STARTUP_S)
        for name in names:
            path = GOLDENS / f"{prefix}.{name}.golden"
            if os.environ.get("MOE_TPU_UPDATE_GOLDENS"):
                path.write_text(files[name])
            assert files[name] == path.read_text(), f"{name} differs from {path}"


def test_the_leaderworkerset_validates_against_its_crds_schema(loaded, pathways, validator):
    for cfg in (loaded, pathways):
        validator.validate(objects(cfg)["LeaderWorkerSet"])
    bad = copy.deepcopy(objects(loaded)["LeaderWorkerSet"])
    bad["spec"]["leaderWorkerTemplate"]["size"] = "16"
    assert any("is not of type 'integer'" in e.message for e in validator.iter_errors(bad))
    bad = copy.deepcopy(objects(loaded)["LeaderWorkerSet"])
    bad["spec"]["leaderWorkerTemplate"]["groupSize"] = 16  # not the API's name
    assert any("'groupSize' was unexpected" in e.message for e in validator.iter_errors(bad))


def test_a_group_is_the_slices_hosts_each_pod_the_servers_argv_with_plan_serves_mesh(loaded):
    from provision.planner import plan_for, serve_plan_for

    found = objects(loaded)
    lws = found["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["leaderWorkerTemplate"]["size"] == 16
    mesh = serve_plan_for(loaded, plan_for(loaded)).mesh.text()
    argv = list(server_container(loaded, renderer_for(loaded).image).argv)
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        assert pod["nodeSelector"] == TPU
        [server] = pod["containers"]
        assert [*server["command"], *server["args"]] == argv and flag_value(server["args"], "--mesh") == mesh
        assert server["resources"]["limits"] == {"google.com/tpu": "4"}
        assert ("readinessProbe" in server) == (role == "leaderTemplate")  # readiness on the leader only
        # Liveness on the leader's progress signal (no step done for --step-timeout: 503), not on /health.
        assert ("livenessProbe" in server) == (role == "leaderTemplate")
    live = containers(lws, "leaderTemplate")["server"]["livenessProbe"]
    assert live["httpGet"] == {"path": "/livez", "port": "http"} and live["failureThreshold"] >= 2
    leader_labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    worker_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    for kind in ("Service", "PodMonitoring"):  # the leaders take the traffic and export the metrics
        selector = found[kind]["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= leader_labels.items() and not selector.items() <= worker_labels.items()
    target = found["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "moe-1-2t-lws"}
    assert json.loads(SCHEMA.read_text())["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def test_each_group_has_a_whole_slice_and_pathways_a_cpu_pool_for_its_leaders(loaded, pathways):
    two = loaded.model_copy(update={"serve": loaded.serve.model_copy(update={"max_replicas": 2})})
    specs = calls.group_pool_specs(two, "us-west4-a")
    assert [(s.name, s.node_count, s.topology) for s in specs] == [("moe-1-2t-lws-serve-0", 16, "8x8"),
                                                                   ("moe-1-2t-lws-serve-1", 16, "8x8")]
    body = yaml.safe_load(gke_render.node_pool_body(specs[0]))
    assert body["placement_policy"] == {"type": "COMPACT", "tpu_topology": "8x8"}
    [*_, cpu] = calls.group_pool_specs(pathways, "us-west4-a")
    assert (cpu.name, cpu.topology, cpu.machine_type) == ("moe-1-2t-lws-serve-cpu", None, "n2-standard-64")


def test_pathways_is_the_recipes_layout_role_by_role(pathways):
    """Google's Pathways serving recipe (Pathways on Cloud, multihost inference with a LeaderWorkerSet): the
    leader holds the resource manager, the proxy that reaches it at the leader's address, and the model
    server that drives the slice through the proxy; a worker pod per TPU host runs the Pathways worker
    against the resource manager; the group is the workers plus the leader (images aside)."""
    lws = objects(pathways)["LeaderWorkerSet"]
    rm, proxy = gke_render.RM_PORT, gke_render.PROXY_PORT
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 16 + 1
    leader = containers(lws, "leaderTemplate")
    assert set(leader) == {"pathways-rm", "pathways-proxy", "server"}
    assert {"--node_type=resource_manager", f"--server_port={rm}", "--instance_count=1",
            "--instance_type=tpuv5e:8x8"} <= set(leader["pathways-rm"]["args"])
    assert {f"--server_port={proxy}", f"--resource_manager_address=$(LWS_LEADER_ADDRESS):{rm}"} \
        <= set(leader["pathways-proxy"]["args"])
    env = {e["name"]: e["value"] for e in leader["server"]["env"]}
    assert env["JAX_PLATFORMS"] == "proxy" and env["JAX_BACKEND_TARGET"] == f"grpc://localhost:{proxy}"
    assert "google.com/tpu" not in json.dumps(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    [worker] = containers(lws, "workerTemplate").values()
    assert f"--resource_manager_address=$(LWS_LEADER_ADDRESS):{rm}" in worker["args"]
    assert worker["resources"]["limits"] == {"google.com/tpu": "4"}
    assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["nodeSelector"] == TPU
    scratch = {a for c in (*leader.values(), worker) for a in c.get("args", []) if a.startswith("--gcs_scratch")}
    assert scratch == {"--gcs_scratch_location=gs://my-bucket/moe-1-2t-lws/pathways"}


def test_plan_serve_names_the_hosts_and_that_the_model_needs_several():
    code, out, err = invoke("--output", "json", "plan", "-c", str(EXAMPLE), "--serve")
    assert code == 0, err
    served = json.loads(out)["serve"]
    hosts = served["hosts"]
    assert (hosts["hosts"], hosts["chips_per_host"], hosts["multi_host"], hosts["needs_multi_host"]) == (16, 4, True,
                                                                                                          True)
    configured = served["precisions"][served["configured_precision"]]
    assert configured["fits"] and served["configured_precision"].startswith("int4")
    per_host = hosts["precisions"][served["configured_precision"]]["memory_bytes_per_host"]
    assert per_host == 4 * configured["memory_bytes_per_chip"]
    assert hosts["one_host"] == {"topology": "2x4", "chips": 8, "fits_at": None}
    assert (hosts["smallest_shape"]["topology"], hosts["smallest_shape"]["hosts"]) == ("8x8", 16)
    assert hosts["smallest_shape"]["fits_at"].startswith("int4")


def test_deploy_refuses_a_shape_the_platform_cannot_place_naming_the_one_that_can(tmp_path):
    single = config_from(ROOT / "examples" / "serve-gke.yaml", tmp_path, "single.yaml", trainer__config="moe-1.2t",
                         slice={"accelerator": "v5litepod-64", "count": 64}, trainer__mesh="data=64,expert=64")
    with contextlib.chdir(tmp_path):
        code, out, err = invoke("--dry-run", "deploy", "-c", str(single))
    assert code == 2 and "the smallest shape that holds it is 8x8 (64 chips on 16 hosts)" in err, err
    assert "serve.topology: 8x8" in err and not (tmp_path / ".moe-tpu" / "servers").exists()
    vertex = config_from(ROOT / "examples" / "serve-vertex.yaml", tmp_path, "vertex.yaml",
                         serve__machine_type="ct5lp-hightpu-4t", serve__topology="8x8")
    with contextlib.chdir(tmp_path):
        code, out, err = invoke("--dry-run", "deploy", "-c", str(vertex))
    assert code == 2 and "serve.topology" in err and "served on GKE (target: gke, a LeaderWorkerSet" in err, err


def test_a_cluster_without_the_controller_is_refused_naming_its_install(tmp_path):
    config = config_from(EXAMPLE, tmp_path, gke__create_cluster=True, gke__cluster="fresh-cluster",
                         trainer__config="tiny", slice={"accelerator": "v5litepod-8"}, trainer__mesh="data=1,expert=8")
    with contextlib.chdir(tmp_path):
        code, out, err = invoke("--dry-run", "--output", "json", "deploy", "-c", str(config))
    assert code == 1, err
    assert "has no LeaderWorkerSet controller" in err and gke_lws_render.LWS_INSTALL in err
    with contextlib.chdir(tmp_path):
        assert invoke("--dry-run", "list", "-c", str(config))[1].strip() == "no resources"


def test_the_emulator_places_a_group_on_one_slice_and_deleting_it_ends_every_pod(loaded):
    from provision.emulator import kube_objects
    from provision.emulator.gke import ClusterRecord, PoolRecord
    from provision.emulator.gke_world import GkeWorld

    world = GkeWorld()
    cluster = "projects/p/locations/us-west4/clusters/c"
    world.clusters[cluster] = ClusterRecord(name=cluster, request={}, create_time=0, ready_at=0, preexisting=True)
    for name in ("a", "b"):  # two slices: a group takes one of them whole
        request = {"name": name, "initial_node_count": 16, "locations": ["us-west4-a"],
                   "config": {"machine_type": "ct5lp-hightpu-4t"}, "placement_policy": {"tpu_topology": "8x8"}}
        world.pools[f"{cluster}/nodePools/{name}"] = PoolRecord(name=f"{cluster}/nodePools/{name}", request=request,
                                                                create_time=0, ready_at=0)
    lws = objects(loaded)["LeaderWorkerSet"]
    kube_objects.handle(world, 1.0, "POST", "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets",
                        {}, lws)
    pods = sorted(world.pods.values(), key=lambda p: p.pod_index)
    assert [p.name for p in pods[:3]] == ["moe-1-2t-lws-0", "moe-1-2t-lws-0-1", "moe-1-2t-lws-0-2"]
    assert len(pods) == 16 and len({p.node.rsplit("-", 1)[0] for p in pods}) == 1  # one pool's nodes
    later = 1.0 + 30 + 120 + 1  # running, then the bare emulator's load-and-compile
    path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets/moe-1-2t-lws"
    status = kube_objects.handle(world, later, "GET", path, {}, None)[1]["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    kube_objects.handle(world, later, "DELETE", path, {}, None)
    assert world.pods == {}


def test_the_dry_run_gives_a_groups_processes_one_device_each_and_a_pathways_leader_the_cpu(loaded, tmp_path):
    from provision.emulator.local_server import dry_run_adapter
    from trainer import meshspec

    argv = list(server_container(loaded, "image").argv)
    adapt = dry_run_adapter(loaded, tmp_path)
    group_env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    adapted, env = adapt(argv, group_env)
    devices = int(flag_value(adapted, "--devices"))  # the group's total, MOE_SERVE_LOCAL_DEVICES a process's
    assert (devices, env["MOE_SERVE_LOCAL_DEVICES"], env["LWS_WORKER_INDEX"]) == (2, "1", "1")
    assert meshspec.parse_mesh(flag_value(adapted, "--mesh"), devices) == {"data": 1, "expert": 2, "model": 1}
    adapted, env = adapt(argv, {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "grpc://localhost:29000"})
    assert "JAX_PLATFORMS" not in env and "JAX_BACKEND_TARGET" not in env and flag_value(adapted, "--devices") == "1"


class _Servers:
    """The dry run's local servers as the emulated controller drives them (start, state, stop), each
    process's phase set by the test: the controller's decisions are what is held here."""

    dir = "/nonexistent"

    def __init__(self) -> None:
        self.started: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.phase: dict[str, str] = {}

    def start(self, key, argv, env, log_path) -> None:
        from trainer.outputs import Phase

        self.started[key] = (list(argv), dict(env))
        self.phase[key] = Phase.STARTING

    def state(self, key):
        from provision.emulator.local_server import ServerState

        return ServerState(self.phase.get(key, "stopped"), None, "Traceback: the worker died" if key in self.phase
                           else "")

    def stop(self, key) -> bool:
        return self.phase.pop(key, None) is not None

    @staticmethod
    def free_port() -> int:
        return 29999


def test_the_emulator_starts_a_group_with_the_controllers_environment_and_a_dead_worker_fails_it(loaded):
    from provision.emulator import gke_lws, kube_objects
    from provision.emulator.gke import ClusterRecord, PoolRecord
    from provision.emulator.gke_world import GkeWorld
    from trainer.outputs import Phase

    world, servers = GkeWorld(), _Servers()
    world.servers = servers
    cluster = "projects/p/locations/us-west4/clusters/c"
    world.clusters[cluster] = ClusterRecord(name=cluster, request={}, create_time=0, ready_at=0, preexisting=True)
    request = {"name": "a", "initial_node_count": 16, "locations": ["us-west4-a"],
               "config": {"machine_type": "ct5lp-hightpu-4t"}, "placement_policy": {"tpu_topology": "8x8"}}
    world.pools[f"{cluster}/nodePools/a"] = PoolRecord(name=f"{cluster}/nodePools/a", request=request, create_time=0,
                                                       ready_at=0)
    kube_objects.handle(world, 1.0, "POST", "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets",
                        {}, objects(loaded)["LeaderWorkerSet"])
    world.reconcile(1.0 + 30)  # the pods run: the group's first DRY_RUN_PROCESSES servers start together
    leader, worker = "pod/default/moe-1-2t-lws-0", "pod/default/moe-1-2t-lws-0-1"
    assert sorted(servers.started) == [leader, worker]
    envs = [servers.started[key][1] for key in (leader, worker)]
    assert [e["LWS_WORKER_INDEX"] for e in envs] == ["0", "1"]
    assert {(e["LWS_LEADER_ADDRESS"], e["LWS_GROUP_SIZE"], e["JAX_COORDINATOR_ADDRESS"]) for e in envs} \
        == {("127.0.0.1", "2", envs[0]["JAX_COORDINATOR_ADDRESS"])}
    assert envs[0]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    assert servers.started[leader][0] == servers.started[worker][0]  # one argv, the rendered one
    servers.phase[leader] = Phase.READY
    world.reconcile(40.0)
    lws = world.objects["LeaderWorkerSet/default/moe-1-2t-lws"]
    assert gke_lws.status(world, lws, 40.0)["readyReplicas"] == 1
    servers.phase[worker] = Phase.FAILED
    world.reconcile(50.0)
    assert gke_lws.status(world, lws, 50.0)["readyReplicas"] == 0 and servers.phase == {}  # the group stopped
    pod = world.pods["default/moe-1-2t-lws-0-1"]
    assert (pod.reason, pod.message) == ("CrashLoopBackOff", "Traceback: the worker died")
