"""Issue 33's GKE "done when" (and issue 46's for a replica over several hosts), end to end in one fresh
directory: `moe-tpu --dry-run run` of
examples/v5e-64.yaml, then `deploy` of examples/serve-gke.yaml (the real server on this machine behind the
emulated Deployment and Service), `predict` (through the API server's service proxy: the tokens `moe-tpu
sample` gives for that checkpoint, greedy), `down`, and `list` empty; `--scenario quota` on the serving
pool exits 1 naming the quota and leaves nothing. The run trains once for the test run (conftest.py's
trained_demo), both examples made as small as the suite's dry runs (cli_helpers.SMALL, a small engine),
compiled with XLA's optimisations off (compiling dominates here)."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import yaml
from cli_helpers import ROOT, SMALL, invoke, nothing_left, serving_from, trained_copy, write_ids_task

from provision.emulator.local_server import LocalServers
from provision.emulator.local_trainer import process_runs
from trainer.outputs import Phase

PROMPT, TOKENS = "1 2 3", 6
SERVING = ("Deployment", "Service", "PodMonitoring", "HorizontalPodAutoscaler")


def moe_tpu(work, *args: str, scenario: str = "happy") -> tuple[int, dict | None, str]:
    """`moe-tpu --dry-run --output json ARGS` in `work`: (exit code, its JSON document, stderr)."""
    with contextlib.chdir(work):
        code, out, err = invoke("--dry-run", "--scenario", scenario, "--output", "json", *args)
    return code, json.loads(out) if out.strip() else None, err


def rpcs(doc: dict, word: str) -> list[str]:
    return [c["rpc"] for c in doc["calls"] if word in c["rpc"] and c["status"] == "OK"]


@functools.cache  # both deploys serve the module's one checkpoint
def sample(work) -> str:
    """What `sample` gives for the run's checkpoint, greedy (its command, in this process), compiled as the
    server compiles."""
    import jax
    from click.testing import CliRunner

    from trainer.sample import sample_command

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        result = CliRunner().invoke(sample_command, [
            "--checkpoint", str(work / ".moe-tpu" / "runs" / "moe-demo" / "output"), "--prompt", PROMPT,
            "--tokens", str(TOKENS), "--temperature", "0"])
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


@pytest.fixture(scope="module")
def work(tmp_path_factory, trained_demo):
    """A fresh directory where examples/v5e-64.yaml's run trained (a copy of trained_demo's), with
    serve-gke.yaml beside it."""
    work = trained_copy(trained_demo, tmp_path_factory.mktemp("serve-gke"))
    serve = yaml.safe_load((ROOT / "examples" / "serve-gke.yaml").read_text())
    serve = {**serve, "dry_run": SMALL, "serve": {**serve["serve"], "slots": 8, "max_len": 64}}
    (work / "serve-gke.yaml").write_text(yaml.safe_dump(serve))
    # examples/serve-gke-multihost.yaml on the same checkpoint, at the engine's own precision (as `sample`
    # runs it: int4 moves a few-step model's greedy tokens)
    group = yaml.safe_load((ROOT / "examples" / "serve-gke-multihost.yaml").read_text())
    group["serve"].update(checkpoint="gs://my-bucket/moe-demo", slots=8, max_len=64, weights="auto")
    (work / "serve-gke-multihost.yaml").write_text(yaml.safe_dump(group))
    with serving_from(work):
        yield work


def eval_endpoint(work, monkeypatch) -> tuple[int, str]:
    """`moe-tpu --dry-run eval --endpoint` on a local 2-item multiple-choice task in the run's text (token ids):
    (exit code, stderr)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(work / "hf-datasets"))
    rows = [{"question": f"{i + 1} {i + 2} {i + 3}", "choices": [str(i + 4), f"{i + 5} {i + 6}"], "answer": i % 2}
            for i in range(2)]
    write_ids_task(work, rows)
    with contextlib.chdir(work):
        code, _, err = invoke("--dry-run", "eval", "--endpoint", "-c", "serve-gke.yaml", "--tasks", "tiny_ids_mc",
                              "--include-path", str(work / "tasks"), "--limit", "2", "--batch-size", "2")
    return code, err


