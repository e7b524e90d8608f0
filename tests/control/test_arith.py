"""trainer/arith: the arithmetic the planner and the trainer share, jax-free. `plan` and `plan --serve` run
where jax cannot be imported; GPT-OSS's named configs hold the parameters their model cards count; a sliding
layer's KV cache and attention are counted over its window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import invoke as moe

from provision import catalogue, planner
from trainer.arith.counts import attention_flops_per_token, count_params
from trainer.arith.kv import layer_positions, slot_positions
from trainer.arith.params import inventory
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"

# A fresh interpreter in which jax, flax, optax and orbax cannot be imported (as where only the control plane
# is installed), running `moe-tpu plan` and `plan --serve`: their exit codes, their output, what was refused.
WITHOUT_JAX = """
import contextlib, io, json, sys
HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax"}
refused = []
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            refused.append(name)
            raise ImportError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from provision.cli import main
runs = []
for args in (["plan", "-c", sys.argv[1]], ["plan", "-c", sys.argv[1], "--serve"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code
    runs.append([code, out.getvalue()])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
try:
    import jax  # the finder's own check: it refuses, and says so
except ImportError:
    pass
print(json.dumps({"runs": runs, "refused": refused, "loaded": loaded}))
"""


def test_plan_and_plan_serve_run_where_jax_cannot_be_imported():
    done = subprocess.run([sys.executable, "-c", WITHOUT_JAX, str(EXAMPLE)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"NO_COLOR": "1", "PATH": "", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["refused"] == ["jax"] and result["loaded"] == []  # nothing on the way asked for jax
    (plan_code, plan_out), (serve_code, serve_out) = result["runs"]
    assert plan_code == 0 and "FITS: v5e-64" in plan_out
    assert serve_code == 0 and "SERVES at bf16, int8, int4" in serve_out and "int4: FITS" in serve_out


def expected_counts(layers: int, experts: int) -> tuple[int, int]:
    """(total, the weights a token multiplies by) of a GPT-OSS model, from its card's shapes: d 2880, 64 query
    heads and 8 KV heads of 64, biases on q, k, v and o, a sink a head; every layer MoE, top 4, experts of
    width 2880 with a bias on each product, a router with a bias; vocabulary 201,088, untied."""
    d, heads, kv, size, width, vocab, k = 2880, 64, 8, 64, 2880, 201_088, 4
    attention = 2 * d * heads * size + 2 * d * kv * size + heads * size + 2 * kv * size + d + heads
    expert = 3 * d * width + 2 * width + d
    router = d * experts + experts
    norms = 2 * d
    total = layers * (attention + router + experts * expert + norms) + 2 * vocab * d + d
    # matmuls: attention's four projections, the router, k experts, the head (the embedding is a lookup); the
    # q, k and v biases ([heads, size]) and the experts' (a slice an expert) count with them (count_params)
    matmul = layers * (2 * d * heads * size + 2 * d * kv * size + heads * size + 2 * kv * size + d * experts
                       + k * expert) + vocab * d
    return total, matmul


@pytest.mark.parametrize("name, layers, experts, billions, active", [
    ("gpt-oss-20b", 24, 32, 20.9, 3.6), ("gpt-oss-120b", 36, 128, 116.8, 5.1)])
def test_gpt_oss_holds_the_parameters_its_model_card_counts(name, layers, experts, billions, active):
    cfg = load_config(name)
    counts = count_params(inventory(cfg), cfg)
    total, matmul = expected_counts(layers, experts)
    assert (counts.total, counts.matmul_active) == (total, matmul)
    assert (round(total / 1e9, 1), round(matmul / 1e9, 1)) == (billions, active)
    m = cfg.model
    assert (m.d_model, m.num_heads, m.kv_heads, m.head_size, cfg.moe.num_experts, cfg.moe.top_k) == \
        (2880, 64, 8, 64, experts, 4)
    assert m.layer_types == ("sliding", "full") * (layers // 2) and m.sliding_window == 128


def test_a_sliding_layer_holds_and_attends_over_its_window_only():
    cfg = load_config("gpt-oss-20b")
    m = cfg.model
    assert [layer_positions(m, i, 4096) for i in range(3)] == [128, 4096, 128]
    assert layer_positions(m, 0, 100) == 100  # a sequence shorter than the window: all of it
    assert slot_positions(m, 1024) == 12 * 128 + 12 * 1024
    assert slot_positions(load_config("tiny").model, 1024) == 2 * 1024
    # training FLOPs: 12 x positions x heads x head size a layer, a sliding layer's positions its window
    assert attention_flops_per_token(cfg) == 12.0 * (12 * 128 + 12 * cfg.data.seq_len) * 64 * 64
    # serving: K and V of 8 heads of 64 in bf16, 2,048 bytes a layer a position, a sliding layer's 128 at most
    assert planner.kv_bytes_per_slot(cfg, "bf16", 1024) == 2048 * (12 * 128 + 12 * 1024)
    assert planner.kv_bytes_per_slot(cfg, "bf16", 64) == 2048 * 24 * 64
    s = planner.serving(inventory(cfg), cfg, planner.Mesh(1, 8), catalogue.accelerator("v5litepod-8"), "bf16",
                        max_len=1024)
    assert s.kv_cache_bytes(8) == 8 * 2048 * (12 * 128 + 12 * 1024)
    assert planner.decode_step(s, 8).kv_read_bytes == 8 * 2048 * (12 * 128 + 12 * 1024) / 8


def test_plan_serve_answers_for_gpt_oss_120b_on_v5e():
    code, out, err = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--serve", "--model", "gpt-oss-120b",
                         "--accelerator", "v5litepod-16")
    assert code == 0, err
    serve = json.loads(out)["serve"]
    assert (serve["model"], serve["chips"], serve["mesh"]["server_flag"]) == \
        ("gpt-oss-120b", 16, "--mesh data=4,expert=1,model=4")
    rows = serve["precisions"]
    assert sorted(rows) == ["bf16", "int4", "int8"] and all(row["fits"] for row in rows.values())
    # 8 slots x 1,024 positions: 18 full layers' and 18 sliding layers' 128, K and V of 8 heads of 64, the heads
    # split over model=4; int8 and int4 add a float32 scale a head, K and V, a layer and a position
    positions = 18 * 1024 + 18 * 128
    assert rows["bf16"]["kv_cache_bytes_per_chip"] == 8 * positions * 2 * 8 * 64 * 2 / 4
    assert rows["int8"]["kv_cache_bytes_per_chip"] == 8 * positions * 2 * 8 * (64 + 4) / 4
    weights = [rows[p]["memory_bytes_per_chip"] - rows[p]["kv_cache_bytes_per_chip"] for p in ("bf16", "int8", "int4")]
    assert weights == sorted(weights, reverse=True)
    code, text, _ = moe("plan", "-c", str(EXAMPLE), "--serve", "--model", "gpt-oss-120b")
    assert code == 0 and "SERVES at bf16, int8, int4: gpt-oss-120b (116.83B params) on 64 v5e chips" in text
