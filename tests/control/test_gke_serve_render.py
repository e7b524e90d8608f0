"""target: gke with a serve section: the serving node pool and the four manifests (Deployment, Service,
PodMonitoring, HorizontalPodAutoscaler) as goldens, each passing its Kubernetes model (the PodMonitoring
its CRD's keys), the HPA's metric as Google's recipe spells it, and the GKE rules on the serve section.

Regenerate the goldens with MOE_TPU_UPDATE_GOLDENS=1 (then read the diff).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path

import pytest
import yaml
from cli_helpers import config_from, invoke

from provision.config import load_config
from provision.context import renderer_for
from provision.errors import UsageError
from provision.kinds.gke import gke_serve_render
from tests.control import render_calls as calls

ROOT = Path(__file__).resolve().parents[2]
SERVE_GKE = ROOT / "examples" / "serve-gke.yaml"
GOLDENS = Path(__file__).resolve().parent / "goldens" / "gke"
STARTUP_S = 600.0


@pytest.fixture(scope="module")
def loaded():
    return load_config(SERVE_GKE)


@pytest.fixture(scope="module")
def manifests(loaded):
    return calls.serving_manifests(loaded, STARTUP_S)


def golden(name: str, text: str) -> None:
    path = GOLDENS / f"{name}.golden"
    if os.environ.get("MOE_TPU_UPDATE_GOLDENS"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from {path}; see this file's docstring"


def test_goldens(loaded):
    files = calls.serving_files(loaded, STARTUP_S)
    for name in ("deployment.yaml", "service.yaml", "podmonitoring.yaml", "hpa.yaml",
                 "create_node_pool.moe-demo-gke-serve.us-west4-a.json"):
        golden(f"serve-gke.{name}", files[name])


def test_the_deployment_holds_one_host_and_probes_health(loaded, manifests):
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert server["resources"]["limits"] == server["resources"]["requests"] == {"google.com/tpu": "4"}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "2x2"}
    assert server["readinessProbe"]["httpGet"]["path"] == server["startupProbe"]["httpGet"]["path"] == "/health"
    assert server["livenessProbe"]["httpGet"]["path"] == "/livez"  # the engine's progress, not readiness
    probe = server["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= STARTUP_S
    assert manifests["Deployment"]["spec"]["replicas"] == loaded.serve.min_replicas
    assert server["args"][server["args"].index("--checkpoint") + 1] == "gs://my-bucket/moe-demo"
    service = manifests["Service"]["spec"]
    assert service["type"] == "ClusterIP" and service["ports"][0]["port"] == 8000
    assert service["ports"][0]["targetPort"] == server["ports"][0]["name"]
    assert service["selector"] == manifests["Deployment"]["spec"]["selector"]["matchLabels"] \
        == manifests["PodMonitoring"]["spec"]["selector"]["matchLabels"]


def test_the_hpa_is_googles_recipe(loaded, manifests):
    hpa = manifests["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "prometheus.googleapis.com|vllm:num_requests_waiting|gauge"},
        "target": {"type": "AverageValue", "averageValue": str(loaded.serve.autoscale_target)}}}]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert manifests["PodMonitoring"]["spec"]["endpoints"][0]["path"] == "/metrics"


def test_the_serving_pool_is_single_host_and_autoscaled(loaded):
    spec = calls.serving_pool_spec(loaded, "us-west4-a")
    request = gke_serve_render.create_node_pool_request(loaded.gke, spec, "my-project")
    pool = request.node_pool
    assert (pool.config.machine_type, pool.initial_node_count, pool.config.spot) == ("ct5lp-hightpu-4t", 1, True)
    assert (pool.autoscaling.min_node_count, pool.autoscaling.max_node_count) == (1, 4)
    assert not pool.placement_policy.tpu_topology


@pytest.mark.parametrize("kind, change, words", [
    ("Deployment", lambda m: m["spec"]["template"]["spec"].update(nodeSelectr={}), "unknown field 'nodeSelectr'"),
    ("Service", lambda m: m["spec"].update(type=3), "must be a string"),
    ("HorizontalPodAutoscaler", lambda m: m["spec"]["metrics"][0]["pods"].update(metrics={}),
     "unknown field 'metrics'"),
    ("PodMonitoring", lambda m: m["spec"]["endpoints"][0].update(scrapeInterval="5s"),
     "unknown field 'scrapeInterval'"),
    ("PodMonitoring", lambda m: m["spec"]["endpoints"][0].pop("port"), "needs a port"),
    ("PodMonitoring", lambda m: m["spec"]["selector"].update(matchLabel={}), "unknown field 'matchLabel'"),
    ("Deployment", lambda m: m.update(kind="StatefulSet"), "must be a Deployment"),
])
def test_a_field_the_schema_lacks_is_refused(manifests, kind, change, words):
    gke_serve_render.check_manifest(kind, manifests[kind])  # the rendered one passes
    bad = copy.deepcopy(manifests[kind])
    change(bad)
    with pytest.raises(UsageError, match=words):
        gke_serve_render.check_manifest(kind, bad)


def test_render_shows_the_manifests(tmp_path):
    code, out, err = invoke("render", "-c", str(SERVE_GKE), "--out", str(tmp_path / "out"))
    assert code == 0, err
    hpa = yaml.safe_load((tmp_path / "out" / "hpa.yaml").read_text())
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    request = json.loads((tmp_path / "out" / "create_node_pool.moe-demo-gke-serve.us-west4-a.json").read_text())
    assert request["node_pool"]["name"] == "moe-demo-gke-serve"


@pytest.mark.parametrize("changes, key, words", [
    ({"serve__topology": "4x4", "serve__machine_type": "ct5lp-hightpu-8t"}, "serve.machine_type",
     "multi-host slice of ct5lp-hightpu-4t hosts"),
    ({"serve__topology": "4x4", "serve__max_replicas": 12, "run": "a-run-name-that-is-long-for-pool"}, "run",
     "RUN-serve-N, at most 40"),
    ({"serve__topology": "2x4"}, "serve.topology", "is not its one host"),
    ({"serve__checkpoint": "/tmp/ckpt"}, "serve.checkpoint", "use a gs:// path"),
    ({"serve__min_replicas": 3, "serve__max_replicas": 2}, "serve.max_replicas", "below min_replicas (3)"),
    ({"run": "a-run-name-that-is-long-for-gke-pool"}, "run", "too long to serve on GKE"),
])
def test_the_serve_section_on_gke_names_the_key(tmp_path, changes, key, words):
    code, out, err = invoke("validate", "-c", str(config_from(SERVE_GKE, tmp_path, **changes)))
    assert code == 2, out + err
    line = next((ln for ln in err.splitlines() if f": {key}: " in ln), None)
    assert line is not None and words in line, err


def test_the_startup_probe_waits_the_load_and_compile_estimate(loaded):
    from provision.kinds.common import startup_estimate_s

    files = loaded.kind.render(loaded, renderer_for(loaded))
    probe = yaml.safe_load(files["deployment.yaml"])["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    estimate = startup_estimate_s(loaded)
    assert estimate > 300 and probe["periodSeconds"] * probe["failureThreshold"] >= estimate
    assert probe["periodSeconds"] * (probe["failureThreshold"] - 1) < estimate
    # The server says ready once a short request's prefill and a lone stream's decode are compiled (serve
    # --warm-up background: the deployed argv leaves the default), the other spans compiling while it serves:
    # a cache of twice the length, one span more, starts no later; with --warm-up all it would be that span's
    # three compilations later.
    from provision.kinds.common import COMPILE_S
    from trainer.serve.spans import DEFAULT_CHUNK, programs_before_ready

    container = yaml.safe_load(files["deployment.yaml"])["spec"]["template"]["spec"]["containers"][0]
    assert "--warm-up" not in container["args"]
    longer = loaded.model_copy(update={"serve": loaded.serve.model_copy(update={"max_len": 2 * loaded.serve.max_len})})
    assert loaded.serve.slots > 1
    assert startup_estimate_s(longer) == pytest.approx(estimate)
    assert programs_before_ready(DEFAULT_CHUNK, loaded.serve.max_len, loaded.serve.slots) == 2
    every = [programs_before_ready(DEFAULT_CHUNK, cfg.serve.max_len, cfg.serve.slots, warm_up="all")
             for cfg in (loaded, longer)]
    assert every[1] - every[0] == 3 and every[0] > 2
    no_plan = startup_estimate_s(loaded.model_copy(update={"trainer": loaded.trainer.model_copy(
        update={"config": "no-such-config"})}))
    assert no_plan == pytest.approx(2 * 2 * COMPILE_S)


def test_deploy_without_a_serve_section_names_it(tmp_path):
    with contextlib.chdir(tmp_path):
        code, out, err = invoke("--dry-run", "deploy", "-c", str(ROOT / "examples" / "gke.yaml"))
    assert code == 2 and "serve: a GKE Deployment needs a serve section" in err, out + err
