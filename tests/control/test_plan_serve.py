"""`moe-tpu plan --serve`: the weight bytes a serving decode step at batch 1 reads per chip, on the plan's
mesh. That the figure is the serving engine's own, from its arrays' shardings:
tests/trainer/test_serve_tensor_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import invoke as moe

from provision import catalogue, planner
from trainer.config import load_config
from trainer.params import param_inventory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "v5e-64.yaml"


def test_decode_weight_bytes_follow_the_touched_experts_and_the_model_axis():
    """tiny without FSDP: at batch 1 a layer touches top_k = 2 experts; expert=8 holds one each, whole;
    expert=2,model=4 holds four, each split four ways, and reads the two touched, and a quarter of attention."""
    cfg = load_config("tiny")
    params = param_inventory(cfg)
    whole = planner.decode_weight_bytes_per_chip(params, cfg, planner.Mesh(1, 1))
    expert8 = planner.decode_weight_bytes_per_chip(params, cfg, planner.Mesh(1, 8))
    tp = planner.decode_weight_bytes_per_chip(params, cfg, planner.Mesh(1, 2, model=4))
    expert, attention = 3 * 64 * 64 * 4, 4 * 64 * 64 * 4  # float32, per layer
    assert whole - expert8 == 2 * (2 - 1) * expert  # one device reads both touched experts
    assert expert8 - tp == 2 * (attention * 3 // 4 + expert // 2)
    assert planner.experts_touched(8, 2, 1) == 2 and round(planner.experts_touched(8, 2, 8), 2) == 7.2


def test_plan_serve_reports_the_decode_step_and_leaves_plan_as_it_was(workdir):
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--serve", "--mesh", "expert=8,model=4")
    doc = json.loads(out)
    assert code == 0 and doc["serve"]["decode_batch"] == 1 and doc["serve"]["experts_touched_per_layer"] == 2
    read = doc["serve"]["decode_weight_bytes_per_chip"]
    # Less than the parameters a chip holds: only 2 of a layer's experts are read.
    assert 0 < read < doc["memory_params_per_chip_bytes"]
    hbm = catalogue.accelerator("v5litepod-64").hbm_gbps_per_chip * 1e9
    assert doc["serve"]["decode_step_hbm_bound_s"] == read / hbm
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--mesh", "expert=8,model=4")
    assert code == 0 and "serve" not in json.loads(out)
    code, out, _ = moe("plan", "-c", str(EXAMPLE), "--serve", "--mesh", "expert=8,model=4")
    assert code == 0 and "serving (one decode step at batch 1, weights only)" in out and "weights read per chip" in out
