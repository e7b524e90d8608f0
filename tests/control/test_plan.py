"""`moe-tpu plan`: parameter counts from the trainer's own model, memory against XLA's analysis, every formula
on hand-computed examples, cost from the catalogue, the 1.2T model that does not fit, and the golden plan.

The goldens plan.v5e-64.txt.golden and plan.v5e-64.json.golden are the plan for examples/v5e-64.yaml;
regenerate them with `MOE_TPU_UPDATE_GOLDENS=1 python -m pytest -q tests/control/test_plan.py`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke as moe

from provision import catalogue, planner
from provision.config import load_config as load_run_config
from trainer.arith.params import inventory as listed
from trainer.config import load_config, named_configs
from trainer.params import ParamInfo, param_inventory, shard_ways

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"
HUGE = ROOT / "examples" / "moe-1.2t.yaml"
GOLDENS = Path(__file__).resolve().parent / "goldens"
UPDATE = os.environ.get("MOE_TPU_UPDATE_GOLDENS") == "1"
V5E_8 = catalogue.accelerator("v5litepod-8")
V5E_64 = catalogue.accelerator("v5litepod-64")


@functools.cache
def inventory(name: str, *overrides: str) -> tuple[ParamInfo, ...]:
    return param_inventory(load_config(name, overrides))


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("name", named_configs())
def test_params_total_is_what_the_trainer_instantiates(name):
    import jax
    from flax import nnx

    from trainer import flops
    from trainer.model import build_model

    cfg = load_config(name)
    assert listed(cfg) == inventory(name)  # the planner's list from the config alone: the model's, row for row
    total = planner.count_params(inventory(name), cfg).total
    assert total == flops.counts_of(cfg).total
    if total < 1e11:  # building a 1.2T model abstractly a second time takes seconds; the inventory did once
        built = nnx.state(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
        assert total == sum(leaf.size for leaf in jax.tree.leaves(built))


@pytest.mark.parametrize("overrides", [
    ("moe.num_shared_experts=1", "moe.shared_gate=true", "model.qkv_bias=true", "model.qk_norm=full",
     "train.shard_vocab=true", "model.tie_embeddings=true"),
    ("model.qk_norm=head", "model.out_bias=true", "model.attention_sinks=true", "moe.router_bias=true",
     "moe.ffn_bias=true", "param_dtype=bfloat16", "model.layer_types=[sliding,full]", "model.sliding_window=8")])
def test_the_config_alone_lists_the_parameters_the_model_holds_with_each_option(overrides):
    """trainer/arith/params.py lists the parameters without jax: those the model builds under jax, with the
    options the named configs leave out."""
    assert listed(load_config("tiny", overrides)) == inventory("tiny", *overrides)


@pytest.mark.parametrize("overrides", [(), ("moe.jitter=0.01", "moe.num_shared_experts=1")])
def test_the_inventory_lists_each_parameter_as_the_model_built_with_its_rngs_holds_it(overrides):
    """The inventory builds the model with a stand-in for nnx.Rngs (params._ShapeOnlyRngs); the model
    built with real ones (and router jitter, which forks them) holds the same names, shapes and dtypes."""
    import jax
    from flax import nnx

    from trainer.model import ParamCodec, build_model

    cfg = load_config("tiny", overrides)
    built = ParamCodec(nnx.state(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)).variables
    listed = inventory("tiny", *overrides)
    assert [p.name for p in listed] == list(built)
    for p in listed:
        value = built[p.name].get_value()
        assert (p.shape, p.dtype) == (tuple(value.shape), jax.numpy.dtype(value.dtype).name), p.name


@functools.cache
def tiny_trainer(*overrides: str):
    """The trainer's jitted pieces for tiny on the mesh the planner picks for a v5litepod-8, and that plan."""
    from trainer import sharding
    from trainer.step import build_trainer

    cfg = load_config("tiny", overrides)
    plan = planner.make_plan(inventory("tiny", *overrides), cfg, planner.Hardware(V5E_8, 1, "on-demand"), 10)
    mesh = sharding.make_mesh({"data": plan.mesh.data, "expert": plan.mesh.expert})
    return build_trainer(cfg, mesh, 10), plan


