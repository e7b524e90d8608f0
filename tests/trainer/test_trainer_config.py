"""The trainer's typed config: named configs, overrides, and errors that name the key."""

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import flops
from trainer.config import NAMED_CONFIGS, NO_DATA, Config, ConfigError, check, load_config, named_configs
from trainer.moe import MoEConfig


def test_named_configs_ship_and_load():
    assert {"tiny", "switch-base-8", "glam-small", "v5e-64", "moe-1b"} <= set(named_configs())
    for name in named_configs():
        cfg = load_config(name)
        assert isinstance(cfg, Config) and cfg.name == name


def test_overrides_reach_typed_fields():
    cfg = load_config("tiny", ["dtype=bfloat16", "moe.num_experts=4", "moe.top_k=1",
                               "moe.capacity_factor=0", "data.source=synthetic", "train.seed=7"])
    assert (cfg.dtype, cfg.moe.num_experts, cfg.moe.top_k) == ("bfloat16", 4, 1)
    assert cfg.moe.capacity_factor == 0.0 and isinstance(cfg.moe.capacity_factor, float)
    assert cfg.train.seed == 7


def test_a_yaml_file_can_inherit_a_named_config(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: tiny\nmodel:\n  num_layers: 3\n")
    cfg = load_config(str(path))
    assert cfg.name == "mine" and cfg.model.num_layers == 3 and cfg.model.d_model == 64


@pytest.mark.parametrize("overrides, needle", [
    (["moe.num_expert=4"], "did you mean 'moe.num_experts'"),
    (["modle.d_model=4"], "did you mean 'model'"),
    (["dtype=float8"], "dtype must be one of"),
    (["model.num_layers=two"], "model.num_layers must be an integer"),
    (["moe.top_k=9"], "moe"),
    (["data.source=text"], "needs data.path"),
    (["model.d_model=65"], "divisible"),
    (["nonsense"], "key.sub=value"),
    (["data.eval_share=1.5"], "data.eval_share must be in [0, 1)"),
    (["data.source=tokens", "data.path=t.bin", "data.eval_share=0.1", "data.eval_path=e.bin"],
     "set data.eval_path or data.eval_share, not both"),
    (["data.source=text", "data.path=x", "data.eval_share=0.1"], "set data.eval_path instead"),
    (["train.profile_steps=[5, 2]"], "train.profile_steps must be [A, B] with 1 <= A <= B"),
    (["train.profile_steps=3:5"], "train.profile_steps: expected [A, B] (YAML reads A:B unquoted as a number)"),
    (["train.profile_steps='5:2'"], "train.profile_steps: expected A:B with 1 <= A <= B"),
    (["train.eval_every=-1"], "train.eval_every must be 0 or more"),
    (["data.source=tokens", "data.path=t.bin", "train.eval_every=10"],
     "train.eval_every needs evaluation data: set data.eval_path or data.eval_share"),
])
def test_bad_configs_raise_config_error_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=None) as err:
        load_config("tiny", overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("config, overrides, steps, message", [
    ("tiny", ["moe.num_expert=4"], None, "unknown key 'moe.num_expert'; did you mean 'moe.num_experts'?"),
    ("tiny", ["optim.lr=nan"], None, "optim.lr must be a finite number, got 'nan'"),
    ("tiny", ["optim.lr=.inf"], None, "optim.lr must be a finite number, got inf"),
    ("tiny", ["moe.capacity_factor=-.inf"], None, "moe.capacity_factor must be a finite number, got -inf"),
    ("tiny", ["moe.top_k=9"], None, "invalid config: moe.top_k must be in [1, num_experts=8], got 9"),
    ("tiny", ["train.log_every=0"], None, "train.log_every must be at least 1, got 0"),
    ("tiny", [], 0, "steps must be at least 1, got 0"),
    ("tiny", ["train.steps=0"], None, "train.steps must be at least 1 for a run, got 0"),
    ("tiny", ["model=3"], None, "model must be a mapping, got 3"),
    ("tiny", ["data.source=none"], None, NO_DATA),  # an import's config: a run on the cloud asks for its data too
])
def test_check_rejects_what_load_config_rejects_naming_the_key(config, overrides, steps, message):
    with pytest.raises(ConfigError) as err:
        check(config, overrides, steps)
    assert str(err.value) == message


def test_check_lists_the_named_configs_and_accepts_a_good_one(tmp_path):
    with pytest.raises(ConfigError) as err:
        check("glam-smal", [], 10)
    assert str(err.value).startswith("unknown config 'glam-smal' (did you mean 'glam-small'?); named configs: ")
    assert all(name in str(err.value) for name in NAMED_CONFIGS)
    assert {"tiny", "glam-small", "v5e-64"} <= set(NAMED_CONFIGS) and NAMED_CONFIGS == tuple(named_configs())
    check("tiny", ["optim.lr=1e-3", "moe.top_k=1"], 40)  # 1e-3: YAML 1.1 reads it as text; still a number
    assert load_config("tiny", ["optim.lr=1e-3"]).optim.lr == 0.001
    (tmp_path / "mine.yaml").write_text("base: tiny\ntrain:\n  steps: 5\n")
    check(str(tmp_path / "mine.yaml"), [])
    with pytest.raises(ConfigError, match=f"cannot read config {tmp_path}: Is a directory"):
        check(str(tmp_path), [])


def test_unknown_named_config_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config("tiyn")


def test_param_counts_match_the_built_model():
    import jax
    from flax import nnx

    from trainer.model import build_model

    for overrides in ([], ["model.tie_embeddings=true", "model.moe_every=2", "model.num_kv_heads=2"],
                      ["moe.num_shared_experts=2", "moe.shared_d_ff=24"]):
        cfg = load_config("tiny", overrides)
        params = nnx.state(nnx.eval_shape(lambda cfg=cfg: build_model(cfg)), nnx.Param)
        assert sum(x.size for x in jax.tree.leaves(params)) == flops.counts_of(cfg).total


def test_flops_and_peaks():
    cfg = load_config("v5e-64")
    counts = flops.counts_of(cfg)
    assert 12e9 < counts.total < 15e9 and 1.0e9 < counts.active < 1.4e9
    assert flops.device_peak_flops("TPU v5 lite") == 197e12
    assert flops.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.device_peak_flops("cpu") is None
    tiny = load_config("tiny")
    assert flops.mfu(tiny, 1.0, 1, "cpu") is None
    assert flops.mfu(tiny, 1.0, 2, "TPU v5 lite") == flops.flops_per_step(tiny) / (2 * 197e12)
    assert flops.flops_per_step(tiny) == flops.flops_per_token(tiny) * 16 * 64


def test_shared_experts_are_sized_by_shared_d_ff_in_the_mfu():
    """Two shared experts of width 24 (not moe.d_ff=64): every token passes through both, in each
    of tiny's two MoE layers, so the MFU's FLOPs grow by exactly 6 x 2 layers x 2 x 3 x 64 x 24."""
    plain = load_config("tiny")
    shared = load_config("tiny", ["moe.num_shared_experts=2", "moe.shared_d_ff=24"])
    assert flops.counts_of(shared).active - flops.counts_of(plain).active == 2 * 2 * 3 * 64 * 24
    assert flops.flops_per_token(shared) - flops.flops_per_token(plain) == 6 * 2 * 2 * 3 * 64 * 24
    assert flops.mfu(shared, 1.0, 1, "TPU v5 lite") > flops.mfu(plain, 1.0, 1, "TPU v5 lite")


def test_config_is_frozen():
    cfg = load_config("tiny")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.dtype = "bfloat16"


def test_config_models_are_frozen_pydantic_models_that_refuse_unknown_keys():
    """One validation across the project: pydantic, as the control plane's config. Frozen models hash by
    value, so a MoEConfig stays a static argument of jitted code."""
    cfg = load_config("tiny", ["moe.top_k=1"])
    assert isinstance(cfg, pydantic.BaseModel) and isinstance(cfg.moe, MoEConfig)
    assert cfg.moe == MoEConfig(**cfg.moe.model_dump()) and hash(cfg.moe) == hash(MoEConfig(**cfg.moe.model_dump()))
    assert cfg == load_config("tiny", ["moe.top_k=1"]) and hash(cfg) == hash(load_config("tiny", ["moe.top_k=1"]))
    assert cfg.to_dict()["moe"]["top_k"] == 1 and cfg.model.d_model == 64 and cfg.train.steps > 0
    with pytest.raises(pydantic.ValidationError, match="num_expert"):
        MoEConfig(num_expert=4)
    with pytest.raises(pydantic.ValidationError, match="routing"):
        MoEConfig(routing="hash")


@pytest.mark.parametrize("overrides, message", [
    (["moe.routing=hash"], "moe.routing must be one of 'token_choice' or 'expert_choice', got 'hash'"),
    (["moe.top_k=true"], "moe.top_k must be an integer, got True"),
    (["model.d_model=64.0"], "model.d_model must be an integer, got 64.0"),
    (["optim.lr=true"], "optim.lr must be a number, got True"),
    (["train.fsdp=1"], "train.fsdp must be true or false, got 1"),
    (["nonsense_key=1"], "unknown key 'nonsense_key'; valid keys: name, dtype, param_dtype, model, moe, data, "
                         "optim, train"),
    (["moe.routing=expert_choice", "moe.capacity_factor=0"], "invalid config: moe: expert_choice routing needs "
     "capacity_factor > 0 and eval_capacity_factor > 0 (each expert takes its top-C tokens; there is no dropless "
     "expert choice)"),
])
def test_type_and_choice_errors_name_the_dotted_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert str(err.value) == message


def test_an_empty_section_takes_the_defaults_and_numbers_may_be_yaml_text(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("moe:\noptim:\n  lr: 1e-3\n")
    cfg = load_config(str(path))
    assert cfg.moe == MoEConfig() and cfg.optim.lr == 0.001


@pytest.mark.parametrize("overrides, message", [
    (["optim.b1=1"], "optim.b1 must be in [0, 1), got 1"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio must be between 0 and 1, got 2"),
    (["optim.lr=0"], "optim.lr must be positive, got 0"),
    (["model.moe_every=-1"], "model.moe_every must be 0 or more (0: no MoE layers), got -1"),
    (["train.seed=-1"], "train.seed must be between 0 and 2147483647 (it becomes a 32-bit PRNG key), got -1"),
    (["data.seq_len=1"], "data.seq_len must be at least 2, got 1"),
    (["moe.top_k=0"], "moe.top_k must be at least 1, got 0"),
])
def test_a_bound_is_worded_from_its_declaration(overrides, message):
    """Whatever bound failed, the message states the whole range the field declares (Field(ge=, lt=))."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert str(err.value) == message



def test_the_training_docs_list_every_named_config():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    listed = re.search(r"Named configs: (.*?)\. `--set", readme, re.S).group(1)
    names = re.findall(r"`([\w.-]+)`", re.sub(r"\([^)]*\)", "", listed))  # what the parentheses say aside
    assert sorted(names) == sorted(named_configs())


@given(layers=st.integers(1, 64), every=st.integers(0, 4), dense=st.sets(st.integers(0, 63), max_size=6))
@settings(max_examples=200, deadline=None)
def test_the_count_of_moe_layers_is_the_layers_is_moe_layer_names(layers, every, dense):
    """num_moe_layers counts without asking each layer (the planner's estimates ask it for every mesh)."""
    kept_dense = tuple(sorted(i for i in dense if i < layers))
    model = load_config("tiny").model.model_copy(
        update={"num_layers": layers, "moe_every": every, "dense_layers": kept_dense})
    assert model.num_moe_layers == sum(model.is_moe_layer(i) for i in range(layers))


def test_a_model_too_big_in_float32_is_told_the_change_that_makes_it_fit():
    """moe-1b on one v5e chip (15.75 GiB) with float32 parameters and its whole loss at once: parameters, Adam
    and the logits need 19.3 GiB; bfloat16 parameters with remat fit, and the refusal says so. moe-1b as
    written fits. A model that fits neither way is told to shrink."""
    from trainer import fits

    v5e = int(15.75 * fits.GIB)
    one = {"data": 1, "expert": 1, "model": 1}
    as_first_written = ["param_dtype=float32", "model.remat=false", "train.loss_chunk=0"]
    problem = fits.fit_problem(load_config("moe-1b", as_first_written), one, v5e, "the TPU v5 lite device's memory")
    assert problem.startswith("the model cannot fit: its parameters, gradients and optimizer state and one "
                              "batch's logits need 19.3 GiB per device on the mesh")
    assert "; --set param_dtype=bfloat16 --set model.remat=true make it fit (11.6 GiB: " in problem
    assert fits.fit_problem(load_config("moe-1b", ["param_dtype=bfloat16"]), one, v5e, "one chip") is None
    assert fits.fit_problem(load_config("moe-1b"), one, v5e, "one chip") is None
    tiny = load_config("tiny")
    small = fits.state_bytes_per_device(load_config("tiny", ["param_dtype=bfloat16"]), one)
    hopeless = fits.fit_problem(tiny, one, small, "one chip")  # not even the logits beside it
    assert "param_dtype" not in hopeless and hopeless.endswith("or use more devices")
