"""Issue 33's GKE "done when", end to end in one fresh directory: `moe-tpu --dry-run run` of
examples/v5e-64.yaml (its dry run made as small as the suite's, cli_helpers.SMALL; trained once for the
module), then `deploy -c examples/serve-gke.yaml` (the real server on this machine behind the emulated
Deployment and Service), `predict` (through the API server's service proxy: the tokens `moe-tpu sample`
gives for that checkpoint, greedy), `down`, and `list` empty; `--scenario quota` on the serving pool
exits 1 naming the quota and leaves nothing."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from cli_helpers import SMALL, config_from, invoke, nothing_left

ROOT = Path(__file__).resolve().parents[2]
SERVE_GKE = str(ROOT / "examples" / "serve-gke.yaml")
PROMPT, TOKENS = "1 2 3", 6
SERVING = ("Deployment", "Service", "PodMonitoring", "HorizontalPodAutoscaler")


def moe_tpu(work: Path, *args: str, scenario: str = "happy") -> tuple[int, dict | None, str]:
    """`moe-tpu --dry-run --output json ARGS` in `work`: (exit code, its JSON document, stderr)."""
    with contextlib.chdir(work):
        code, out, err = invoke("--dry-run", "--scenario", scenario, "--output", "json", *args)
    return code, json.loads(out) if out.strip() else None, err


def rpcs(doc: dict, word: str) -> list[str]:
    return [c["rpc"] for c in doc["calls"] if word in c["rpc"] and c["status"] == "OK"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fresh directory where examples/v5e-64.yaml's run trained, and the greedy continuation of PROMPT
    that `moe-tpu sample` gives for its checkpoint."""
    from provision.emulator.local_server import LocalServers
    from provision.emulator.local_trainer import local_output_dir

    work = tmp_path_factory.mktemp("serve-gke")
    config = config_from(ROOT / "examples" / "v5e-64.yaml", work, "v5e-64.yaml", dry_run=dict(SMALL))
    code, doc, err = moe_tpu(work, "run", "-c", str(config))
    assert code == 0, err
    checkpoint = local_output_dir(work / ".moe-tpu", "moe-demo")
    code, out, err = invoke("sample", "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--tokens", str(TOKENS),
                            "--temperature", "0")
    assert code == 0, err
    yield work, out.strip()
    servers = LocalServers(work / ".moe-tpu")  # whatever a failed test left running
    for key in servers.keys():
        servers.stop(key)


def test_deploy_predict_down_on_gke(trained):
    work, greedy = trained
    code, deployed, err = moe_tpu(work, "deploy", "-c", SERVE_GKE)
    assert code == 0, err
    assert rpcs(deployed, "k8s create") == [f"k8s create {kind}" for kind in SERVING]
    assert "google.container.v1.ClusterManager/CreateNodePool" in rpcs(deployed, "CreateNodePool")
    assert deployed["url"].endswith("/api/v1/namespaces/default/services/moe-demo-gke:8000/proxy")
    code, predicted, err = moe_tpu(work, "predict", "--prompt", PROMPT, "--max-tokens", str(TOKENS))
    assert code == 0, err
    assert predicted["text"].strip() == greedy
    assert rpcs(predicted, "service proxy") == ["k8s service proxy"]
    code, down, err = moe_tpu(work, "down")
    assert code == 0, err
    assert [r for r in rpcs(down, "k8s delete") if "JobSet" not in r] \
        == [f"k8s delete {kind}" for kind in reversed(SERVING)]
    assert nothing_left(work)
    from provision.emulator.local_server import LocalServers

    assert LocalServers(work / ".moe-tpu").keys() == []  # the server stopped with its Deployment


def test_quota_on_the_serving_pool_leaves_nothing(trained):
    work, _ = trained
    code, doc, err = moe_tpu(work, "deploy", "-c", SERVE_GKE, scenario="quota")
    assert code == 1, err
    assert "PREEMPTIBLE_TPU_LITE_PODSLICE_V5" in err
    assert rpcs(doc, "k8s create") == []
    assert nothing_left(work)

