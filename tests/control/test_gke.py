"""target: gke through the real ClusterManagerClient and kubernetes client against the emulator:
node pools (adoption, refusal, stockout failover, quota), the cluster (created and deleted only
when asked), the emulated Kubernetes API (Status objects, pods, nodes, logs, watch) and its JobSet
controller (restarts, the failure and success policies), and `run` end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import SMALL, loaded_config, nothing_left, run_here

from provision.context import renderer_for
from provision.errors import CloudError, QuotaError, StockoutError, UsageError
from provision.kinds.gke.gke import cluster_of, gke_down, gke_status, gke_up, managed_gke, submit_jobset
from tests.control import render_calls as calls

ROOT = Path(__file__).resolve().parents[2]
PATHWAYS = ROOT / "examples" / "gke-pathways.yaml"
JAX = ROOT / "examples" / "gke.yaml"
CREATE_POOL = "google.container.v1.ClusterManager/CreateNodePool"


def make_config(tmp_path: Path, example: Path = PATHWAYS, name: str = "moe-tpu.yaml", **changes):
    return loaded_config(example, tmp_path, name, **changes)


class Emulated:
    """An emulator on this test's state file and a cloud session on it (its calls logged)."""

    def __init__(self, tmp_path: Path, scenario: str, held: bool) -> None:
        from provision.cloud import Endpoint, Session
        from provision.console import Console
        from provision.emulator import Emulator

        self.emulator = Emulator(state_path=tmp_path / ".moe-tpu" / "emulator.json", scenario=scenario,
                                 external_workloads=held)
        self.emulator.start()
        self.calls: list[dict] = []
        self.console = Console(output="json")
        self.session = Session(Endpoint(clock=self.emulator.clock, address=self.emulator.address), self.calls,
                               self.console)

    def context(self, cfg):
        """A command's context for `cfg` on this session."""
        from provision.context import RunContext

        return RunContext.on(cfg, self.session, self.console)

    def close(self) -> None:
        self.session.close()
        self.emulator.stop()


@pytest.fixture
def emulated(tmp_path):
    """start(scenario, held): held as under `run`, where trainer pods run until something ends them."""
    made: list[Emulated] = []

    def start(scenario: str = "happy", held: bool = False) -> Emulated:
        (tmp_path / ".moe-tpu").mkdir(exist_ok=True)
        made.append(Emulated(tmp_path, scenario, held))
        return made[-1]

    yield start
    for one in made:
        one.close()


def creates(app) -> list[dict]:
    return [c["request"]["node_pool"] for c in app.calls if c["rpc"] == CREATE_POOL and c["status"] == "OK"]


def test_up_creates_compact_tpu_pools_and_the_runs_cpu_pool_and_a_rerun_adopts_them(tmp_path, emulated):
    cfg = make_config(tmp_path)
    app = emulated()
    resources = gke_up(app.context(cfg))
    assert [r.name.rsplit("/", 1)[-1] for r in resources] == ["moe-pathways-s0", "moe-pathways-s1",
                                                              "moe-pathways-cpu"]
    assert all(r.state == "RUNNING" and r.zone == "us-east5-a" for r in resources)
    made = creates(app)
    assert [p["name"] for p in made] == ["moe-pathways-s0", "moe-pathways-s1", "moe-pathways-cpu"]
    for pool in made[:2]:
        assert pool["placement_policy"] == {"type_": "COMPACT", "tpu_topology": "4x8"}
        assert pool["initial_node_count"] == 8 and pool["config"]["machine_type"] == "ct5lp-hightpu-4t"
    assert any(c["rpc"].endswith("ClusterManager/GetOperation") for c in app.calls)
    again = emulated()
    gke_up(again.context(cfg))
    assert creates(again) == []
    nodes = again.session.kube(cluster_of(cfg, again.session)).list_nodes(
        "cloud.google.com/gke-tpu-accelerator=tpu-v5-lite-podslice,cloud.google.com/gke-tpu-topology=4x8")
    assert len(nodes) == 16 and {n.status.capacity["google.com/tpu"] for n in nodes} == {"4"}
    assert {n.metadata.labels["cloud.google.com/gke-spot"] for n in nodes} == {"true"}


def test_two_pathways_runs_on_one_cluster_each_have_their_cpu_pool_and_one_down_leaves_the_other(tmp_path,
                                                                                                emulated):
    app = emulated()
    mine, other = make_config(tmp_path), make_config(tmp_path, name="other.yaml", run="moe-other")
    gke_up(app.context(mine))
    gke_up(app.context(other))
    assert [p["name"] for p in creates(app)] == ["moe-pathways-s0", "moe-pathways-s1", "moe-pathways-cpu",
                                                 "moe-other-s0", "moe-other-s1", "moe-other-cpu"]
    gke_down(app.context(mine))
    left = managed_gke(other, app.session, run=other.run)
    assert sorted(r.name.rsplit("/", 1)[-1] for r in left) == ["moe-other-cpu", "moe-other-s0", "moe-other-s1"]
    assert managed_gke(mine, app.session, run=mine.run) == []


