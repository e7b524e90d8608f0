"""One serving mesh from plan to server: the mesh `plan --serve` states (serve.mesh, or its choice for the
replica) is the one each target renders into its server's argv, the one the server's own checks accept on
the replica's chips, and the dry run's local server gets it made one device's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke as moe

from provision.config import load_config
from provision.container import server_container
from provision.emulator.local_server import dry_run_adapter, flag_value
from trainer import meshspec
from trainer.config import load_config as load_trainer_config

ROOT = Path(__file__).resolve().parents[2]
SERVING = {"vertex": ROOT / "examples" / "serve-vertex.yaml", "gke": ROOT / "examples" / "serve-gke.yaml"}


def _plan(config: Path, *flags: str) -> dict:
    code, out, err = moe("--output", "json", "plan", "-c", str(config), "--serve", *flags)
    assert code == 0, err
    return json.loads(out)["serve"]


def _rendered_server_args(config: Path, out: Path) -> list[str]:
    """The server's argv as the target renders it: Vertex AI's Model's container args, the GKE Deployment's."""
    code, _, err = moe("render", "-c", str(config), "--out", str(out))
    assert code == 0, err
    if (out / "serving_model.json").exists():
        return json.loads((out / "serving_model.json").read_text())["container_spec"]["args"]
    deployment = yaml.safe_load((out / "deployment.yaml").read_text())
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]


def _server_accepts(mesh: str, chips: int, model_config: str) -> None:
    """The server's own start-up checks of --mesh (trainer/serve/startup.py) on the replica's chips."""
    cfg = load_trainer_config(model_config)
    shape = meshspec.parse_mesh(mesh, chips)
    assert cfg.moe.num_experts % shape["expert"] == 0
    assert meshspec.tensor_problems(cfg, shape["model"]) == []


@pytest.mark.parametrize("kind", sorted(SERVING))
def test_every_server_argv_carries_the_mesh_plan_serve_states(kind, tmp_path):
    config = SERVING[kind]
    served = _plan(config)
    flag = served["mesh"]["server_flag"].split()
    # The plan says the configured precision fits on that mesh, with its own figures.
    configured = served["precisions"][served["configured_precision"]]
    assert configured["fits"] and configured["memory_bytes_per_chip"] <= configured["hbm_usable_bytes_per_chip"]
    assert served["verdict"].startswith("SERVES") and f"mesh {flag[1]}" in served["verdict"]
    args = _rendered_server_args(config, tmp_path / "out")
    assert flag_value(args, "--mesh") == flag[1] and args.count("--mesh") == 1
    cfg = load_config(config)
    _server_accepts(flag[1], served["chips"], cfg.trainer.config)
    # The dry run's server: the same argv, its mesh made one device's as its --devices says.
    argv = list(server_container(cfg, "image").argv)
    assert flag_value(argv, "--mesh") == flag[1]
    adapted, _ = dry_run_adapter(cfg, tmp_path)(argv, {})
    devices = int(flag_value(adapted, "--devices"))
    assert meshspec.parse_mesh(flag_value(adapted, "--mesh"), devices) == {"data": 1, "expert": 1, "model": 1}


def _with_serve_mesh(tmp_path: Path, mesh: str) -> Path:
    raw = yaml.safe_load(SERVING["gke"].read_text())
    raw["serve"]["mesh"] = mesh
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_serve_mesh_in_the_config_is_what_the_plan_and_every_server_get(tmp_path):
    config = _with_serve_mesh(tmp_path, "expert=2,model=2")
    served = _plan(config)
    assert served["mesh"]["source"] == "serve.mesh"
    assert served["mesh"]["server_flag"] == "--mesh data=1,expert=2,model=2"
    assert flag_value(_rendered_server_args(config, tmp_path / "out"), "--mesh") == "data=1,expert=2,model=2"
    code, out, _ = moe("plan", "-c", str(config), "--serve")
    assert code == 0 and "(given in serve.mesh); deploy starts each replica's server with --mesh data=1,expert=2," \
                         "model=2" in out


def test_a_serve_mesh_that_is_not_the_replicas_is_refused_naming_the_key(tmp_path):
    config = _with_serve_mesh(tmp_path, "model=8")
    code, out, err = moe("validate", "-c", str(config))
    assert (code, out) == (2, "") and "serve.mesh: serve.mesh model=8 needs a multiple of expert x model = 8 " \
                                      "chips, but the serving replica has 4" in err
    code, _, err = moe("plan", "-c", str(config), "--serve")
    assert code == 2 and "serve.mesh model=8 needs a multiple of expert x model = 8 chips" in err
    config = _with_serve_mesh(tmp_path, "expert=4")  # v5e-64 has 64 experts: fine; tiny-headed models are not
    assert moe("validate", "-c", str(config))[0] == 0


def test_plan_serve_mesh_describes_the_replica_and_leaves_the_training_plan_its_own(tmp_path):
    code, out, err = moe("--output", "json", "plan", "-c", str(SERVING["vertex"]), "--serve", "--mesh", "model=4")
    doc = json.loads(out)
    assert code == 0 and doc["mesh"]["trainer_flag"] == "--mesh data=8,expert=8" and doc["fits"]
    assert doc["serve"]["mesh"] == {"data_ways": 1, "expert_ways": 1, "model_ways": 4, "source": "--mesh",
                                    "server_flag": "--mesh data=1,expert=1,model=4",
                                    "reason": "expert=1,model=4: given with --mesh"}
    code, out, _ = moe("plan", "-c", str(SERVING["vertex"]), "--serve", "--mesh", "model=4")
    assert code == 0 and "(deploy uses it once it is the config's serve.mesh)" in out


@pytest.mark.parametrize("example", ["serve-vertex", "serve-gke", "moe-1.2t", "v5e-64"])
def test_the_serve_verdict_names_only_precisions_that_fit_and_that_the_engine_serves(example):
    """The verdict agrees with the rows beside it and with the engine's own list of weight formats."""
    from trainer.serve.memory import QUANTIZED_WEIGHTS

    served = _plan(ROOT / "examples" / f"{example}.yaml")
    engine = {"bf16", "float32", *QUANTIZED_WEIGHTS}
    rows = served["precisions"]
    verdict = served["verdict"]
    servable = [name for name, row in rows.items() if row["fits"] and row["weights_precision"] in engine]
    if verdict.startswith("SERVES at "):
        named = verdict.removeprefix("SERVES at ").split(":")[0].split(" (not ")[0].split(", ")
        assert named == servable
    else:
        assert servable == [] and "SERVES AT NO PRECISION" in verdict
    for name, row in rows.items():
        if row["weights_precision"] not in engine and row["fits"]:
            assert f"the engine serves bf16, float32 and {', '.join(QUANTIZED_WEIGHTS)} weights" in verdict


@pytest.mark.parametrize("kind", sorted(SERVING))
def test_the_examples_predict_command_works_on_the_dry_runs_checkpoint(kind):
    """The comment's dry run serves examples/v5e-64.yaml's dry-run checkpoint, trained on synthetic tokens
    with no tokenizer: the server reads a prompt as token ids only (trainer.sample.Codec)."""
    import re
    import shlex

    text = SERVING[kind].read_text()
    [command] = [line.lstrip("# ").split("&&")[0] for line in text.splitlines() if " predict " in line]
    args = shlex.split(command)
    prompt = args[args.index("--prompt") + 1]
    assert re.fullmatch(r"\d+( \d+)*", prompt), prompt
    cfg = load_config(ROOT / "examples" / "v5e-64.yaml")
    assert load_trainer_config(cfg.dry_run.trainer_config).data.source == "synthetic"