def test_deploy_predict_down_on_gke(work, monkeypatch):
    code, deployed, err = moe_tpu(work, "deploy", "-c", "serve-gke.yaml")
    assert code == 0, err[-3000:]
    assert rpcs(deployed, "k8s create") == [f"k8s create {kind}" for kind in SERVING]
    assert rpcs(deployed, "CreateNodePool") == ["google.container.v1.ClusterManager/CreateNodePool"]
    assert deployed["url"].endswith("/api/v1/namespaces/default/services/moe-demo-gke:8000/proxy")
    assert deployed["smoke"]["text"] and "k8s service proxy" in rpcs(deployed, "proxy")
    code, predicted, err = moe_tpu(work, "predict", "--prompt", PROMPT, "--max-tokens", str(TOKENS))
    assert code == 0, err[-2000:]
    assert predicted["text"].strip() == sample(work)
    assert rpcs(predicted, "proxy") == ["k8s service proxy"]
    code, _, err = moe_tpu(work, "predict", "--prompt", "", "--max-tokens", "2")
    assert code == 2 and "the prompt has no tokens" in err and "change --prompt" in err, err[-2000:]
    # lm-eval's requests through the Service's proxy: a loglikelihood per choice, the model's own (not one value)
    code, err = eval_endpoint(work, monkeypatch)
    assert code == 0, err[-3000:]
    results = json.loads((work / ".moe-tpu" / "runs" / "moe-demo" / "output" / "eval" / "endpoint-results.json")
                         .read_text())
    scores = [r[0][0] for s in results["samples"]["tiny_ids_mc"] for r in s["resps"]]
    assert len(scores) == 4 and all(v < 0 for v in scores) and len({round(v, 4) for v in scores}) > 1, scores
    code, down, err = moe_tpu(work, "down")
    assert code == 0, err[-2000:]
    assert [r for r in rpcs(down, "k8s delete") if "JobSet" not in r] \
        == [f"k8s delete {kind}" for kind in reversed(SERVING)]
    assert rpcs(down, "DeleteNodePool") == ["google.container.v1.ClusterManager/DeleteNodePool"]
    assert nothing_left(work) and LocalServers(work / ".moe-tpu").keys() == []  # the server stopped too
    code, err = eval_endpoint(work, monkeypatch)  # nothing deployed: the user's to deploy (exit 2), not a crash
    assert code == 2 and "has nothing deployed on GKE" in err and "deploy -c serve-gke.yaml" in err, err


GROUP_KINDS = ("LeaderWorkerSet", "Service", "PodMonitoring", "HorizontalPodAutoscaler")
GROUP = ("pod/default/moe-1-2t-lws-0", "pod/default/moe-1-2t-lws-0-1")  # the leader, a worker playing a host


def test_deploy_predict_down_a_leaderworkerset(work):
    """examples/serve-gke-multihost.yaml: a LeaderWorkerSet whose group the emulator starts as local
    processes (a leader and a worker joined by jax.distributed over the loopback), `predict` through the
    leader's Service, `down` ending every process of the group."""
    code, deployed, err = moe_tpu(work, "deploy", "-c", "serve-gke-multihost.yaml")
    assert code == 0, err[-3000:]
    assert rpcs(deployed, "k8s create") == [f"k8s create {kind}" for kind in GROUP_KINDS]
    servers = LocalServers(work / ".moe-tpu")
    assert sorted(servers.keys()) == sorted(GROUP)  # the group's processes, not one per host of the slice
    records = [servers.record(key) for key in GROUP]
    assert servers.state(GROUP[0]).phase == Phase.READY
    assert servers.state(GROUP[1]).phase == Phase.STARTING  # a worker of the group: alive, no HTTP of its own
    code, predicted, err = moe_tpu(work, "predict", "-c", "serve-gke-multihost.yaml", "--prompt", PROMPT,
                                   "--max-tokens", str(TOKENS))
    assert code == 0, err[-2000:]
    assert predicted["text"].strip() == sample(work)
    code, down, err = moe_tpu(work, "down", "-c", "serve-gke-multihost.yaml")
    assert code == 0, err[-2000:]
    assert [r for r in rpcs(down, "k8s delete") if "JobSet" not in r] \
        == [f"k8s delete {kind}" for kind in reversed(GROUP_KINDS)]
    assert nothing_left(work) and servers.keys() == []
    for record in records:  # every process of the group ended with the LeaderWorkerSet
        assert not process_runs(int(record["pid"]), str(record["port"]))


def test_quota_on_the_serving_pool_leaves_nothing(work):
    code, doc, err = moe_tpu(work, "deploy", "-c", "serve-gke.yaml", scenario="quota")
    assert code == 1 and "PREEMPTIBLE_TPU_LITE_PODSLICE_V5" in err, err[-2000:]
    assert rpcs(doc, "k8s create") == []
    assert nothing_left(work)
