"""Config validation: each rule with its exact message; every problem reported at once."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pydantic
import pytest
import yaml
from cli_helpers import changed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provision.config import (
    Config,
    config_from_dict,
    load_config,
    parse_duration,
    starter_config,
)
from provision.errors import ConfigError, Problem
from provision.waiting import format_duration

ROOT = Path(__file__).resolve().parents[2]

VALID = {
    "project": "my-project",
    "region": "us-west4",
    "zones": ["us-west4-a"],
    "run": "moe-demo",
    "slice": {"accelerator": "v5litepod-64", "capacity": "spot", "max_wait": "2h"},
    "image": {"repository": "us-west4-docker.pkg.dev/my-project/moe/trainer"},
    "trainer": {"output_dir": "gs://my-bucket/moe-demo"},
}
V5E_TYPES = ("v5litepod-1, v5litepod-4, v5litepod-8, v5litepod-16, v5litepod-32, v5litepod-64, "
             "v5litepod-128, v5litepod-256")


def with_(**changes) -> dict:
    """VALID with dotted keys changed (value None deletes the key)."""
    return changed(copy.deepcopy(VALID), **changes)


def problems_of(raw, tmp_path: Path) -> list[tuple[str, str]]:
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert all(p.file == str(path) for p in info.value.problems)
    assert info.value.exit_code == 2
    return [(p.key, p.message) for p in info.value.problems]


def test_valid_config_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(VALID))
    cfg = load_config(path)
    assert (cfg.project, cfg.region, cfg.zones, cfg.run, cfg.target) == (
        "my-project", "us-west4", ["us-west4-a"], "moe-demo", "tpu-vm")
    assert (cfg.slice.count, cfg.slice.capacity, cfg.slice.max_wait, cfg.slice.runtime_version) == (
        1, "spot", timedelta(hours=2), "v2-alpha-tpuv5-lite")
    # no image.tag: the content-hash tag that `image build` gives this tree (provision.image.image_reference)
    assert cfg.image.tag is None
    assert cfg.image.registry_host == "us-west4-docker.pkg.dev"
    assert (cfg.trainer.config, cfg.recovery.max_restarts) == ("tiny", 3)
    # the config is its kind's: a TPU VM's has the slice section, no other kind's
    assert cfg.section("slice") is cfg.slice and cfg.section("vertex") is None and not hasattr(cfg, "vertex")
    assert cfg.accelerator_type().chips == 64
    assert cfg.source == path
    assert "source" not in cfg.model_dump()


def test_config_is_frozen():
    cfg = config_from_dict(VALID)
    with pytest.raises(pydantic.ValidationError):
        cfg.run = "other"  # type: ignore[misc]


@pytest.mark.parametrize("raw, expected", [
    pytest.param(with_(project="My_Project"), [("project",
        "project id 'My_Project' must be 6 to 30 lowercase letters, digits or hyphens, start with a letter "
        "and not end with a hyphen")], id="project-shape"),
    pytest.param(with_(project="abc"), [("project",
        "project id 'abc' must be 6 to 30 lowercase letters, digits or hyphens, start with a letter "
        "and not end with a hyphen")], id="project-short"),
    pytest.param(with_(region="west"), [("region", "region 'west' is not a region name like us-west4")],
                 id="region-shape"),
    pytest.param(with_(zones=["uswest"]), [("zones[0]", "zone 'uswest' is not a zone name like us-west4-a")],
                 id="zone-shape"),
    pytest.param(with_(target="vertex", zones=["us-central1-a"]),
                 [("zones[0]", "zone 'us-central1-a' is not in region 'us-west4'")],
                 id="zone-outside-region"),
    pytest.param(with_(zones=["us-west4-a", "us-central1-a"], slice__subnetwork="tpus"),
                 [("zones[1]", "zone 'us-central1-a' is not in region 'us-west4', where slice.subnetwork "
                               "'tpus' is (a subnetwork serves its own region only)")],
                 id="zone-outside-the-subnetwork-region"),
    pytest.param(with_(zones=["us-west4-a"],
                       slice__subnetwork="projects/my-project/regions/us-central1/subnetworks/tpus"),
                 [("zones[0]", "zone 'us-west4-a' is not in region 'us-central1', where slice.subnetwork "
                               "'projects/my-project/regions/us-central1/subnetworks/tpus' is (a subnetwork "
                               "serves its own region only)")],
                 id="zone-outside-a-subnetwork-path-region"),
    pytest.param(with_(zones=[]), [("zones", "list at least one zone, e.g. [us-west4-a]")], id="no-zones"),
    pytest.param(with_(run="Moe_Demo"), [("run",
        "run name 'Moe_Demo' must be lowercase letters, digits and hyphens, start with a letter and not end "
        "with a hyphen (it becomes resource ids: RFC 1035)")], id="run-rfc1035"),
    pytest.param(with_(run="1st-run"), [("run",
        "run name '1st-run' must be lowercase letters, digits and hyphens, start with a letter and not end "
        "with a hyphen (it becomes resource ids: RFC 1035)")], id="run-starts-with-digit"),
    pytest.param(with_(run="a" * 51), [("run",
        f"run name '{'a' * 51}' is 51 characters; at most 50, so that the resource ids derived from it "
        "stay within 63")], id="run-too-long"),
    pytest.param(with_(slice__accelerator="v5litepod-12"), [("slice.accelerator",
        f"unknown accelerator type 'v5litepod-12'; did you mean 'v5litepod-128'? (v5e types: {V5E_TYPES})")],
                 id="accelerator-unknown"),
    pytest.param(with_(slice__accelerator="v4-8"), [("slice.accelerator",
        f"unknown accelerator type 'v4-8' (v5e types: {V5E_TYPES})")], id="accelerator-other-generation"),
    pytest.param(with_(slice__runtime_version="v2-alpha-tpuv5"), [("slice.runtime_version",
        "runtime version 'v2-alpha-tpuv5' does not fit v5litepod-64; use v2-alpha-tpuv5-lite, "
        "v2-tpuv5-litepod, tpu-ubuntu2204-base")],
                 id="runtime-mismatch"),
    pytest.param(with_(slice__count=0), [("slice.count", "must be between 1 and 256, got 0")],
                 id="count"),
    pytest.param(with_(slice__capacity="preemptible"), [("slice.capacity",
        "must be one of 'on-demand', 'spot' or 'reserved', got 'preemptible'")], id="capacity"),
    pytest.param(with_(slice__capacity="reserved"), [("slice.reservation",
        "capacity 'reserved' needs slice.reservation (the reservation's name)")],
                 id="reserved-needs-reservation"),
    pytest.param(with_(slice__reservation="r1"), [("slice.reservation",
        "a reservation is only used with capacity 'reserved' (capacity is 'spot')")],
                 id="reservation-unused"),
    pytest.param(with_(slice__max_wait="2 hours"), [("slice.max_wait",
        "duration '2 hours' must look like 2h, 30m, 90s or 1h30m")], id="duration-words"),
    pytest.param(with_(slice__max_wait=90), [("slice.max_wait",
        "duration 90 must look like 2h, 30m, 90s or 1h30m")], id="duration-bare-number"),
    pytest.param(with_(slice__max_wait="0m"), [("slice.max_wait", "duration '0m' must be longer than 0s")],
                 id="duration-zero"),
    pytest.param(with_(vertex={"machine_type": "ct5lp-hightpu-1t"}), [("vertex.topology",
        "topology '8x8' does not fit machine type 'ct5lp-hightpu-1t'; it takes 1x1")], id="vertex-mismatch"),
    pytest.param(with_(vertex={"machine_type": "ct5lp-hightpu-4"}), [("vertex.machine_type",
        "unknown Vertex machine type 'ct5lp-hightpu-4'; did you mean 'ct5lp-hightpu-4t'? "
        "(v5e machine types: ct5lp-hightpu-1t, ct5lp-hightpu-4t, ct5lp-hightpu-8t)")], id="vertex-machine"),
    pytest.param(with_(vertex={"topology": "3x3"}), [("vertex.topology",
        "unknown v5e topology '3x3' (v5e topologies: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16)")],
                 id="vertex-topology"),
    pytest.param(with_(target="vertex", vertex={"scheduling": "SPOT"}), [("vertex.scheduling",
        "Vertex AI does not offer SPOT for multi-host TPU topologies (8x8); use STANDARD or FLEX_START")],
                 id="vertex-spot-pod"),
    pytest.param(with_(image__repository="trainer:latest"), [("image.repository",
        "image repository 'trainer:latest' does not look like HOST/PROJECT/REPOSITORY/IMAGE "
        "(e.g. us-west4-docker.pkg.dev/my-project/moe/trainer; the tag goes in image.tag)")],
                 id="image-shape"),
    pytest.param(with_(image__repository="us-west4-docker.pkg.dev/my-project/trainer"), [("image.repository",
        "image repository 'us-west4-docker.pkg.dev/my-project/trainer' does not look like "
        "HOST/PROJECT/REPOSITORY/IMAGE (e.g. us-west4-docker.pkg.dev/my-project/moe/trainer; the tag goes in "
        "image.tag)")], id="image-no-repository"),
    pytest.param(with_(image__tag="v1 beta"), [("image.tag",
        "image tag 'v1 beta' is not a valid tag (letters, digits, '_', '.', '-'; at most 128 characters)")],
                 id="image-tag"),
    pytest.param(with_(trainer__overrides={"a": [1]}), [("trainer.overrides",
        "override 'a' must be a string, a number or true/false, got [1]")], id="override-value"),
    pytest.param(with_(trainer__overrides={"a b": 1}), [("trainer.overrides",
        "override key 'a b' must be a dotted name like model.num_experts")], id="override-key"),
    pytest.param(with_(trainer__steps=0), [("trainer.steps", "must be at least 1, got 0")], id="steps"),
    pytest.param(with_(recovery={"max_restarts": -1}), [("recovery.max_restarts",
        "must be 0 or more, got -1")], id="max-restarts"),
    pytest.param(with_(target="k8s"), [("target", "must be one of 'tpu-vm', 'vertex' or 'gke', got 'k8s'")],
                 id="target"),
    pytest.param(with_(trainer=None), [("trainer", "missing required key")], id="missing-section"),
    pytest.param(with_(region=None), [("region", "missing required key")], id="missing-key"),
    pytest.param(with_(run=7), [("run", "must be a string, got 7")], id="wrong-type"),
    pytest.param(with_(slice__acelerator="v5litepod-8"), [("slice.acelerator",
        "unknown key 'acelerator'; did you mean 'accelerator'?")], id="unknown-key-close"),
    pytest.param(with_(colour="blue"), [("colour",
        "unknown key 'colour'; valid keys: project, region, zones, run, target, slice, vertex, gke, image, "
        "trainer, recovery, dry_run, serve")], id="unknown-key-far"),
    pytest.param(with_(source="x.yaml"), [("source", "unknown key 'source'")], id="source-is-not-a-key"),
    pytest.param(with_(slice__accelerator="v5litepod-16", trainer__output_dir="runs/x"), [("trainer.output_dir",
        "v5litepod-16 x 1 has several TPU VMs, each with its own disk: checkpoints in 'runs/x' would be split "
        "between them; use a gs:// path")], id="local-output-dir-on-many-hosts"),
    pytest.param(with_(target="vertex", trainer__output_dir="/data/x"), [("trainer.output_dir",
        "a Vertex AI job keeps its checkpoints in Cloud Storage: use a gs:// path, not '/data/x' (a local path "
        "vanishes with the job)")], id="local-output-dir-on-vertex"),
    pytest.param(with_(vertex__timeout="soon", dry_run__mesh="2x4"), [
        ("dry_run.mesh", "the trainer refuses it: mesh expects data=D,expert=E,model=T; got '2x4'"),
        ("vertex.timeout", "duration 'soon' must look like 2h, 30m, 90s or 1h30m")], id="vertex-and-dry-run-keys"),
])
def test_each_rule_has_its_message(raw, expected, tmp_path):
    assert problems_of(raw, tmp_path) == expected


def test_every_problem_is_reported_at_once(tmp_path):
    raw = with_(project="X", zones=["us-central1-a", "nowhere"], run="Bad", targt="vertex",
                slice__subnetwork="tpus", slice__count=0, slice__max_wait="soon", image__repository="trainer")
    keys = [key for key, _ in problems_of(raw, tmp_path)]
    # In file order (safe_dump sorts the keys).
    assert keys == ["image.repository", "project", "run", "slice.count", "slice.max_wait", "targt",
                    "zones[0]", "zones[1]"]


def test_a_field_that_failed_is_not_reported_again_by_a_cross_check(tmp_path):
    # The unknown accelerator is reported; the runtime check that depends on it is skipped.
    raw = with_(slice__accelerator="v9", slice__runtime_version="other")
    assert [key for key, _ in problems_of(raw, tmp_path)] == ["slice.accelerator"]


def test_problem_text_names_file_and_key(tmp_path):
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(with_(slice__count=0)))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [Problem(str(path), "slice.count", "must be between 1 and 256, got 0")]
    assert str(info.value) == (f"1 problem in the config:\n"
                               f"  {path}: slice.count: must be between 1 and 256, got 0")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert [str(p) for p in info.value.problems] == [
        f"{tmp_path / 'nope.yaml'}: file not found (write a starter config with `moe-tpu init`)"]


def test_yaml_syntax_error(tmp_path):
    assert problems_of("run: [moe\nregion: x\n", tmp_path) == [
        ("", "YAML syntax error at line 2, column 7: expected ',' or ']', but got ':'")]


def test_duplicate_keys_are_problems(tmp_path):
    rest = yaml.safe_dump(with_(run=None, slice=None))
    text = "run: moe-demo\nslice:\n  count: 2\n  count: 3\n" + rest + "run: b\n"
    last = len(text.splitlines())
    assert problems_of(text, tmp_path) == [("slice.count", "key appears twice (again at line 4)"),
                                           ("run", f"key appears twice (again at line {last})")]


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just words\n"])
def test_not_a_mapping(text, tmp_path):
    expected = [("", "the config must be a YAML mapping of keys (project, region, zones, run, ...)")]
    if text == "":
        expected = [("image", "missing required key"), ("region", "missing required key"),
                    ("run", "missing required key"), ("trainer", "missing required key"),
                    ("zones", "missing required key")]
        assert sorted(problems_of(text, tmp_path)) == expected
    else:
        assert problems_of(text, tmp_path) == expected


@pytest.mark.parametrize("text, delta", [
    ("2h", timedelta(hours=2)), ("30m", timedelta(minutes=30)), ("90s", timedelta(seconds=90)),
    ("1h30m", timedelta(hours=1, minutes=30)), ("1h0m5s", timedelta(hours=1, seconds=5)),
])
def test_durations(text, delta):
    assert parse_duration(text) == delta
    assert parse_duration(format_duration(delta, exact=True)) == delta
    assert config_from_dict(with_(slice__max_wait=text)).slice.max_wait == delta


@pytest.mark.parametrize("bad", ["", "h", "2", "2d", "1m2h", "-1h", "2 h"])
def test_bad_durations(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_run_of_fifty_characters_is_allowed():
    assert config_from_dict(with_(run="r" * 50)).run == "r" * 50


def test_reserved_with_reservation_and_empty_sections():
    cfg = config_from_dict(with_(slice__capacity="reserved", slice__reservation="my-res", recovery=None))
    assert (cfg.slice.reservation, cfg.recovery.max_restarts) == ("my-res", 3)


def test_no_project_is_allowed_in_the_config():
    assert config_from_dict(with_(project=None)).project is None


def test_overrides_become_set_flags():
    cfg = config_from_dict(with_(trainer__overrides={"model.num_experts": 8, "train.lr": 0.001,
                                                     "model.bias": False, "name": "x y"}))
    assert cfg.trainer.set_flags() == ["--set", "model.num_experts=8", "--set", "train.lr=0.001",
                                       "--set", "model.bias=false", "--set", "name=x y"]


def test_a_tpu_vm_run_fails_over_across_regions(tmp_path):
    """v5e is documented in one zone per region, so a TPU VM run's zones may lie in several regions
    (queued resources are zonal); only a subnetwork ties them to one."""
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(with_(zones=["us-west4-a", "us-central1-a", "us-south1-a"])))
    assert list(load_config(path).zones) == ["us-west4-a", "us-central1-a", "us-south1-a"]


def test_a_zone_the_catalogue_does_not_list_is_a_warning_not_a_problem():
    cfg = config_from_dict(with_(zones=["us-west4-a", "us-west4-b"]))
    assert cfg.zones == ["us-west4-a", "us-west4-b"]
    assert cfg.warnings() == [
        "zone 'us-west4-b' is not one of the zones Google documents for TPU v5e (us-central1-a, us-south1-a, "
        "us-west1-c, us-west4-a, europe-west4-b, asia-southeast1-b); the API's list of accelerator types in "
        "that zone decides"]
    assert config_from_dict(with_(target="vertex", zones=["us-west4-b"])).warnings() == []  # a region's job


def test_starter_config_is_valid(tmp_path):
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(starter_config())
    cfg = load_config(path)
    assert (cfg.run, cfg.slice.accelerator, cfg.target) == ("moe-demo", "v5litepod-64", "tpu-vm")


@pytest.mark.parametrize("name", ["v5e-64.yaml", "vertex.yaml", "local.yaml"])
def test_examples_are_valid(name):
    assert isinstance(load_config(ROOT / "examples" / name), Config)


# --- no input, however bad, escapes as anything but ConfigError ---------------------------


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | st.integers(), inner,
                                                                max_size=3),
    max_leaves=8)
_keys = st.sampled_from(["project", "region", "zones", "run", "target", "slice", "vertex", "image", "trainer",
                         "recovery", "source", "other", 3])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values, max_size=6), st.dictionaries(_keys, _values, max_size=3))
def test_any_structure_gives_config_error_or_config(extra, replace):
    raw = copy.deepcopy(VALID)
    raw.update(replace)
    for section in ("slice", "image", "trainer"):
        if isinstance(raw.get(section), dict) and extra:
            raw[section] = {**raw[section], **{str(k): v for k, v in extra.items()}}
    try:
        cfg = config_from_dict(raw)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p.message, str) and p.message for p in exc.problems)
    else:
        assert isinstance(cfg, Config)


@pytest.mark.parametrize("changes, words", [
    ({"vertex__tensorboard": "projects/my-project/locations/us-west4/tensorboards/123"},
     "a Vertex AI TensorBoard needs vertex.service_account"),
    ({"vertex__tensorboard": "projects/my-project/locations/us-central1/tensorboards/123",
      "vertex__service_account": "trainer@my-project.iam.gserviceaccount.com"}, "is not in the job's region"),
    ({"vertex__tensorboard": "my-board"}, "must look like projects/PROJECT/locations/REGION/tensorboards/ID"),
])
def test_a_vertex_tensorboard_is_checked_at_validate(tmp_path, changes, words):
    found = problems_of(with_(target="vertex", **changes), tmp_path)
    assert any(key == "vertex.tensorboard" and words in message for key, message in found), found


def test_a_vertex_tensorboard_with_its_service_account_in_the_region_is_taken():
    board = "projects/my-project/locations/us-west4/tensorboards/123"
    cfg = config_from_dict(with_(target="vertex", vertex__tensorboard=board,
                                 vertex__service_account="trainer@my-project.iam.gserviceaccount.com"))
    assert cfg.vertex.tensorboard == board


def test_both_halves_word_an_error_alike(tmp_path):
    """The control plane's config and the trainer's share one translator (trainer.schema.explain)."""
    from trainer import config as trainer_config

    problems = dict(problems_of(with_(dry_run={"devices": 0, "steps": "many"}), tmp_path))
    assert problems["dry_run.devices"] == "must be at least 1, got 0"
    with pytest.raises(trainer_config.ConfigError) as err:
        trainer_config.load_config("tiny", ["data.global_batch_size=0"])
    assert str(err.value) == "data.global_batch_size " + problems["dry_run.devices"]
    with pytest.raises(trainer_config.ConfigError) as err:
        trainer_config.load_config("tiny", ["train.steps=many"])
    assert str(err.value) == "train.steps " + problems["dry_run.steps"] == "train.steps must be an integer, got 'many'"