def test_tiny_counts_against_the_trainers_real_state():
    """Instantiated for real: the params and AdamW's mu and nu the trainer's init makes."""
    import jax

    cfg = load_config("tiny")
    trainer, plan = tiny_trainer()
    assert (plan.mesh.data, plan.mesh.expert) == (1, 8)
    state = trainer.initial_state()
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    moments = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0)
    counts = planner.count_params(inventory("tiny"), cfg)
    assert counts.total == params == 263_488 and moments == 2 * params
    # By hand: embedding and head 256 x 64 each; per layer attention 4 x 64 x 64, router 64 x 8, two norms,
    # 8 experts of 3 x 64 x 64; a final norm.
    assert counts.embedding == 2 * 256 * 64 and counts.per_expert == 3 * 64 * 64
    assert counts.experts == 2 * 8 * 3 * 64 * 64
    assert counts.active == counts.total - 2 * 6 * 3 * 64 * 64  # 6 of 8 experts unvisited (top 2)
    assert counts.matmul_active == 256 * 64 + 2 * (4 * 64 * 64 + 64 * 8 + 2 * 3 * 64 * 64)


def test_count_params_on_a_hand_made_inventory():
    cfg = load_config("tiny", ["model.num_layers=1", "model.tie_embeddings=true"])
    params = [ParamInfo("embed", (10, 4), "float32", ("vocab", "embed")),
              ParamInfo("blocks.0.ffn.w_in", (8, 4, 3), "float32", ("expert", "embed", "mlp")),
              ParamInfo("blocks.0.ffn.router", (4, 8), "float32", ("embed", None)),
              ParamInfo("final_norm.scale", (4,), "float32", ("norm",))]
    counts = planner.count_params(params, cfg)
    assert counts == planner.ParamCounts(total=40 + 96 + 32 + 4, active=40 + 24 + 32 + 4, per_expert=12,
                                         embedding=40, experts=96, matmul_active=40 + 32 + 24)


@pytest.mark.parametrize("name", ["tiny", "switch-base-8", "glam-small", "v5e-64", "moe-1b"])
def test_flops_per_token_agree_with_the_trainers_mfu(name):
    from trainer import flops

    cfg = load_config(name)
    counts = planner.count_params(inventory(name), cfg)
    assert planner.flops_per_token(counts, cfg) == flops.flops_per_token(cfg)


def test_the_planner_and_the_mfu_count_shared_experts_alike():
    from trainer import flops

    overrides = ("moe.num_shared_experts=1", "moe.shared_d_ff=40")
    cfg = load_config("tiny", overrides)
    counts = planner.count_params(inventory("tiny", *overrides), cfg)
    assert planner.flops_per_token(counts, cfg) == flops.flops_per_token(cfg)
    assert counts.total == flops.counts_of(cfg).total


def test_tiny_flops_by_hand():
    cfg = load_config("tiny")
    counts = planner.count_params(inventory("tiny"), cfg)
    matmul = 256 * 64 + 2 * (4 * 64 * 64 + 64 * 8 + 2 * 3 * 64 * 64)
    assert planner.flops_per_token(counts, cfg) == 6 * matmul + 12 * 2 * 64 * 4 * 16 == 694_272


# ----------------------------------------------------------------------------- mesh and layout


def test_mesh_options_take_divisors_of_the_experts_within_a_slice():
    assert [m.expert for m in planner.mesh_options(64, True, 64)] == [64, 32, 16, 8, 4, 2, 1]
    assert [m.expert for m in planner.mesh_options(6, True, 8)] == [2, 1]
    assert [(m.data, m.expert) for m in planner.mesh_options(64, True, 256, slices=4)][:2] == [(4, 64), (8, 32)]
    assert [m.expert for m in planner.mesh_options(64, False, 64)] == [1]


