"""Issue 33's Vertex AI lines end to end, as a user runs them from a fresh directory: train with `run`, then
`deploy`, `predict`, `down`, `list`; a refused quota, a checkpoint of another model, SIGTERM during DeployModel,
and a re-run after kill -9. The dry run trains once for the test run (the examples' run made small: the tests'
shared dry_run size; conftest.py's trained_demo), served by a small engine, and the real server answers every
prediction."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from provision.emulator.local_server import LocalServers
from tests.control.cli_helpers import (
    CLEAN_ENV,
    ROOT,
    SMALL,
    invoke,
    run_process,
    serving_from,
    trained_copy,
    write_ids_task,
)

PROMPT, TOKENS = "1 2 3", 8


def _rpcs(doc: dict) -> list[str]:
    return [call["rpc"].rsplit("/", 1)[-1] for call in doc["calls"]]


def _in_order(names: list[str], wanted: list[str]) -> bool:
    """Whether `wanted` appears in `names` in that order (other calls between them)."""
    found = iter(names)
    return all(any(name == want for name in found) for want in wanted)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, trained_demo):
    """A fresh directory where examples/v5e-64.yaml's run trained (made small: a copy of trained_demo's), with
    the serving config beside it. The servers compile with XLA's optimisations off (compiling dominates here)."""
    work = trained_copy(trained_demo, tmp_path_factory.mktemp("serve-vertex"))
    serve = yaml.safe_load((ROOT / "examples" / "serve-vertex.yaml").read_text())
    serve = {**serve, "dry_run": SMALL, "serve": {**serve["serve"], "slots": 2, "max_len": 64}}
    (work / "serve.yaml").write_text(yaml.safe_dump(serve))
    with serving_from(work):
        yield work


