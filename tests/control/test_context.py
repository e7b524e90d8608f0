"""The command's context (provision/context.py): resolved once at the boundary, handed down whole."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke as moe

from provision import image
from provision.app import App
from provision.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"


@pytest.fixture
def hashed(monkeypatch):
    """Every hash of the source tree for an image tag, counted (the tag itself is made up)."""
    calls: list[dict] = []
    monkeypatch.setattr(image, "content_tag", lambda **kw: calls.append(kw) or "0.1.0-feedface")
    return calls


def untagged(path: Path) -> Path:
    """The example without image.tag (its tag is the source tree's hash), written to `path`."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    del raw["image"]["tag"]
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_context_is_built_once_per_config_and_resolves_on_first_use(tmp_path, hashed):
    cfg = load_config(untagged(tmp_path / "c.yaml"))
    app = App(dry_run=True, output="json", workdir=tmp_path)
    try:
        context = app.context(cfg)
        assert app.context(cfg) is context
        assert hashed == [] and not app.used_cloud  # nothing resolved, nothing opened, until asked for
        assert context.image == "us-west4-docker.pkg.dev/my-project/moe/trainer:0.1.0-feedface"
        assert context.renderer.image == context.image and context.renderer.templates_dir is None
        assert len(hashed) == 1 and not app.used_cloud
        assert context.session is app.session() and context.clock is app.session().clock
        assert app.used_cloud
    finally:
        app.close()


def test_the_templates_directory_reaches_the_renderer_through_the_context(tmp_path, hashed):
    cfg = load_config(untagged(tmp_path / "c.yaml"))
    templates = tmp_path / "mine"
    templates.mkdir()
    context = App(dry_run=True, workdir=tmp_path, templates_dir=str(templates)).context(cfg)
    assert context.renderer.templates_dir == templates
    assert hashed == [{"templates_dir": templates}]  # the image tag hashes the Dockerfile these templates make


@pytest.mark.parametrize("args", [["validate"], ["render", "--out", "out"], ["slice", "up"]])
def test_a_command_hashes_the_source_tree_once(workdir, hashed, args):
    untagged(workdir / "c.yaml")
    code, out, err = moe("--dry-run", "--output", "json", *args, "-c", "c.yaml")
    assert code == 0, err
    assert len(hashed) == 1, hashed
    if args[0] == "slice":
        creates = [c for c in json.loads(out)["calls"] if c["rpc"].endswith("/CreateQueuedResource")]
        script = creates[0]["request"]["queued_resource"]["tpu"]["node_spec"][0]["node"]["metadata"]["startup-script"]
        assert "IMAGE=us-west4-docker.pkg.dev/my-project/moe/trainer:0.1.0-feedface\n" in script


def test_a_command_that_renders_nothing_never_hashes_the_tree(workdir, hashed):
    untagged(workdir / "c.yaml")
    code, _, err = moe("--dry-run", "down", "-c", "c.yaml")
    assert code == 0, err
    assert hashed == []


# --- the layering ---------------------------------------------------------------------------------

LIFECYCLE = ["provision/runs.py", "provision/kinds/tpu_vm/slices.py", "provision/kinds/gke/gke.py",
             "provision/kinds/vertex/jobs.py", "provision/kinds/__init__.py",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "provision" / "kinds").glob("*/kind.py"))]


def names_in(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    return {n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else n.arg
            for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute, ast.arg))}


def test_the_lifecycle_never_sees_the_templates_directory():
    found = {path: names_in(path) & {"templates_dir", "Renderer", "renderer_for"} for path in LIFECYCLE}
    assert {path: names for path, names in found.items() if names} == {}
    assert "provision/kinds/tpu_vm/kind.py" in LIFECYCLE


def test_rendering_never_hashes_the_source_tree():
    hashing = {"content_tag", "content_hash", "image_reference", "image_inputs", "renderer_for", "plan_image"}
    for path in ("provision/rendering.py", "provision/kinds/tpu_vm/slice_render.py", "provision/templates.py",
                 "provision/kinds/vertex/vertex_render.py", "provision/kinds/gke/gke_render.py"):
        assert names_in(path) & hashing == set(), path
    assert "content_hash" in names_in("provision/image.py")  # the check reads names that are there


def test_no_function_of_the_control_plane_takes_the_session_and_the_console_one_by_one():
    """They travel together in the context: only its constructor on an open session takes both."""
    both = []
    for path in sorted(ROOT.glob("provision/**/*.py")):
        if "emulator" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if {"session", "console"} <= params:
                    both.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert both == ["provision/context.py:on"]
