"""`moe-tpu plan` with a `model` mesh axis (tensor parallelism): memory per chip, the all-reduce bytes over
`model`, the mesh it suggests for few large experts, and the checks of heads and hidden sizes.

The bytes against the compiled training step's all-reduces: tests/trainer/test_tensor_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import invoke as moe

from provision import catalogue, planner
from trainer.config import load_config
from trainer.params import param_inventory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "v5e-64.yaml"
V5E_64 = catalogue.accelerator("v5litepod-64")


def test_param_bytes_per_chip_with_a_model_axis_by_hand():
    """tiny on data=1,expert=2,model=4: attention (4 x 64 x 64 per layer) splits its 4 heads 4 ways, the
    8 experts (3 x 64 x 64 each) go 2 ways over expert and their hidden 4 ways over model; the embedding,
    the head, the routers and the norms stay whole."""
    params = param_inventory(load_config("tiny"))
    per_layer = 4 * 64 * 64 // 4 + 8 * 3 * 64 * 64 // 8 + 64 * 8 + 2 * 64
    assert planner.param_bytes_per_chip(params, planner.Mesh(1, 2, model=4), False) == \
        4 * (2 * per_layer + 2 * 256 * 64 + 64)
    experts = [p for p in params if p.name.endswith(("w_in", "w_gate", "w_out"))]
    assert planner.param_bytes_per_chip(experts, planner.Mesh(4, 2), False) == \
        4 * planner.param_bytes_per_chip(experts, planner.Mesh(1, 2, model=4), False)


def test_tensor_parallel_bytes_by_hand():
    """tiny with a dense layer then an MoE layer, 512 tokens per chip (16 rows over data x expert = 2, 64
    positions), D = 64, float32. Dense: forward 2 x [512, 64] (attention, FFN), backward 1 (q, k, v in one
    product) + 2 (the FFN's two input projections). MoE: forward attention and the float32 expert sum,
    backward 1 + the experts' input gradient + the gates' [512, 2]. With KV heads replicated (2 on
    model=4) attention's projections are three products, reduced one by one: 3 instead of 1."""
    cfg = load_config("tiny", ["model.moe_every=2"])
    layout = planner.chip_layout(cfg, planner.Mesh(1, 2, model=4))
    assert layout.tokens == 512 and layout.model == 4
    rows = 512 * 64 * 4
    assert planner.tensor_parallel_bytes(cfg, layout) == 5 * rows + 4 * rows + 512 * 2 * 4
    remat = load_config("tiny", ["model.moe_every=2", "model.remat=true"])
    assert planner.tensor_parallel_bytes(remat, layout) == 5 * rows + 4 * rows + 512 * 2 * 4 + 4 * rows
    replicated_kv = load_config("tiny", ["model.moe_every=2", "model.num_kv_heads=2"])
    assert planner.tensor_parallel_bytes(replicated_kv, layout) == 7 * rows + 6 * rows + 512 * 2 * 4
    assert planner.tensor_parallel_bytes(cfg, planner.chip_layout(cfg, planner.Mesh(4, 2))) == 0


def test_tokens_per_chip_follow_data_and_expert_not_model():
    cfg = load_config("tiny")
    assert planner.chip_layout(cfg, planner.Mesh(2, 1, model=4)).rows == 8  # 16 rows over 2 token shards
    assert planner.routing_groups(cfg, planner.Mesh(2, 2, model=2)) == 4


def test_plan_splits_few_large_experts_over_model():
    """8 experts of 24,576 hidden on a v5litepod-64 without FSDP: one expert per chip of expert=8 does
    not fit 16 GiB, each split 2 ways neither; split 4 ways it fits, and plan says why."""
    cfg = load_config("v5e-64", ["moe.num_experts=8", "train.fsdp=false", "moe.d_ff=24576",
                                 "data.global_batch_size=64"])
    params = param_inventory(cfg)
    mesh, memory = planner.choose_mesh(params, cfg, V5E_64)
    assert (mesh.data, mesh.expert, mesh.model) == (2, 8, 4) and memory.fits
    assert mesh.reason.startswith("expert=8,model=4: ") and "split 4 ways over model" in mesh.reason
    assert not planner.memory_per_chip(params, cfg, planner.Mesh(8, 8), V5E_64).fits
    assert not planner.memory_per_chip(params, cfg, planner.Mesh(4, 8, model=2), V5E_64).fits
    # With FSDP the experts are sharded over data already: no model axis is needed, none is suggested.
    assert planner.choose_mesh(param_inventory(load_config("v5e-64")), load_config("v5e-64"), V5E_64)[0].model == 1


def test_plan_reports_a_model_axis(workdir):
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--mesh", "expert=8,model=4")
    doc = json.loads(out)
    assert code == 0 and (doc["mesh"]["data"], doc["mesh"]["expert"], doc["mesh"]["model"]) == (2, 8, 4)
    assert doc["mesh"]["trainer_flag"] == "--mesh data=2,expert=8,model=4"
    assert 0 < doc["tensor_parallel_bytes_per_step_per_chip"] < doc["ici_bytes_per_step_per_chip"]
    code, out, _ = moe("plan", "-c", str(EXAMPLE), "--mesh", "expert=8,model=4")
    assert code == 0 and "mesh      data=2,expert=8,model=4" in out and "tensor-parallel" in out
    code, out, err = moe("plan", "-c", str(EXAMPLE), "--mesh", "expert=2,model=32")
    assert code == 0 and "model.num_heads (16) must be divisible by the mesh's model axis (32)" in out