def test_a_pool_that_no_longer_matches_is_refused(tmp_path, emulated):
    app = emulated()
    gke_up(app.context(make_config(tmp_path)))
    changed = make_config(tmp_path, name="on-demand.yaml", slice__capacity="on-demand")
    with pytest.raises(CloudError, match="moe-pathways-s0 exists but does not match the config: spot is True"):
        gke_up(app.context(changed))


def test_stockout_fails_over_to_the_next_zone_and_leaves_nothing_in_the_first(tmp_path, emulated):
    cfg = make_config(tmp_path)
    app = emulated("stockout")
    resources = gke_up(app.context(cfg))
    assert {r.zone for r in resources} == {"us-east5-b"}
    zones = [p["locations"][0] for p in creates(app)]
    assert zones[0] == "us-east5-a" and zones[-3:] == ["us-east5-b"] * 3
    deletes = [c for c in app.calls if c["rpc"].endswith("/DeleteNodePool")]
    assert deletes, "the ERROR pool of the stocked-out zone is deleted"
    assert {r.zone for r in gke_status(app.context(cfg))} == {"us-east5-b"}


def test_quota_names_the_quota_and_creates_nothing(tmp_path, emulated):
    cfg = make_config(tmp_path)
    app = emulated("quota")
    with pytest.raises(QuotaError, match="PREEMPTIBLE_TPU_LITE_PODSLICE_V5"):
        gke_up(app.context(cfg))
    assert gke_status(app.context(cfg)) == []
    proc = run_here(["--dry-run", "--scenario", "quota", "gke", "up", "-c", str(tmp_path / "moe-tpu.yaml")], tmp_path)
    assert proc.returncode == 1 and "quota exceeded (PREEMPTIBLE_TPU_LITE_PODSLICE_V5)" in proc.stderr


def test_a_pool_not_made_within_max_wait_counts_as_no_capacity(tmp_path, emulated):
    app = emulated("long-queue")
    with pytest.raises(StockoutError, match=r"not made within slice.max_wait \(2h\)"):
        gke_up(app.context(make_config(tmp_path)))
    assert gke_status(app.context(make_config(tmp_path))) == []
    patient = make_config(tmp_path, name="patient.yaml", slice__max_wait="4h")
    assert {r.zone for r in gke_up(app.context(patient))} == {"us-east5-a"}


def test_flaky_adopts_a_pool_whose_create_answer_was_lost(tmp_path, emulated):
    cfg = make_config(tmp_path)
    app = emulated("flaky")
    resources = gke_up(app.context(cfg))
    assert len(resources) == 3
    lost = [c for c in app.calls if c["rpc"] == CREATE_POOL and c["status"] == "UNAVAILABLE"]
    assert lost, "flaky loses the first create's answer"


def test_a_cluster_the_user_named_is_never_deleted_one_made_for_the_run_is(tmp_path, emulated):
    app = emulated()
    named = make_config(tmp_path)
    gke_up(app.context(named))
    deleted = gke_down(app.context(named))
    assert sorted(r.kind for r in deleted) == ["node_pool"] * 3
    assert cluster_of(named, app.session) is not None
    made = make_config(tmp_path, JAX, name="jax.yaml")
    assert cluster_of(made, app.session) is None
    resources = gke_up(app.context(made))
    assert [r.kind for r in resources] == ["gke_cluster", "node_pool"]
    assert any(c["rpc"].endswith("/CreateCluster") for c in app.calls)
    kinds = sorted(r.kind for r in gke_down(app.context(made)))
    assert kinds == ["gke_cluster", "node_pool"]
    assert cluster_of(made, app.session) is None


def test_an_unknown_cluster_is_a_config_error(tmp_path, emulated):
    cfg = make_config(tmp_path, gke__cluster="no-such-cluster")
    app = emulated()
    with pytest.raises(UsageError, match="gke.cluster: there is no cluster no-such-cluster"):
        gke_up(app.context(cfg))


# --- the Kubernetes API and the JobSet controller ------------------------------------------

def _kube(cfg, app):
    return app.session.kube(cluster_of(cfg, app.session))


