"""target: gke: the gke section's rules, the node pool and JobSet goldens, the strict checks, and
the Pathways JobSet compared role by role with pathwaysutils' PathwaysJobSet.

Regenerate the goldens with MOE_TPU_UPDATE_GOLDENS=1 (then read the diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import config_from, invoke

from provision.config import load_config
from provision.context import renderer_for
from provision.errors import UsageError
from provision.kinds.gke import gke_render
from tests.control import render_calls as calls

ROOT = Path(__file__).resolve().parents[2]
PATHWAYS = ROOT / "examples" / "gke-pathways.yaml"
JAX = ROOT / "examples" / "gke.yaml"
GOLDENS = Path(__file__).resolve().parent / "goldens" / "gke"


def write(tmp_path: Path, example: Path = PATHWAYS, **changes) -> Path:
    """The example with dotted keys changed (value None deletes the key)."""
    return config_from(example, tmp_path, **changes)


@pytest.mark.parametrize("changes, key, words", [
    ({"gke__runtime": "spark"}, "gke.runtime", "must be one of 'jax' or 'pathways'"),
    ({"gke__runtime": "jax"}, "gke.pathways", "only used with runtime 'pathways'"),
    ({"gke__topology": "4x5"}, "gke.topology", "unknown v5e topology '4x5'"),
    ({"gke__topology": "4x4"}, "gke.topology", "not that of slice.accelerator v5litepod-32 (4x8)"),
    ({"gke__namespace": "Team_A"}, "gke.namespace", "is not a DNS label"),
    ({"gke__queue": "-q"}, "gke.queue", "is not a DNS label"),
    ({"gke__cluster": "a" * 41}, "gke.cluster", "at most 40 characters"),
    ({"gke__location": "us-west4"}, "gke.location", "not in region 'us-east5'"),
    ({"gke__location": "us-east5-a"}, "zones", "the cluster is zonal (us-east5-a)"),
    ({"gke__pathways__bogus": 1}, "gke.pathways.bogus", "unknown key 'bogus'"),
    ({"gke__pathways__gcs_scratch": "/tmp/x"}, "gke.pathways.gcs_scratch", "must be a Cloud Storage location"),
    ({"trainer__output_dir": "/tmp/out"}, "trainer.output_dir", "use a gs:// path"),
    ({"run": "a-run-name-that-is-much-too-long-for-gke-pools"}, "run", "node pools are named RUN-sN"),
    ({"gke": None}, "gke", "target 'gke' needs a gke section"),
])
def test_validate_names_the_key_and_exits_2(tmp_path, changes, key, words):
    code, out, err = invoke("validate", "-c", str(write(tmp_path, **changes)))
    assert code == 2, out + err
    line = next((ln for ln in err.splitlines() if f": {key}: " in ln), None)
    assert line is not None and words in line, err


def test_examples_validate():
    for example in (PATHWAYS, JAX):
        code, out, err = invoke("validate", "-c", str(example))
        assert code == 0, err
        assert "runtime" in out


def golden(name: str, text: str) -> None:
    path = GOLDENS / f"{name}.golden"
    if os.environ.get("MOE_TPU_UPDATE_GOLDENS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from {path}; see this file's docstring"


@pytest.mark.parametrize("example, names", [
    (PATHWAYS, ["create_node_pool.moe-pathways-s0.us-east5-a.json", "create_node_pool.moe-pathways-cpu.us-east5-a.json",
                "jobset.yaml"]),
    (JAX, ["create_cluster.json", "create_node_pool.moe-gke-s0.us-west4-a.json", "jobset.yaml"]),
])
def test_goldens(example, names):
    loaded = load_config(example)
    files = calls.gke_files(loaded, renderer_for(loaded))
    for name in names:
        golden(f"{example.stem}.{name}", files[name])


def test_node_pools_hold_the_slice_shape_and_capacity(tmp_path):
    cfg = load_config(PATHWAYS)
    tpu, _, cpu = (gke_render.node_pool_message(s) for s in calls.node_pool_specs(cfg, "us-east5-a"))
    assert tpu.config.machine_type == "ct5lp-hightpu-4t" and tpu.initial_node_count == 8
    assert tpu.placement_policy.type_.name == "COMPACT" and tpu.placement_policy.tpu_topology == "4x8"
    assert tpu.config.spot and tpu.config.resource_labels["moe-tpu-run"] == "moe-pathways"
    assert cpu.name == "moe-pathways-cpu" and cpu.config.machine_type == "n2-standard-64" and not cpu.config.spot
    reserved = load_config(write(tmp_path, slice__capacity="reserved", slice__reservation="my-res"))
    pool = gke_render.node_pool_message(calls.node_pool_specs(reserved, "us-east5-a")[0])
    affinity = pool.config.reservation_affinity
    assert not pool.config.spot and affinity.consume_reservation_type.name == "SPECIFIC_RESERVATION"
    assert list(affinity.values) == ["my-res"] and affinity.key == "compute.googleapis.com/reservation-name"


def test_a_field_the_api_does_not_know_is_refused(tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    source = (ROOT / "templates" / "gke_node_pool.yaml.j2").read_text()
    (templates / "gke_node_pool.yaml.j2").write_text(source.replace("initial_node_count:", "node_count_typo:"))
    cfg = load_config(PATHWAYS)
    renderer = renderer_for(cfg, templates)
    spec = calls.node_pool_specs(cfg, cfg.zones[0])[0]
    with pytest.raises(UsageError, match="google.container.v1.NodePool"):
        gke_render.node_pool_message(spec, renderer)
    jobset = (ROOT / "templates" / "jobset.yaml.j2").read_text()
    (templates / "jobset.yaml.j2").write_text(jobset.replace("imagePullPolicy:", "imagePulPolicy:", 1))
    with pytest.raises(UsageError, match="unknown field 'imagePulPolicy'"):
        calls.jobset_manifest(cfg, renderer)
    (templates / "jobset.yaml.j2").write_text(jobset.replace("$(PATHWAYS_HEAD):{{ spec.rm_port }}",
                                                             "$(PATHWAYS_HAED):{{ spec.rm_port }}", 1))
    with pytest.raises(UsageError, match=r"uses \$\(PATHWAYS_HAED\)"):
        calls.jobset_manifest(cfg, renderer)


def test_jax_jobset_has_one_pod_per_vm_and_the_multislice_environment(tmp_path):
    cfg = load_config(write(tmp_path, JAX, slice__count=2, gke__queue="team-a", recovery__max_restarts=5))
    manifest = calls.jobset_manifest(cfg, renderer_for(cfg))
    (job,) = manifest["spec"]["replicatedJobs"]
    assert job["replicas"] == 2
    spec = job["template"]["spec"]
    assert spec["completions"] == spec["parallelism"] == 16
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "8x8"}
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": "4"}
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["MEGASCALE_NUM_SLICES"] == "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"
    assert env["MEGASCALE_SLICE_ID"] == "metadata.labels['jobset.sigs.k8s.io/job-index']"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "metadata.labels['jobset.sigs.k8s.io/coordinator']"
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 5
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


# --- against pathwaysutils ------------------------------------------------------------------

def _pathwaysutils_jobset(cfg):
    jobset = pytest.importorskip("pathwaysutils.experimental.gke.jobset")
    spec = calls.jobset_spec(cfg, renderer_for(cfg).image)
    js = jobset.PathwaysJobSet(name=spec.name, namespace=spec.namespace, pathways_dir=spec.gcs_scratch,
                               tpu_type="ct5lp-hightpu-4t", topology=spec.topology, num_slices=spec.slices,
                               max_restarts=spec.max_restarts)
    js.add_user_workload(image=spec.container.image, command=[*spec.container.command, *spec.container.args],
                         name="trainer")
    return js.to_dict()


def _roles(manifest) -> dict[str, dict]:
    """Container by role: proxy, resource manager, worker, trainer (with the pod spec it runs in)."""
    jobs = manifest["spec"]["replicatedJobs"]
    head, worker = jobs[0], jobs[1]
    head_pod = head["template"]["spec"]["template"]["spec"]
    worker_pod = worker["template"]["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in head_pod.get("initContainers", []) + head_pod["containers"]}
    return {"rm": by_name["pathways-rm"], "proxy": by_name["pathways-proxy"], "trainer": by_name["trainer"],
            "worker": worker_pod["containers"][0], "head_job": head, "worker_job": worker,
            "head_pod": head_pod, "worker_pod": worker_pod}


def _env(container) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_pathways_jobset_agrees_with_pathwaysutils_role_by_role():
    cfg = load_config(PATHWAYS)
    ours, theirs = _roles(calls.jobset_manifest(cfg, renderer_for(cfg))), _roles(_pathwaysutils_jobset(cfg))
    for role in ("rm", "proxy", "worker"):
        for key in ("args", "ports", "resources", "restartPolicy"):
            assert ours[role].get(key) == theirs[role].get(key), (role, key)
        assert _env(ours[role]) == _env(theirs[role]), role
    # The trainer: the same proxy environment, except the proxy's address (ours: the head's DNS name).
    trainer, user = _env(ours["trainer"]), _env(theirs["trainer"])
    assert {k: trainer[k] for k in user if k != "JAX_BACKEND_TARGET"} == \
           {k: v for k, v in user.items() if k != "JAX_BACKEND_TARGET"}
    assert trainer["JAX_BACKEND_TARGET"] == "grpc://$(PATHWAYS_HEAD):29000"
    assert user["JAX_BACKEND_TARGET"] == "grpc://localhost:29000"
    assert ours["trainer"]["command"] + ours["trainer"]["args"] == theirs["trainer"]["command"]
    # Pods and jobs: node selectors, restart policies, completions, annotations.
    for pod in ("head_pod", "worker_pod"):
        for key in ("nodeSelector", "restartPolicy", "volumes"):
            if (pod, key) != ("head_pod", "nodeSelector"):
                assert ours[pod].get(key) == theirs[pod].get(key), (pod, key)
    # A deliberate difference: the head goes on the run's own CPU pool, not one `cpu-np` that two runs on a
    # cluster would share (and the first one's teardown would take from the second).
    pool = "cloud.google.com/gke-nodepool"
    assert theirs["head_pod"]["nodeSelector"] == {pool: "cpu-np"}
    assert ours["head_pod"]["nodeSelector"] == {pool: gke_render.cpu_pool_id(cfg.run)} == {pool: "moe-pathways-cpu"}
    for job in ("head_job", "worker_job"):
        assert ours[job]["name"] == theirs[job]["name"] and ours[job]["replicas"] == theirs[job]["replicas"]
        for key in ("completionMode", "completions", "parallelism"):
            assert ours[job]["template"]["spec"][key] == theirs[job]["template"]["spec"][key], (job, key)
        assert (ours[job]["template"]["spec"]["template"]["metadata"]["annotations"]
                == theirs[job]["template"]["spec"]["template"]["metadata"]["annotations"])
    assert ours["head_job"]["template"]["spec"]["backoffLimit"] == 0
    # The worker's backoffLimit is a deliberate difference (see the template).
    assert ours["worker_job"]["template"]["spec"]["backoffLimit"] == 8 * gke_render.WORKER_RESTARTS_PER_VM
    # The JobSet: coordinator, startup, success and failure policies, network.
    ours_spec = calls.jobset_manifest(cfg, renderer_for(cfg))["spec"]
    theirs_spec = _pathwaysutils_jobset(cfg)["spec"]
    for key in ("coordinator", "startupPolicy", "successPolicy", "failurePolicy", "network"):
        assert ours_spec[key] == theirs_spec[key], key


def test_pathways_jobset_for_two_v5litepod_32():
    loaded = load_config(PATHWAYS)
    roles = _roles(calls.jobset_manifest(loaded, renderer_for(loaded)))
    assert roles["worker_job"]["replicas"] == 2
    assert roles["worker_job"]["template"]["spec"]["completions"] == 8
    assert roles["worker"]["resources"]["limits"] == {"google.com/tpu": "4"}
    assert "--instance_count=2" in roles["rm"]["args"] and "--instance_type=tpuv5e:4x8" in roles["rm"]["args"]
    env = _env(roles["trainer"])
    assert env["JAX_PLATFORMS"] == "proxy" and "PATHWAYS_HEAD" in env
    assert env["PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS"] == "60"
    assert json.dumps(roles["head_pod"]["nodeSelector"]) == '{"cloud.google.com/gke-nodepool": "moe-pathways-cpu"}'


def test_the_catalogue_names_the_slice_of_a_gke_machine_type():
    from provision import catalogue

    assert catalogue.accelerator_for_machine("ct5lp-hightpu-4t", "4x8").name == "v5litepod-32"
    assert catalogue.accelerator_for_machine("ct5lp-hightpu-4t").name == "v5litepod-4"
    assert catalogue.accelerator_for_machine("ct5lp-hightpu-8t").name == "v5litepod-8"
    assert catalogue.accelerator_for_machine("ct5lp-hightpu-4t", "4x5") is None
    assert catalogue.accelerator_for_machine("n2-standard-64") is None