def test_choose_mesh_takes_the_largest_expert_axis_that_fits():
    cfg = load_config("tiny")
    mesh, memory = planner.choose_mesh(inventory("tiny"), cfg, V5E_8)
    assert (mesh.data, mesh.expert) == (1, 8) and memory.fits
    assert mesh.reason == "expert=8: the largest divisor of 8 experts that divides 8 chips"
    v5e = load_config("v5e-64")  # expert=64 leaves data=1: FSDP has nothing to shard the dense weights over
    mesh, memory = planner.choose_mesh(inventory("v5e-64"), v5e, V5E_64)
    assert (mesh.data, mesh.expert) == (2, 32) and memory.fits
    assert mesh.reason.endswith("divides 64 chips and fits; expert=64 needs more memory per chip")
    wide = planner.memory_per_chip(inventory("v5e-64"), v5e, planner.Mesh(1, 64), V5E_64)
    assert not wide.fits


def test_target_mesh():
    assert planner.target_mesh("data=8,expert=8", 64, 1) == planner.Mesh(8, 8, 1, "expert=8: given with --mesh")
    assert (planner.target_mesh("expert=4", 64, 1).data, planner.target_mesh("data=64", 64, 1).expert) == (16, 1)
    assert planner.target_mesh("expert=8,model=4", 64, 1) == planner.Mesh(2, 8, 1, "expert=8,model=4: given with --mesh",
                                                                           model=4)
    assert planner.target_mesh("expert=8,model=4", 64, 1).text() == "data=2,expert=8,model=4"
    # As the trainer reads it (trainer/meshspec.py): a data axis alone leaves expert at 1.
    for text, chips, slices, needle in (("data=3", 64, 1, "covers 3 chips"), ("data=16", 64, 1, "covers 16 chips"),
                                        ("expert=128", 64, 1, "needs a multiple of expert x model = 128 chips"),
                                        ("foo", 64, 1, "expects"),
                                        ("foo=1", 64, 1, "unknown axis 'foo'"), ("data=0", 64, 1, "at least 1"),
                                        ("expert=64", 128, 4, "divide the 32 chips of one slice"),
                                        ("data=2,expert=8,model=8", 128, 4, "expert x model = 64 must divide the 32"),
                                        ("data=8,model=4", 64, 1, "covers 32 chips")):
        with pytest.raises(ValueError, match=needle):
            planner.target_mesh(text, chips, slices)


def test_expert_capacity_is_the_trainers():
    from provision.planner import estimates
    from trainer.moe import capacity

    assert estimates.expert_capacity is capacity.expert_capacity


def test_tiny_layout_by_hand():
    cfg = load_config("tiny")  # batch 16 x 64 tokens, 8 experts, top 2, capacity factor 2
    layout = planner.chip_layout(cfg, planner.Mesh(1, 8))
    # 8 routing groups of 128 tokens; capacity ceil(128 * 2 * 2 / 8) = 64 slots per expert.
    assert (layout.rows, layout.tokens, layout.expert_rows, layout.assignments) == (2, 128, 8 * 64, 256)
    dropless = planner.chip_layout(load_config("tiny", ["moe.capacity_factor=0"]), planner.Mesh(1, 8))
    assert dropless.expert_rows == 256


def test_min_drop_fraction_and_the_warning():
    cfg = load_config("tiny", ["moe.capacity_factor=0.25", "moe.min_capacity=0"])
    mesh = planner.Mesh(1, 8)
    layout = planner.chip_layout(cfg, mesh)  # capacity ceil(128 * 2 * 0.25 / 8) = 8: 64 slots for 256
    assert planner.min_drop_fraction(layout, cfg) == 1 - 64 / 256
    warnings = planner.warnings_for(cfg, mesh, layout, planner.StepBounds(1, 0, 0, 0))
    assert warnings == ["capacity factor 0.25 drops most tokens' assignments: at least 75% even with perfectly "
                        "balanced routing"]


def test_warnings_for_a_mesh_and_batch_that_the_trainer_refuses():
    cfg = load_config("tiny", ["model.num_layers=1", "moe.num_experts=6", "data.global_batch_size=4"])
    mesh = planner.Mesh(2, 4)
    layout = planner.chip_layout(cfg, mesh)
    assert planner.warnings_for(cfg, mesh, layout, planner.StepBounds(0, 1, 0, 0)) == [
        "6 experts do not divide over the expert axis of 4: the trainer refuses this mesh",
        "batch too small: 4 rows for 8 chips leaves 4 chips without data (and the trainer refuses it)",
        "64 tokens per chip are too few to keep the chips busy: the step is bound by HBM bandwidth, not compute; "
        "a larger batch would fill them",
    ]
    fsdp = load_config("tiny", ["train.fsdp=true"])
    assert planner.warnings_for(fsdp, planner.Mesh(8, 1, 2), planner.chip_layout(fsdp, planner.Mesh(8, 1, 2)),
                                planner.StepBounds(0, 0, 0, 1)) == [
        "expert axis of 1: no expert parallelism for 8 experts; every chip gathers all of them (FSDP) for every step",
        "the step is bound by DCN between slices: gradient reductions and FSDP's weight gathers cross the 2 slices "
        "every step",
    ]