def test_jobsets_answer_409_and_404_as_status_objects(tmp_path, emulated):
    from kubernetes.client.exceptions import ApiException

    cfg = make_config(tmp_path)
    app = emulated()
    gke_up(app.context(cfg))
    kube = _kube(cfg, app)
    body = calls.jobset_manifest(cfg, renderer_for(cfg))
    kube.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets", body)
    with pytest.raises(ApiException) as again:
        kube.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets", body)
    status = json.loads(again.value.body)
    assert again.value.status == 409 and status["kind"] == "Status" and status["reason"] == "AlreadyExists"
    assert status["message"] == 'jobsets.jobset.x-k8s.io "moe-pathways" already exists'
    with pytest.raises(ApiException) as missing:
        kube.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets", "nope")
    assert missing.value.status == 404 and json.loads(missing.value.body)["reason"] == "NotFound"
    assert kube.delete_jobset("default", "moe-pathways") and not kube.delete_jobset("default", "moe-pathways")


def test_pods_start_in_order_with_the_jobset_labels_and_a_watch_sees_them(tmp_path, emulated):
    from kubernetes import watch

    cfg = make_config(tmp_path)
    app = emulated(held=True)
    gke_up(app.context(cfg))
    submit_jobset(app.context(cfg))
    kube = _kube(cfg, app)
    head = kube.list_pods("default", "jobset.sigs.k8s.io/replicatedjob-name=pathways-head")
    workers = kube.list_pods("default", "jobset.sigs.k8s.io/replicatedjob-name=pathways-worker")
    assert len(head) == 1 and workers == []  # InOrder: the workers wait for the head to run
    app.session.clock.sleep(60)
    workers = kube.list_pods("default", "jobset.sigs.k8s.io/replicatedjob-name=pathways-worker")
    assert len(workers) == 16
    assert sorted({p.metadata.labels["jobset.sigs.k8s.io/job-index"] for p in workers}) == ["0", "1"]
    assert {p.metadata.labels["jobset.sigs.k8s.io/coordinator"] for p in workers} == \
        {"moe-pathways-pathways-head-0-0.moe-pathways"}
    pools = {p.spec.node_name.split("-moe-pathways-s")[1][0] for p in workers
             if p.metadata.labels["jobset.sigs.k8s.io/job-index"] == "1"}
    assert len(pools) == 1, "one slice's pods on one node pool (exclusive placement)"
    assert head[0].spec.node_selector == {"cloud.google.com/gke-nodepool": "moe-pathways-cpu"}
    events = list(watch.Watch().stream(kube.core.list_namespaced_pod, "default", timeout_seconds=1))
    assert len(events) == 17 and {e["type"] for e in events} == {"ADDED"}
    assert "runs nothing in a dry run" in kube.pod_log("default", workers[0].metadata.name, "pathways-worker")


def test_a_preempted_node_restarts_a_jax_jobset_until_max_restarts_then_fails(tmp_path, emulated):
    cfg = make_config(tmp_path, JAX, recovery__max_restarts=1)
    app = emulated(held=True)
    gke_up(app.context(cfg))
    submit_jobset(app.context(cfg))
    kube = _kube(cfg, app)
    app.session.clock.sleep(60)
    emulator = app.emulator
    for restarts in (1, 2):
        pods = [p for p in kube.list_pods("default", "moe-tpu-run=moe-gke") if p.status.phase == "Running"]
        assert len(pods) == 16
        assert emulator.service("gke").preempt_node(pods[3].spec.node_name)
        app.session.clock.sleep(1)
        jobset = kube.get_jobset("default", "moe-gke")
        assert jobset["status"]["restarts"] == min(restarts, 1)
        if restarts == 1:
            assert "terminalState" not in jobset["status"]
            failed = [p for p in kube.list_pods("default", "moe-tpu-run=moe-gke") if p.status.phase == "Failed"
                      and p.status.reason == "Terminated"]
            assert failed and failed[0].status.message == "Pod was terminated in response to imminent node shutdown."
            app.session.clock.sleep(300)  # the node comes back; the pods of attempt 2 start
    assert jobset["status"]["terminalState"] == "Failed"
    assert jobset["status"]["conditions"][-1]["reason"] == "ReachedMaxRestarts"


def test_the_head_completing_completes_a_pathways_jobset(tmp_path, emulated):
    cfg = make_config(tmp_path)
    app = emulated(held=True)
    gke_up(app.context(cfg))
    submit_jobset(app.context(cfg))
    app.session.clock.sleep(120)
    emulator = app.emulator
    (trainer,) = emulator.service("gke").trainer_pods()
    assert trainer.run == "moe-pathways" and trainer.command == ("python", "-m", "trainer")
    assert trainer.env["JAX_PLATFORMS"] == "proxy"
    emulator.service("gke").end_trainer_pod(trainer.namespace, trainer.name, 0)
    jobset = _kube(cfg, app).get_jobset("default", "moe-pathways")
    assert jobset["status"]["terminalState"] == "Completed"
    assert [r.kind for r in managed_gke(cfg, app.session, run=cfg.run)][0] == "jobset"
    gke_down(app.context(cfg))
    assert managed_gke(cfg, app.session, run=cfg.run) == []


