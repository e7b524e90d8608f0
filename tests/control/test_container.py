"""The container as one contract (provision/container.py): every renderer runs the trainer the same way,
and the mesh the plan approves is the mesh each of them (and the dry run) passes the trainer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from test_rendering import _run_docker_args

from provision import container, planner
from provision.config import load_config
from provision.emulator.local_trainer import local_argv
from provision.rendering import Renderer, trainer_argv

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
IMAGE = "registry.example/trainer:v1"


def _yaml_containers(node) -> list[dict]:
    """Every container (a mapping with an image and a command) in a parsed manifest."""
    if isinstance(node, dict):
        own = [node] if "image" in node and "command" in node else []
        return own + [c for value in node.values() for c in _yaml_containers(value)]
    if isinstance(node, list):
        return [c for item in node for c in _yaml_containers(item)]
    return []


def trainer_argvs(files: dict[str, str]) -> dict[str, list[str]]:
    """The trainer's argv in each rendered file that starts it, by file name: the startup script's
    `docker run` (the image's entry point is the trainer), the CustomJob request, the JobSet."""
    found: dict[str, list[str]] = {}
    for name, text in files.items():
        if name == "startup.sh":
            env = {"PATH": os.environ["PATH"], "CONTAINER": "c", "RUN": "r", "IMAGE": IMAGE}
            args = _run_docker_args(text, env)
            found[name] = [*container.TRAINER_COMMAND, *args[args.index(IMAGE) + 1:]]
        elif name == "create_custom_job.json":
            spec = json.loads(text)["custom_job"]["job_spec"]["worker_pool_specs"][0]["container_spec"]
            found[name] = [*spec["command"], *spec["args"]]
        elif name.endswith("jobset.yaml"):
            trainers = [c for c in _yaml_containers(yaml.safe_load(text))
                        if tuple(c["command"]) == container.TRAINER_COMMAND]
            assert len({json.dumps(c["args"]) for c in trainers}) == 1, "every trainer of the JobSet alike"
            found[name] = [*trainers[0]["command"], *trainers[0]["args"]]
    return found


def _mesh(argv: list[str]) -> str | None:
    return argv[argv.index("--mesh") + 1] if "--mesh" in argv else None


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
def test_every_renderer_passes_the_trainer_the_mesh_the_plan_approves(example, tmp_path):
    cfg = load_config(example, check_trainer=True)  # as `validate` and `run` load it
    files = cfg.kind.render(cfg, Renderer(IMAGE))
    argvs = trainer_argvs(files)
    assert argvs, f"{example.name}: no rendered file starts the trainer"
    plan = planner.plan_for(cfg)
    # Every example states its mesh, and it fits by its own plan.
    assert cfg.trainer.mesh is not None and plan.mesh_source == "trainer.mesh" and plan.fits, example.name
    stated = [line for line in example.read_text().splitlines() if line.strip().startswith("mesh:")]
    assert len(stated) == 1 and "`moe-tpu plan`" in stated[0], stated  # with a comment: what the plan said
    for name, argv in argvs.items():
        assert argv[:len(container.TRAINER_COMMAND)] == list(container.TRAINER_COMMAND), name
        assert argv.count("--mesh") == 1 and _mesh(argv) == plan.mesh.text() == cfg.trainer.mesh, name
    # The dry run runs the same argv made small: its mesh is dry_run.mesh, which the plan checks too.
    local = local_argv(trainer_argv(cfg), cfg, tmp_path)
    assert local.count("--mesh") == 1 and _mesh(local) == cfg.dry_run.mesh and not planner.mesh_problems(cfg)


# Each kind of target without trainer.mesh: (example, the GKE runtime to render it with, if any).
UNSET = [("v5e-64.yaml", None), ("vertex.yaml", None), ("gke.yaml", "jax"), ("gke-pathways.yaml", "pathways")]


@pytest.mark.parametrize(("example", "runtime"), UNSET, ids=lambda v: str(v))
def test_without_trainer_mesh_every_renderer_passes_the_plans_choice(example, runtime, tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    del doc["trainer"]["mesh"]
    if runtime:
        doc["gke"]["runtime"] = runtime
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_config(path, check_trainer=True)
    plan = planner.plan_for(cfg)
    assert cfg.trainer.mesh is None and plan.mesh_source == "plan" and plan.fits
    assert cfg.trainer_mesh == cfg.planned_mesh == plan.mesh.text()
    assert f"the trainer is started with --mesh {plan.mesh.text()}" in planner.mesh_source_text(plan)
    argvs = trainer_argvs(cfg.kind.render(cfg, Renderer(IMAGE)))
    assert argvs and all(_mesh(argv) == plan.mesh.text() for argv in argvs.values()), argvs
    assert "planned_mesh" not in cfg.model_dump()  # decided here, never written back or read from a file


def test_a_config_whose_mesh_the_plan_cannot_choose_is_refused_saying_what_to_set(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "moe-1.2t.yaml").read_text())
    del doc["trainer"]["mesh"]
    doc["slice"]["count"] = 1  # 1.2T parameters on 64 chips: no mesh fits
    (tmp_path / "huge.yaml").write_text(yaml.safe_dump(doc))
    doc = yaml.safe_load((ROOT / "examples" / "vertex.yaml").read_text())
    del doc["trainer"]["mesh"]
    doc["trainer"]["overrides"] = {"moe.num_experts": 0}  # a trainer config the trainer refuses
    (tmp_path / "refused.yaml").write_text(yaml.safe_dump(doc))
    doc["planned_mesh"] = "data=64"  # internal: never taken from a file
    (tmp_path / "internal.yaml").write_text(yaml.safe_dump(doc))
    from cli_helpers import invoke

    code, _, err = invoke("validate", "-c", str(tmp_path / "huge.yaml"))
    assert code == 2 and "trainer.mesh: not set, and no mesh of the target's 64 chips fits moe-1.2t" in err
    assert "set `trainer.mesh: data=D,expert=E`" in err and "fits on 64 x v5litepod-64" in err
    code, _, err = invoke("render", "-c", str(tmp_path / "huge.yaml"), "--out", str(tmp_path / "out"))
    assert code == 2 and "trainer.mesh: not set" in err and not (tmp_path / "out").exists()
    code, _, err = invoke("validate", "-c", str(tmp_path / "refused.yaml"))
    assert code == 2 and "trainer.overrides.moe.num_experts" in err and "trainer.mesh: not set" in err
    code, _, err = invoke("validate", "-c", str(tmp_path / "internal.yaml"))
    assert code == 2 and "planned_mesh" in err


def test_the_two_commands_of_the_image():
    cfg = load_config(ROOT / "examples" / "vertex.yaml")
    trainer = container.trainer_container(cfg, IMAGE)
    assert trainer.command == container.TRAINER_COMMAND and trainer.argv == tuple(trainer_argv(cfg))
    assert trainer.env == {"MOE_TPU_RUN": cfg.run} and trainer.ports == ()
    server = container.server_container(cfg, IMAGE)
    assert server.command == ("python", "-m", "trainer.serve") and server.ports == (container.SERVER_PORT,)
    assert server.args[:2] == ("--checkpoint", cfg.trainer.output_dir)
    assert server.env["AIP_HTTP_PORT"] == str(container.SERVER_PORT)
    assert trainer.with_env(EXTRA="1").env == {"MOE_TPU_RUN": cfg.run, "EXTRA": "1"} and "EXTRA" not in trainer.env


def test_the_dry_run_makes_the_trainer_small_and_runs_the_server_as_it_is(tmp_path):
    cfg = load_config(ROOT / "examples" / "vertex.yaml")
    trainer = local_argv(container.trainer_container(cfg, IMAGE).argv, cfg, tmp_path)
    assert trainer[0] == sys.executable and trainer[trainer.index("--config") + 1] == cfg.dry_run.trainer_config
    assert trainer[trainer.index("--output-dir") + 1] == str(tmp_path)
    server = container.server_container(cfg, IMAGE).argv
    assert local_argv(server, cfg, tmp_path) == [sys.executable, *server[1:]]


def test_the_server_takes_the_serve_sections_engine_limits():
    cfg = load_config(ROOT / "examples" / "serve-vertex.yaml")
    args = container.server_container(cfg, IMAGE).args
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--checkpoint"] == cfg.trainer.output_dir and flags["--slots"] == str(cfg.serve.slots)
    assert (flags["--max-len"], flags["--weights"], flags["--kv-cache-dtype"]) == (
        str(cfg.serve.max_len), cfg.serve.weights, cfg.serve.kv_cache_dtype)
    assert container.server_container(cfg, IMAGE, "gs://b/other").args[1] == "gs://b/other"


def test_every_weight_format_the_engine_quantizes_to_is_a_serve_section_value_and_a_server_flag():
    """trainer/serve/memory.py's list (int8, int4) is what `weights:` takes, what deploy renders into the
    server's argv, and what the server's --weights accepts."""
    from trainer.serve.cli import serve_command
    from trainer.serve.memory import QUANTIZED_WEIGHTS

    cfg = load_config(ROOT / "examples" / "serve-vertex.yaml")
    choices = next(p for p in serve_command.params if p.name == "weight_format").type.choices
    assert "int4" in QUANTIZED_WEIGHTS and set(choices) == {"auto", *QUANTIZED_WEIGHTS}
    for weights in QUANTIZED_WEIGHTS:
        serve = type(cfg.serve).model_validate({**cfg.serve.model_dump(), "weights": weights})
        args = container.server_container(cfg.model_copy(update={"serve": serve}), IMAGE).args
        assert args[args.index("--weights") + 1] == weights