# ----------------------------------------------------------------------------- memory


def test_param_bytes_per_chip_by_hand():
    # Everything but the experts is replicated: embedding, head, attention, routers and norms; the
    # 2 x 8 experts of 3 x 64 x 64 split 8 ways over the expert axis. float32.
    replicated = 2 * 256 * 64 + 2 * (4 * 64 * 64 + 64 * 8 + 2 * 64) + 64
    experts = 2 * 8 * 3 * 64 * 64 // 8
    assert planner.param_bytes_per_chip(inventory("tiny"), planner.Mesh(1, 8), False) == 4 * (replicated + experts)
    assert planner.param_bytes_per_chip(inventory("tiny"), planner.Mesh(8, 1), False) == 4 * 263_488


def test_shard_ways_follow_the_trainers_rules():
    mesh = (("data", 4), ("expert", 2))
    assert shard_ways(("expert", "embed", "mlp"), (8, 64, 32), mesh, False) == 2
    assert shard_ways(("expert", "embed", "mlp"), (8, 64, 32), mesh, True) == 8  # FSDP: embed over data
    assert shard_ways(("embed", "mlp"), (6, 32), mesh, True) == 1  # 6 does not divide 4 ways: stays whole
    assert shard_ways(("norm",), (64,), mesh, True) == 1


def test_activation_bytes_by_hand():
    cfg = load_config("tiny")  # float32: c = 4; 128 tokens per chip, 2 rows of 64
    layout = planner.chip_layout(cfg, planner.Mesh(1, 8))
    # residual pair 128*64*(4+4); q,k,v and rotated q,k 128*16*(12+8)*4; softmax 2*4*64*64*(4+4); out 128*128*4
    assert planner.attention_activation_bytes(cfg, layout) == 65536 + 163840 + 262144 + 65536 == 557_056
    # residual pair; router 2*128*8*4; 512 slots x (4 x 64 + 3 x 64) x 4; combine 2*128*64*4
    assert planner.ffn_activation_bytes(cfg, layout, moe=True) == 65536 + 8192 + 917504 + 65536 == 1_056_768
    assert planner.ffn_activation_bytes(cfg, layout, moe=False) == 65536 + 3 * 128 * 128 * 4 + 32768
    assert planner.head_activation_bytes(cfg, layout) == 65536 + 3 * 128 * 256 * 4 == 458_752
    block = 557_056 + 1_056_768
    # The later of two peaks: the head's forward (what the blocks keep, the head's three logits arrays) and the
    # layers' backward (what they keep, one block recomputed under remat, the head's log-softmax kept).
    assert planner.activation_bytes(cfg, layout, remat=False) == 2 * block + 458_752 == 3_686_400
    assert planner.activation_bytes(cfg, layout, remat=True) == 2 * 128 * 64 * 4 + block + 128 * 256 * 4
    # beside a megabyte of gradients the head's forward peak, which comes before any, is 1 MB lower
    assert planner.activation_bytes(cfg, layout, remat=False, grads=2**20) == 2 * block + 128 * 256 * 4