# --- run, end to end ---------------------------------------------------------------------------

def _run(tmp_path: Path, *args: str, config: Path = PATHWAYS) -> tuple[int, dict, str]:
    """`moe-tpu --dry-run ARGS --output json run` of tmp_path/moe-tpu.yaml (`config` where there is none), in this
    process (cli_helpers.run_here), its trainer the size of test_run's (cli_helpers.SMALL)."""
    path = tmp_path / "moe-tpu.yaml"
    if not path.exists():
        path.write_text(config.read_text())
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "dry_run": dict(SMALL)}))
    proc = run_here(["--dry-run", *args, "--output", "json", "run", "-c", str(path)], tmp_path)  # its trainer a process
    return proc.returncode, json.loads(proc.stdout or "{}"), proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the local trainer runs as a subprocess")
def test_run_pathways_trains_and_leaves_nothing(tmp_path):
    code, doc, err = _run(tmp_path)
    assert code == 0, err[-2000:]
    assert doc["training"]["final_loss"] < doc["training"]["first_loss"]
    events = [e["event"] for e in doc["timeline"]]
    assert events[0] == "provisioning" and "training started" in events and events[-1] == "deleted"
    pools = [c["request"]["node_pool"] for c in doc["calls"] if c["rpc"] == CREATE_POOL]
    tpu = [p for p in pools if p["name"] != "moe-pathways-cpu"]
    assert len(tpu) == 2 and all(p["placement_policy"]["tpu_topology"] == "4x8" for p in tpu)
    assert all(p["placement_policy"]["type_"] == "COMPACT" for p in tpu)
    assert [p["name"] for p in pools].count("moe-pathways-cpu") == 1
    assert [c["request"]["kind"] for c in doc["calls"] if c["rpc"] == "k8s create JobSet"] == ["JobSet"]
    assert nothing_left(tmp_path)


@pytest.mark.skipif(sys.platform != "linux", reason="the local trainer runs as a subprocess")
def test_run_preempt_restarts_the_jobset_and_resumes_from_a_checkpoint(tmp_path):
    code, doc, err = _run(tmp_path, "--scenario", "preempt")
    assert code == 0, err[-2000:]
    events = [e["event"] for e in doc["timeline"]]
    assert "preempted" in events and "restarted" in events
    assert doc["training"]["restarts"] == 1 and doc["training"]["resumed_from_step"] > 0
    assert nothing_left(tmp_path)


@pytest.mark.skipif(sys.platform != "linux", reason="the local trainer runs as a subprocess")
def test_run_preempt_without_restarts_fails_and_leaves_nothing(tmp_path):
    doc = yaml.safe_load(PATHWAYS.read_text())
    doc["recovery"]["max_restarts"] = 0
    (tmp_path / "moe-tpu.yaml").write_text(yaml.safe_dump(doc))
    code, result, err = _run(tmp_path, "--scenario", "preempt")
    assert code == 1, err[-2000:]
    assert "recovery.max_restarts is 0" in result["error"]
    assert [e["event"] for e in result["timeline"]].count("preempted") == 1
    assert nothing_left(tmp_path)


def test_a_cluster_made_for_the_run_is_kept_with_a_users_node_pool_on_it_unless_asked(tmp_path, emulated, capsys):
    """Deleting a cluster deletes every node pool on it: one a user added is named, and the cluster kept,
    unless `down --delete-user-pools` asks for it."""
    import dataclasses

    from google.cloud import container_v1

    from provision.cloud.messages import create_node_pool_request
    from provision.kinds.gke import gke_render
    from provision.kinds.gke.gke import project_of

    app = emulated()
    made = make_config(tmp_path, JAX, name="jax.yaml")
    gke_up(app.context(made))
    path = gke_render.cluster_path(made.gke, project_of(made, app.session))
    pool = container_v1.NodePool(name="users-own", initial_node_count=1,
                                 config=container_v1.NodeConfig(machine_type="e2-standard-4"))
    operation = app.session.container.create_node_pool(create_node_pool_request(path, pool))
    app.session.container.wait(operation, path.rsplit("/clusters/", 1)[0], "create users-own")
    kept = gke_down(app.context(made))
    assert [r.kind for r in kept] == ["node_pool"]
    assert cluster_of(made, app.session) is not None
    assert [p.name for p in app.session.container.list_node_pools(path)] == ["users-own"]
    said = capsys.readouterr().err
    assert "node pool(s) users-own on it were not made by this tool" in said and "--delete-user-pools" in said
    asked = gke_down(dataclasses.replace(app.context(made), delete_user_pools=True))
    assert [r.kind for r in asked] == ["gke_cluster"] and cluster_of(made, app.session) is None