@pytest.fixture
def here(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def _nothing_left(work) -> None:
    code, out, err = invoke("--dry-run", "list", "-c", "serve.yaml")
    assert code == 0 and out.strip() == "no resources", out + err
    assert LocalServers(work / ".moe-tpu").keys() == []


def _sample(work) -> str:
    """What `sample` gives for the run's checkpoint, greedy (its command, in this process: one device)."""
    import jax
    from click.testing import CliRunner

    from trainer.sample import sample_command

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # as the server compiled
    try:
        result = CliRunner().invoke(sample_command, ["--checkpoint", str(work / ".moe-tpu" / "runs" / "moe-demo" /
                                                                         "output"), "--prompt", PROMPT,
                                                     "--tokens", str(TOKENS), "--temperature", "0"])
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_deploy_predict_down_through_the_real_api(here, monkeypatch):
    code, out, err = invoke("--dry-run", "--output", "json", "deploy", "-c", "serve.yaml")
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert _in_order(_rpcs(doc), ["UploadModel", "GetOperation", "CreateEndpoint", "GetOperation", "DeployModel",
                                  "GetOperation", "RawPredict"]), _rpcs(doc)
    upload = next(c["request"] for c in doc["calls"] if c["rpc"].endswith("/UploadModel"))
    spec = upload["model"]["container_spec"]
    assert spec["command"] == ["python", "-m", "trainer.serve"] and "--slots" in spec["args"]
    assert (spec["predict_route"], spec["health_route"]) == ("/v1/completions", "/health")
    assert int(spec["startup_probe"]["failure_threshold"]) >= 3
    deployed = next(c["request"] for c in doc["calls"] if c["rpc"].endswith("/DeployModel"))["deployed_model"]
    machine = deployed["dedicated_resources"]["machine_spec"]
    assert machine == {"machine_type": "ct5lp-hightpu-4t", "tpu_topology": "2x2"}
    assert doc["result"] == "ok" and doc["url"].endswith(":rawPredict") and doc["smoke"]["text"]
    code, out, _ = invoke("--dry-run", "--output", "json", "status")
    kinds = {r["kind"]: r["state"] for r in json.loads(out)["resources"]}
    assert code == 0 and kinds == {"endpoint": "DEPLOYED", "deployed_model": "DEPLOYED", "model": "UPLOADED"}
    # The prediction, streamed and whole, through PredictionService: what `sample` gives, greedy.
    code, out, err = invoke("--dry-run", "--output", "json", "predict", "--prompt", PROMPT, "--max-tokens", str(TOKENS))
    streamed = json.loads(out)
    assert code == 0 and "StreamRawPredict" in _rpcs(streamed), err[-2000:]
    code, out, _ = invoke("--dry-run", "predict", "--prompt", PROMPT, "--max-tokens", str(TOKENS), "--no-stream")
    assert code == 0 and out.strip() == streamed["text"] == _sample(here)
    # A request the server refuses is the user's to change: exit 2 in the server's words, not a config hint.
    code, _, err = invoke("--dry-run", "predict", "--prompt", PROMPT, "--max-tokens", "100000")
    assert code == 2 and "maximum context length" in err and '{"error"' not in err, err[-2000:]
    assert "change --prompt, --max-tokens" in err and "validate" not in err
    _eval_through_the_endpoint_scores_as_the_local_eval(here, monkeypatch)
    code, out, err = invoke("--dry-run", "--output", "json", "down")
    assert code == 0, err[-2000:]
    assert _in_order(_rpcs(json.loads(out)), ["UndeployModel", "GetOperation", "DeleteEndpoint", "GetOperation",
                                              "DeleteModel", "GetOperation", "ListEndpoints", "ListModels"])
    _nothing_left(here)


def _ids_task(work) -> None:
    """A local 5-item multiple-choice task in the run's text: token ids separated by spaces (its data has no
    tokenizer)."""
    rows = [{"question": " ".join(str(3 * i + k) for k in range(1, 5)), "choices": [str(i + 1), f"{i + 2} {i + 3}"],
             "answer": i % 2} for i in range(5)]
    write_ids_task(work, rows)


def _loglikelihoods(path) -> dict[tuple[int, int], float]:
    samples = json.loads(path.read_text())["samples"]["tiny_ids_mc"]
    return {(s["doc_id"], i): r[0][0] for s in samples for i, r in enumerate(s["resps"])}


def _eval_through_the_endpoint_scores_as_the_local_eval(work, monkeypatch) -> None:
    """`eval --endpoint` sends lm-eval's requests through RawPredict to the deployed server: per example, the
    loglikelihoods `eval` finds for the same checkpoint on a local engine (one device, as the dry run's server)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(work / "hf-datasets"))
    _ids_task(work)
    task = ["--tasks", "tiny_ids_mc", "--include-path", str(work / "tasks"), "--limit", "5", "--batch-size", "2"]
    code, _, err = invoke("--dry-run", "--output", "json", "eval", "--endpoint", "-c", "serve.yaml", *task)
    assert code == 0, err[-3000:]
    run = work / ".moe-tpu" / "runs" / "moe-demo" / "output"
    remote = _loglikelihoods(run / "eval" / "endpoint-results.json")
    local = run_process(["eval", "--checkpoint", str(run), "--max-len", "64", "--devices", "1", *task], cwd=work,
                        timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    here_ = _loglikelihoods(run / "eval" / "results.json")
    assert len(remote) == 10 and remote.keys() == here_.keys()
    assert all(abs(remote[k] - here_[k]) <= 1e-4 for k in remote), (remote, here_)
    assert len({round(v, 3) for v in remote.values()}) > 1  # scores of the model, not one constant


def test_eval_endpoint_with_nothing_deployed_is_a_usage_error(here):
    _nothing_left(here)
    _ids_task(here)
    code, _, err = invoke("--dry-run", "eval", "--endpoint", "-c", "serve.yaml", "--tasks", "tiny_ids_mc",
                          "--include-path", str(here / "tasks"), "--limit", "5")
    assert code == 2 and "has no endpoint with a deployed model" in err and "deploy -c serve.yaml" in err, err[-2000:]
    code, _, err = invoke("--dry-run", "eval", "--endpoint", "-c", "serve.yaml", "--checkpoint", "runs/x",
                          "--tasks", "tiny_ids_mc")
    assert code == 2 and "leave --checkpoint out" in err


def test_a_refused_quota_fails_the_deploy_naming_it_and_leaves_nothing(here):
    code, _, err = invoke("--dry-run", "--scenario", "quota", "deploy", "-c", "serve.yaml")
    assert code == 1 and "TPUV5sLitepodServingPerProjectPerZoneForTPUAPI" in err
    _nothing_left(here)


def test_stockout_fails_the_deploy_for_lack_of_capacity_and_leaves_nothing(here):
    code, _, err = invoke("--dry-run", "--scenario", "stockout", "deploy", "-c", "serve.yaml")
    assert code == 1 and "Resources are insufficient in region: us-west4" in err
    _nothing_left(here)


def test_a_checkpoint_of_another_model_fails_the_deploy_with_the_servers_last_words(here):
    theirs = here / ".moe-tpu" / "runs" / "other-model" / "output"
    ours = here / ".moe-tpu" / "runs" / "moe-demo" / "output"
    theirs.mkdir(parents=True, exist_ok=True)
    if not (theirs / "checkpoints").exists():
        (theirs / "checkpoints").symlink_to(ours / "checkpoints")
    config = json.loads((ours / "config.json").read_text())
    config["model"]["d_model"] *= 2
    (theirs / "config.json").write_text(json.dumps(config))
    bad = yaml.safe_load((here / "serve.yaml").read_text())
    bad["serve"]["checkpoint"] = "gs://my-bucket/other-model"
    (here / "bad.yaml").write_text(yaml.safe_dump(bad))
    code, _, err = invoke("--dry-run", "deploy", "-c", "bad.yaml")
    assert code == 1 and "never became ready" in err and "holds shape" in err, err[-3000:]
    _nothing_left(here)


def _when_a_server_starts(work, then) -> threading.Thread:
    """then(), in a thread, once the dry run's server of a deploy has started."""
    servers = LocalServers(work / ".moe-tpu")

    def watch():
        deadline = time.monotonic() + 120
        while not servers.keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        then()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_during_deploy_model_deletes_what_it_made(here, signum, exit_code):
    # The deploy runs in this process; the signal comes from a thread once DeployModel has started the server.
    _when_a_server_starts(here, lambda: os.kill(os.getpid(), signum))
    code, out, err = invoke("--dry-run", "--output", "json", "deploy", "-c", "serve.yaml")
    assert code == exit_code and "everything the deploy made is deleted" in err, err[-2000:]
    assert _in_order(_rpcs(json.loads(out)), ["UploadModel", "CreateEndpoint", "DeployModel", "UndeployModel",
                                              "DeleteEndpoint", "DeleteModel"])
    _nothing_left(here)


def test_a_rerun_after_kill_9_adopts_the_endpoint_and_uploads_no_second_model(here):
    env = {k: v for k, v in {**os.environ, **CLEAN_ENV}.items() if v is not None}
    killed = subprocess.Popen([sys.executable, "-m", "provision", "--dry-run", "deploy", "-c", "serve.yaml"],
                              cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _when_a_server_starts(here, killed.kill).join(timeout=150)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    code, out, err = invoke("--dry-run", "--output", "json", "deploy", "-c", "serve.yaml")
    assert code == 0, err[-2000:]
    rpcs = _rpcs(json.loads(out))
    assert not {"UploadModel", "CreateEndpoint", "DeployModel"} & set(rpcs) and "RawPredict" in rpcs
    assert "using endpoint" in err and "that an earlier attempt created" in err
    code, _, err = invoke("--dry-run", "down")
    assert code == 0, err[-2000:]
    _nothing_left(here)


def test_validate_refuses_what_vertex_ai_cannot_serve(tmp_path):
    serve = yaml.safe_load((ROOT / "examples" / "serve-vertex.yaml").read_text())
    serve["serve"] |= {"min_replicas": 3, "max_replicas": 2, "topology": "8x8"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(serve))
    code, _, err = invoke("validate", "-c", str(tmp_path / "bad.yaml"))
    assert code == 2 and "serve.max_replicas" in err and "below min_replicas (3)" in err
    assert "serve.topology" in err and "single-host" in err and "ct5lp-hightpu-8t" in err
    serve["serve"] |= {"min_replicas": 1, "machine_type": "ct5lp-hightpu-1t", "topology": "2x4",
                       "autoscale_target": 1000, "checkpoint": " "}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(serve))
    code, _, err = invoke("validate", "-c", str(tmp_path / "bad.yaml"))
    assert code == 2 and "'2x4' is not the one host of ct5lp-hightpu-1t" in err and "ct5lp-hightpu-8t" in err
    assert "serve.autoscale_target" in err and "at most 100, not 1000" in err
    assert "serve.checkpoint: is empty: name the run directory to serve" in err  # not trainer.output_dir, silently
    code, _, err = invoke("predict", "-c", str(tmp_path / "bad.yaml"), "--prompt", "1", "--temperature", "nan")
    assert code == 2 and "'--temperature': nan" in err


def test_deploy_and_predict_help_import_no_cloud_client_and_no_jax():
    probe = ("import sys\nbefore = set(sys.modules)\nfrom provision.cli import main\n"
             "for name in ('deploy', 'predict'):\n    try:\n        main([name, '--help'])\n"
             "    except SystemExit:\n        pass\nnew = set(sys.modules) - before\n"
             "print(sorted({m for m in new if m.split('.')[0] in {'google', 'grpc', 'jax', 'kubernetes'}}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and "Examples:" in result.stdout and result.stdout.strip().endswith("[]")


def test_cloud_run_is_refused_for_a_tpu_with_the_reason_and_the_alternatives(tmp_path):
    serve = {**yaml.safe_load((ROOT / "examples" / "serve-vertex.yaml").read_text()), "target": "cloud-run"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(serve))
    code, _, err = invoke("validate", "-c", str(tmp_path / "run.yaml"))
    assert code == 2 and "target" in err and "Cloud Run offers GPUs only" in err and "target: gke" in err