def test_memory_per_chip_adds_grads_and_adam_moments():
    cfg = load_config("tiny")
    params = inventory("tiny")
    memory = planner.memory_per_chip(params, cfg, planner.Mesh(1, 8), V5E_8)
    # float32, nothing sharded over 1 x 8 but the experts' stacks: a scanned stack's gradient twice (the
    # backward scan's zero-filled buffer and its own), the others' once
    stacked = sum(p.nbytes // (8 if "expert" in p.axes else 1) for p in params
                  if p.axes[:1] == ("layers",) and p.shape[0] > 1)
    assert (memory.params, memory.grads, memory.optimizer) == (365_824, 365_824 + stacked, 2 * 365_824)
    layout = planner.chip_layout(cfg, planner.Mesh(1, 8))
    assert memory.activations == planner.activation_bytes(cfg, layout, cfg.model.remat, memory.grads)
    assert memory.total == 4 * 365_824 + stacked + memory.activations and memory.hbm == 16 * 2**30
    assert memory.fits and memory.shortfall == 0


def _xla_peak_bytes(*overrides: str) -> tuple[int, int]:
    """(XLA's peak bytes per device for the compiled train step, the planner's estimate), tiny on the 8 fake
    devices as on a v5litepod-8: arguments + outputs - donated (aliased) + temporaries."""
    from trainer.step import compile_step

    trainer, plan = tiny_trainer(*overrides)
    stats = compile_step(trainer).memory_analysis()
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)
    return peak, plan.memory.total


def test_memory_estimate_within_25_percent_of_xla():
    peak, estimate = _xla_peak_bytes()
    assert abs(estimate - peak) <= 0.25 * peak, (estimate, peak)


def test_memory_estimate_with_remat_within_25_percent_of_xla():
    """XLA:CPU schedules the recomputed forward early, so its peak barely drops with remat; the estimate
    (what a memory-aware schedule keeps) is still within 25% for tiny's two layers."""
    peak, estimate = _xla_peak_bytes("model.remat=true")
    assert abs(estimate - peak) <= 0.25 * peak, (estimate, peak)


# ----------------------------------------------------------------------------- speed


def test_all_to_all_bytes_by_hand():
    cfg = load_config("tiny")
    layout = planner.chip_layout(cfg, planner.Mesh(1, 8))
    # 2 MoE layers x 4 exchanges x 512 rows x 64 x 4 bytes, of which 7/8 leave the chip
    assert planner.all_to_all_bytes(cfg, layout, planner.Mesh(1, 8)) == 2 * 4 * 512 * 64 * 4 * 7 / 8
    remat = load_config("tiny", ["model.remat=true"])
    assert planner.all_to_all_bytes(remat, layout, planner.Mesh(1, 8)) == 2 * 6 * 512 * 64 * 4 * 7 / 8
    assert planner.all_to_all_bytes(cfg, layout, planner.Mesh(8, 1)) == 0


def test_collective_bytes_by_hand():
    cfg = load_config("tiny", ["train.fsdp=true"])
    params = [ParamInfo("w", (64, 128), "float32", ("embed", "mlp")), ParamInfo("s", (64,), "float32", ("norm",))]
    mesh = planner.Mesh(data=4, expert=2, slices=2)  # 2 data ways per slice, 2 slices
    ici, dcn = planner.collective_bytes(params, cfg, mesh)
    # w: FSDP over 4 data ways; gathered 8192 floats, twice (fwd, bwd) + one reduce-scatter = 3 x 32 KiB.
    # s: replicated, gradient of 256 bytes all-reduced: 2 x 256 x (1/2) on ICI, 2 x 256 x (1/2) / 2 on DCN.
    # Neither is split over expert (2 ways), which splits the batch: each gradient's data shard (w's a quarter,
    # 8 KiB; s's whole) all-reduced over it too, 2 x shard x (1/2), on ICI.
    assert ici == 3 * 32768 * (1 / 2) + 2 * 256 * (1 / 2) + 2 * 8192 * (1 / 2) + 2 * 256 * (1 / 2)
    assert dcn == 3 * 32768 * (1 / 4) + 2 * 256 * (1 / 2) / 2


def test_hardware_flops_add_capacity_padding_and_remat():
    cfg = load_config("tiny")
    counts = planner.count_params(inventory("tiny"), cfg)
    layout = planner.chip_layout(cfg, planner.Mesh(1, 8))
    tokens = 16 * 64
    routed = 6 * (2 * 3 * 64 * 64) * 2 * tokens  # 2 layers of experts, top 2
    padding = routed * (512 / 256 - 1)  # capacity factor 2: twice the slots the tokens need
    expected = (694_272 * tokens + padding) / 8
    assert planner.hardware_flops_per_chip(counts, cfg, layout, 8) == pytest.approx(expected)
    remat = load_config("tiny", ["model.remat=true"])
    assert planner.hardware_flops_per_chip(counts, remat, layout, 8) == pytest.approx(expected * 4 / 3)


def test_step_bounds_and_mfu_by_hand():
    traffic = planner.Traffic(hbm=819e9, all_to_all=0, ici=100e9, dcn=3.125e9)
    bounds = planner.step_bounds(2 * 197e12, traffic, V5E_64)
    assert (bounds.compute_s, bounds.hbm_s, bounds.ici_s, bounds.dcn_s) == (2.0, 1.0, 0.5, 1.0)
    assert (bounds.lower_bound_s, bounds.bound_by) == (2.0, "compute")
    assert planner.mfu_ceiling(64 * 197e12, 2.0, 64, V5E_64) == 0.5


# ----------------------------------------------------------------------------- cost


def test_cost_follows_the_catalogue():
    c = planner.cost(64, "on-demand", steps=100, step_s=36.0)
    assert c.per_hour == 64 * catalogue.price_per_chip_hour("on-demand") == pytest.approx(76.8)
    assert c.per_hour_spot == 64 * catalogue.price_per_chip_hour("spot")
    assert c.run_s == 3600 and c.run_usd(c.per_hour) == c.per_hour
    multislice = planner.cost(4 * 64, "spot", steps=1, step_s=1.0)
    assert multislice.per_hour == 256 * catalogue.price_per_chip_hour("spot")


def test_targets_from_tpu_vm_and_vertex_configs():
    assert planner.target_of(load_run_config(EXAMPLE)) == planner.Hardware(V5E_64, 1, "spot")
    vertex = load_run_config(ROOT / "examples" / "vertex.yaml")
    assert planner.target_of(vertex) == planner.Hardware(V5E_64, 1, "on-demand")  # STANDARD bills on demand
    assert planner.target_of(vertex, "v5litepod-16", 2) == planner.Hardware(catalogue.accelerator("v5litepod-16"), 2,
                                                                           "on-demand")


# ----------------------------------------------------------------------------- whole plans


def test_the_v5e_64_plan_is_golden(workdir):
    plan = planner.plan_for(load_run_config(EXAMPLE))
    text = "\n".join(planner.plan_lines(plan)) + "\n"
    document = json.dumps(planner.plan_document(plan), indent=2) + "\n"
    for name, got in (("plan.v5e-64.txt", text), ("plan.v5e-64.json", document)):
        golden = GOLDENS / f"{name}.golden"
        if UPDATE:
            golden.write_text(got)
        assert got == golden.read_text(), f"{name} differs from its golden; see this file's docstring"
    code, out, err = moe("plan", "-c", str(EXAMPLE))
    assert (code, out, err) == (0, text, "")


def test_v5e_64_fits_and_is_priced_from_the_catalogue(workdir):
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE))
    doc = json.loads(out)
    assert code == 0 and doc["command"] == "plan" and doc["fits"] is True and doc["result"] == "ok"
    assert doc["params_total"] == 13_624_215_552
    assert doc["cost_per_hour_on_demand_usd"] == 64 * catalogue.price_per_chip_hour("on-demand")
    assert doc["cost_per_hour_usd"] == doc["cost_per_hour_spot_usd"] == 64 * catalogue.price_per_chip_hour("spot")
    assert doc["run_cost_lower_bound_usd"] == pytest.approx(
        doc["cost_per_hour_usd"] * doc["steps"] * doc["step_time_lower_bound_s"] / 3600)
    assert doc["memory_per_chip_bytes"] == sum(doc[f"memory_{part}_per_chip_bytes"]
                                               for part in ("params", "grads", "optimizer", "activations", "gathered"))


def one_slice(path: Path, tmp_path: Path) -> Path:
    """A copy of an example on one slice, without trainer.mesh (the plan chooses it)."""
    doc = yaml.safe_load(path.read_text())
    doc["slice"]["count"] = 1
    del doc["trainer"]["mesh"]
    copy = tmp_path / f"one-slice.{path.name}"
    copy.write_text(yaml.safe_dump(doc))
    return copy


def test_a_1_2t_moe_does_not_fit_a_v5e_64_and_says_how_many_slices_would(workdir, tmp_path):
    code, out, err = moe("--output", "json", "plan", "-c", str(one_slice(HUGE, tmp_path)))
    doc = json.loads(out)
    assert code == 0 and doc["fits"] is False and err.startswith("DOES NOT FIT: moe-1.2t")
    assert 1.15e12 < doc["params_total"] < 1.25e12
    assert doc["params_total"] * 2 > 64 * 16 * 2**30  # bfloat16 weights alone exceed the slice's HBM
    assert doc["memory_shortfall_per_chip_bytes"] == doc["memory_per_chip_bytes"] - 16 * 2**30 > 0
    assert doc["advice"] == {"smallest_slice": None, "slices_needed": 64, "slices_needed_accelerator": "v5litepod-64"}
    cfg, params = load_config("moe-1.2t"), inventory("moe-1.2t")
    assert planner.fits_on(params, cfg, V5E_64, 64) and not planner.fits_on(params, cfg, V5E_64, 63)


def test_verdict_is_the_one_line_run_prints(tmp_path):
    fits = planner.verdict(load_run_config(EXAMPLE))
    assert fits.fits and fits.shortfall_bytes == 0 and fits.line.startswith("FITS: v5e-64 ")
    assert "\n" not in fits.line
    assert planner.verdict(load_run_config(HUGE)).fits  # the example itself: 64 slices
    huge = planner.verdict(load_run_config(one_slice(HUGE, tmp_path)))
    assert not huge.fits and huge.shortfall_bytes > 0
    assert huge.line.startswith("DOES NOT FIT: moe-1.2t ") and huge.line.endswith("fits on 64 x v5litepod-64")


def test_the_plan_says_where_its_mesh_came_from(workdir, tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    del doc["trainer"]["mesh"]
    unset = tmp_path / "unset.yaml"
    unset.write_text(yaml.safe_dump(doc))
    chosen = planner.plan_for(load_run_config(unset)).mesh.text()  # the plan's own choice for 64 chips
    for args, source, says in (
            (["-c", str(EXAMPLE)], "trainer.mesh", "given in trainer.mesh: the trainer is started with --mesh "
                                                   "data=8,expert=8"),
            (["-c", str(unset)], "plan", "chosen by the plan (trainer.mesh is not set): the trainer is started "
                                         f"with --mesh {chosen}"),
            (["-c", str(unset), "--accelerator", "v5litepod-16"], "plan", "chosen by the plan for this model and "
                                                                          "target"),
            (["-c", str(EXAMPLE), "--mesh", "data=4,expert=16"], "--mesh", "given with --mesh (a what-if")):
        code, out, _ = moe("plan", *args)
        assert code == 0 and says in out, (args, out)
        code, out, _ = moe("--output", "json", "plan", *args)
        mesh = json.loads(out)["mesh"]
        assert code == 0 and mesh["source"] == source and says in mesh["source_text"], args


def test_command_line_overrides_and_bad_input(workdir):
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--model", "tiny",
                       "--accelerator", "v5litepod-8", "--mesh", "data=2,expert=4")
    doc = json.loads(out)
    assert code == 0 and doc["model"] == "tiny" and doc["target"]["chips"] == 8
    assert (doc["mesh"]["data"], doc["mesh"]["expert"]) == (2, 4)
    code, out, err = moe("plan", "-c", str(EXAMPLE), "--mesh", "data=3")
    assert (code, out) == (2, "") and "covers 3 chips" in err and "Traceback" not in err
    code, _, err = moe("plan", "-c", str(EXAMPLE), "--model", "tinny")
    assert code == 2 and "did you mean 'tiny'" in err
    code, _, err = moe("plan", "-c", str(EXAMPLE), "--slices", "0")
    assert code == 2 and "Traceback" not in err


def test_plan_lives_in_help_without_importing_jax():
    probe = ("import sys; from provision.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "import provision.cli.plan_cmd, provision.planner\n"
             "print('jax' in sys.modules, 'trainer.config' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "  plan " in result.stdout and result.stdout.strip().endswith("False False")
