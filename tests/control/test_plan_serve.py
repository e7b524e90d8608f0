"""`moe-tpu plan --serve`: the serving decode step per chip at bf16, int8 and int4. Pure arithmetic over the
trainer's parameter inventory; nothing is compiled. That the weight bytes are the serving engine's own,
from its arrays' shardings: tests/trainer/test_serve_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke as moe

from provision import catalogue, planner
from trainer.config import load_config
from trainer.params import param_inventory

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"
HUGE = ROOT / "examples" / "moe-1.2t.yaml"


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


# ----------------------------------------------------------------------------- a published roofline

# "How to Scale Your Model" (Austin et al., Google DeepMind, 2025), Part 8 "Serving LLaMA 3-70B on TPUs",
# https://jax-ml.github.io/scaling-book/applied-inference/ (source: github.com/jax-ml/scaling-book,
# applied-inference.md). Its v5e: 1.97e14 bf16 FLOP/s, 8.2e11 bytes/s of HBM, "16GB" (16e9 bytes) of HBM;
# communication left out of its latencies ("assumes no communication"), so its ICI is taken as unbounded
# here. LLaMA 3-70B: 80 layers, d_model 8192, d_ff 28672, 64 heads, 8 KV heads of 128, vocab 128256.
BOOK_V5E = dataclasses.replace(catalogue.accelerator("v5litepod-16"), hbm_gbps_per_chip=820.0,
                               hbm_gib_per_chip=16e9 / 2**30, ici_gbps_per_chip=math.inf)
BOOK_CHIPS = 16  # a 4x4, the model and its KV caches fully sharded over it
# Section "What's the LLaMA Serving Story?": "KV cache size per token in int8 = 2 * K * H * L = ... 160kiB",
# and the table's "KV size / token (bytes)" for bf16, 324kB.
BOOK_KV_INT8_BYTES_PER_TOKEN = 2 * 8 * 128 * 80
BOOK_KV_BF16_BYTES_PER_TOKEN = 324e3
# Same table, bf16 row, at 8k context on "4x4 = 16 chips": "num KV caches @ 8k" 43; next question: at the
# largest batch that fits, "19ms / step"; and "QPS / chip" 0.27 for bfloat16 at a median of 512 decoded
# tokens per query, i.e. 0.27 x 512 tokens/s per chip.
BOOK_BF16_LARGEST_BATCH, BOOK_BF16_STEP_S, BOOK_BF16_TOKENS_PER_S_PER_CHIP = 43, 0.019, 0.27 * 512
# Section "Visualizing the Latency Throughput Tradeoff" (int8 weights on a 4x4, 16-way): "our latency can
# range anywhere from 5.5ms with low batch size".
BOOK_INT8_BATCH_1_STEP_S = 0.0055
# "FFW blocks are compute bound when B > 240" (bf16 weights), 120 with int8 weights and bf16 FLOPs.
BOOK_CRITICAL_BATCH = {"bf16": 240, "int8": 120}


@pytest.fixture(scope="module")
def llama():
    """LLaMA 3-70B's shape as a trainer config, its inventory from the trainer's own model. FSDP over
    16 data ways splits every weight 16 ways: the book's "fully sharded" layout."""
    cfg = load_config("tiny", ["model.vocab_size=128256", "model.d_model=8192", "model.num_layers=80",
                               "model.num_heads=64", "model.num_kv_heads=8", "model.d_ff=28672",
                               "model.moe_every=0", "train.fsdp=true"])
    return cfg, param_inventory(cfg)


def book_serving(llama, precision: str, max_len: int) -> planner.Serving:
    cfg, params = llama
    return planner.serving(params, cfg, planner.Mesh(data=BOOK_CHIPS, expert=1), BOOK_V5E, precision,
                           max_len=max_len, kv=planner.KvLayout(hold_ways=BOOK_CHIPS, read_ways=BOOK_CHIPS),
                           slot_multiple=1)  # its batch is any number of sequences


def near(ours: float, theirs: float, within: float = 0.05) -> bool:
    return abs(ours / theirs - 1) <= within


def test_kv_cache_bytes_per_token_match_the_book(llama):
    cfg, _ = llama
    # int8 adds the engine's float32 scale per position and KV head (3% here).
    assert near(planner.kv_bytes_per_token(cfg, "int8"), BOOK_KV_INT8_BYTES_PER_TOKEN)
    assert near(planner.kv_bytes_per_token(cfg, "bf16"), BOOK_KV_BF16_BYTES_PER_TOKEN)


def test_llama_70b_bf16_on_a_4x4_at_8k_reproduces_the_book(llama):
    s = book_serving(llama, "bf16", 8192)
    largest = s.largest_batch()
    step = planner.decode_step(s, largest)
    assert near(largest, BOOK_BF16_LARGEST_BATCH)
    assert step.bound_by == "HBM" and near(step.lower_bound_s, BOOK_BF16_STEP_S)
    assert near(step.tokens_per_s_per_chip, BOOK_BF16_TOKENS_PER_S_PER_CHIP)
    assert s.fits(largest) and not s.fits(largest + 1)


def test_llama_70b_int8_latency_floor_and_critical_batches_match_the_book(llama):
    assert near(planner.decode_step(book_serving(llama, "int8", 8192), 1).lower_bound_s, BOOK_INT8_BATCH_1_STEP_S)
    for precision, batch in BOOK_CRITICAL_BATCH.items():  # where compute catches up with the weights' reads
        step = planner.decode_step(book_serving(llama, precision, 1), batch)
        assert near(step.compute_s, step.hbm_s)


# ----------------------------------------------------------------------------- the touched experts


def test_touched_experts_match_a_sampled_router():
    """E=64, k=2: each token picks 2 distinct experts uniformly; the experts touched by the first B tokens,
    averaged over trials, against E(1-(1-k/E)^B) for every B from 1 to 256."""
    experts, top_k, batch, trials = 64, 2, 256, 400
    rng = np.random.default_rng(0)
    picks_TxBxK = rng.random((trials, batch, experts)).argpartition(top_k, axis=-1)[..., :top_k]
    chosen_TxBxE = np.zeros((trials, batch, experts), bool)
    np.put_along_axis(chosen_TxBxE, picks_TxBxK, True, axis=-1)
    touched_B = np.logical_or.accumulate(chosen_TxBxE, axis=1).sum(-1).mean(0)
    formula_B = np.array([planner.experts_touched(experts, top_k, b) for b in range(1, batch + 1)])
    assert np.all(np.abs(touched_B / formula_B - 1) <= 0.02), np.max(np.abs(touched_B / formula_B - 1))
    assert touched_B[0] == 2 and formula_B[-1] > 63.9


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def huge_plan():
    """`plan --serve` of the 1.2T example: its serve section is one replica of 64 v5e chips."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(HUGE.parent)
        code, out, err = moe("--output", "json", "plan", "-c", str(HUGE), "--serve", "--decode-step-ms", "22")
    assert code == 0, err
    return json.loads(out)["serve"], err


def test_the_1_2t_verdict_says_which_precisions_fit_and_which_bounds_22_ms_meets(huge_plan):
    doc, err = huge_plan
    assert doc["chips"] == 64 and doc["hardware_source"] == "serve" and doc["mesh"]["source"] == "serving"
    fits = {name: row["fits"] for name, row in doc["precisions"].items()}
    assert fits == {"bf16": False, "int8": False, "int4": True}
    int4 = doc["precisions"]["int4"]
    assert int4["memory_bytes_per_chip"] <= int4["hbm_usable_bytes_per_chip"] < doc["precisions"]["int8"][
        "memory_bytes_per_chip"]
    assert int4["decode"]["step_bound_by"] == "HBM" and int4["largest_batch_slots"] >= doc["batch_slots"]
    # 22 ms is slower than every bound at int4, faster than the HBM bound at bf16 and int8.
    assert doc["claim"]["reachable"] == ["int4"]
    assert doc["claim"]["meets"]["int4"] == {"HBM": True, "compute": True, "ICI": True}
    assert doc["claim"]["meets"]["int8"]["HBM"] is False and doc["claim"]["meets"]["bf16"]["HBM"] is False
    # Only int4 fits, and the engine serves int4 weights (trainer/serve/memory.py's list): the verdict serves it.
    assert doc["verdict"].startswith("SERVES at int4 (not bf16, int8): moe-1.2t"), doc["verdict"]
    assert "engine" not in doc["verdict"]
    assert "reachable at int4 only" in doc["verdict"] and doc["verdict"] in err
    step = int4["decode"]
    cost = doc["price_per_chip_hour_usd"] / (step["tokens_per_s_per_chip"] * 3600) * 1e6
    assert step["cost_per_million_tokens_usd"] == pytest.approx(cost)


def test_a_mesh_for_the_serving_replica_and_one_that_is_not(huge_plan):
    code, out, _ = moe("--output", "json", "plan", "-c", str(HUGE), "--serve", "--mesh", "expert=8,model=8")
    doc = json.loads(out)
    # --mesh is the replica's: the training plan keeps the config's trainer.mesh on its 4,096 chips.
    assert code == 0 and doc["mesh"]["trainer_flag"] == "--mesh data=64,expert=64"
    assert doc["serve"]["mesh"]["source"] == "--mesh"
    assert doc["serve"]["mesh"]["server_flag"] == "--mesh data=1,expert=8,model=8"
    code, out, err = moe("plan", "-c", str(HUGE), "--serve", "--mesh", "data=64,expert=64")  # the training mesh
    assert (code, out) == (2, "") and "covers 4096 chips, but the serving replica has 64" in err


def test_the_kv_cache_is_the_engines():
    from trainer.serve.kvcache import KVCache

    cfg = load_config("tiny")
    m = cfg.model
    for precision, dtype in (("bf16", "bfloat16"), ("int8", "int8")):
        assert planner.kv_bytes_per_token(cfg, precision) == KVCache.nbytes(m.num_layers, 1, 1, m.kv_heads,
                                                                             m.head_size, dtype)


def test_latent_attentions_kv_bytes_and_decode_flops_are_the_engines():
    """deepseek-v3-671b (not built: the cache's bytes from its config): the engine's latent cache keeps
    (kv_lora_rank + qk_rope_head_dim) values a token and layer (int8: a float32 scale for each of the two),
    which is what the planner counts, split by position over `model` as the engine splits it; the decode
    step's attention is absorbed (scores over the latent and the rotary key, the weighted sum over the latent)."""
    from provision.planner.serve_report import latent_capacity_document, latent_capacity_rows
    from provision.planner.serving import attention_flops_per_position, latent_capacity
    from trainer.serve.latentcache import CacheLayout

    cfg = load_config("deepseek-v3-671b")
    layout = CacheLayout.of(cfg.model)
    assert planner.kv_bytes_per_token(cfg, "bf16") == (512 + 64) * 61 * 2 == layout.nbytes(1, 1, "bfloat16")
    assert planner.kv_bytes_per_token(cfg, "int8") == (512 + 64 + 8) * 61 == layout.nbytes(1, 1, "int8")
    # The engine splits the latents' positions over `model` (where it divides max_len): a quarter on each chip.
    assert planner.engine_kv_layout(cfg, planner.Mesh(1, 64, model=4), 2048).hold_ways == 4
    assert planner.engine_kv_layout(cfg, planner.Mesh(1, 64, model=3), 2048).hold_ways == 1
    assert attention_flops_per_position(cfg) == 2 * 128 * (2 * 512 + 64)
    s = planner.serving(param_inventory(cfg), cfg, planner.Mesh(1, 64, model=4), catalogue.accelerator("v5litepod-256"),
                        "int8", max_len=2048, headroom=0.1)
    step = planner.decode_step(s, 8)
    assert step.flops * 256 == pytest.approx(2 * s.matmul_params * 8 + 8 * 2048 * 61 * 2 * 128 * (2 * 512 + 64))
    cap = latent_capacity(s)
    assert cap.leftover == s.usable() - s.weights.held > 0 and cap.latent_per_token == (512 + 64 + 8) * 61
    assert cap.uncompressed_per_token == 61 * 128 * ((128 + 64 + 128) + 2 * 4)
    assert cap.latent_sequences == int(cap.leftover // (2048 * cap.latent_per_token / 4)) > 200
    assert cap.uncompressed_sequences == int(cap.leftover // (2048 * cap.uncompressed_per_token / 4)) > 0
    assert cap.latent_sequences >= 70 * cap.uncompressed_sequences  # a 71st of the bytes, both split 4 ways
    row = planner.Row(serving=s, slots=8, step=step, step_batch_1=step, largest_batch=0, step_largest=None)
    assert latent_capacity_document(row)["latent_cache"] == {
        "context_tokens": 2048, "leftover_hbm_bytes_per_chip": cap.leftover,
        "latent_bytes_per_token": cap.latent_per_token, "uncompressed_bytes_per_token": cap.uncompressed_per_token,
        "latent_cache_slots": cap.latent_sequences, "uncompressed_cache_slots": cap.uncompressed_sequences}
    (label, value, note), = latent_capacity_rows(row)
    assert (label, value) == ("sequences of 2,048 tokens", str(cap.latent_sequences))
    assert f"an uncompressed cache (2.44 MiB a token) would hold {cap.uncompressed_sequences}" in note


UNITS = {"bytes", "s", "usd", "tokens", "slots", "experts", "chips", "flops", "ways", "hosts"}


def test_every_serving_figure_carries_its_unit(huge_plan):
    doc, _ = huge_plan

    def figures(node, path=()):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from figures(value, (*path, key))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield (*path, key)

    found = list(figures(doc))
    assert len(found) > 60
    assert [path for path in found if not UNITS & set(path[-1].split("_"))] == []


def test_plan_serve_on_the_plans_own_target_and_mesh(workdir):
    """No serve section: the plan's target and mesh (here --mesh), the engine's default slots and length."""
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--serve", "--mesh", "expert=8,model=4")
    doc = json.loads(out)
    serve = doc["serve"]
    assert code == 0 and serve["chips"] == 64 and serve["mesh"]["source"] == "--mesh"
    assert serve["mesh"]["server_flag"] == "--mesh data=2,expert=8,model=4"
    bf16 = serve["precisions"]["bf16"]
    one = bf16["decode_batch_1"]
    assert one["experts_touched_per_layer"] == 2 and 0 < one["weight_read_bytes_per_chip"] < bf16[
        "weights_bytes_per_chip"]
    assert one["step_time_hbm_s"] == pytest.approx(
        (one["weight_read_bytes_per_chip"] + one["kv_read_bytes_per_chip"]) / 819e9)
    code, out, _ = moe("--output", "json", "plan", "-c", str(EXAMPLE), "--mesh", "expert=8,model=4")
    assert code == 0 and "serve" not in json.loads(out)
    code, out, _ = moe("plan", "-c", str(EXAMPLE), "--serve", "--mesh", "expert=8,model=4")
    assert code == 0 and "serving   one replica: 64 chips" in out and "largest batch that fits" in out
    code, _, err = moe("plan", "-c", str(EXAMPLE), "--decode-step-ms", "22")
    assert code == 2 and "--serve" in err


def test_plan_serve_for_another_slice_picks_its_own_meshes(workdir):
    """--accelerator v5litepod-256 on a config whose trainer.mesh covers its 64 chips: it was refused ("covers 64
    chips, but the target has 256"); the config's mesh is the config's slice's, and each plan picks its own for
    the slice given. A --mesh given for it is still held to its chips."""
    args = ["plan", "-c", str(EXAMPLE), "--accelerator", "v5litepod-256"]
    code, out, err = moe("--output", "json", *args, "--serve")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["mesh"]["source"] == "plan" and "trainer.mesh data=8,expert=8 covers the config's own" in doc[
        "mesh"]["source_text"]
    assert doc["serve"]["chips"] == 256 and doc["serve"]["mesh"]["source"] == "serving"
    serving = doc["serve"]["mesh"]
    assert serving["data_ways"] * serving["expert_ways"] * serving["model_ways"] == 256
    code, _, err = moe(*args, "--mesh", "data=8,expert=8")
    assert code == 2 and "covers 64 chips, but the target has 256" in err


@pytest.mark.parametrize("name, total", [("qwen3-30b-a3b", 30_532_122_624), ("olmoe-1b-7b", 6_919_161_856),
                                         ("deepseek-v2-lite", 15_706_484_224)])
def test_plan_answers_for_the_open_models_named_configs(workdir, name, total):
    """The shapes `hf import` gives the open checkpoints (their counts are transformers' own:
    tests/trainer/test_hf_named.py): plan and plan --serve answer for them on v5e-64."""
    config = EXAMPLE.read_text().replace("config: v5e-64", f"config: {name}")
    config = "\n".join(line for line in config.splitlines()
                       if not line.startswith(("  mesh:", "  overrides:", "    moe.capacity", "    dtype:")))
    (workdir / "run.yaml").write_text(config)
    code, out, err = moe("--output", "json", "plan", "-c", "run.yaml", "--serve")
    doc = json.loads(out)
    assert code == 0, err
    assert doc["params_total"] == total and doc["fits"] is True
    bf16 = doc["serve"]["precisions"]["bf16"]
    assert doc["serve"]["chips"] == 64 and bf16["decode_batch_1"]["step_time_hbm_s"] > 0
    if name == "deepseek-v2-lite":  # latent attention: 512 + 64 values a token and layer, beside the heads' 16 x 320
        assert bf16["kv_cache_bytes_per_token"] == bf16["latent_cache"]["latent_bytes_per_token"] == 576 * 27 * 2
        assert bf16["latent_cache"]["uncompressed_bytes_per_token"] == 16 * 320 * 27 * 2
    else:
        assert "latent_cache" not in bf16


def test_the_planners_quantized_weights_are_the_engines_start_up_plan():
    """int8 (a scale per output channel) and int4 (packed, a scale per group of input values): the bytes a
    chip holds in `plan --serve` are what the server's start-up memory check counts on the same mesh."""
    import jax

    from trainer import sharding
    from trainer.serve.memory import memory_plan
    from trainer.serve.weights import build_serving_model

    cfg = load_config("tiny", ["model.num_layers=1"])
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 8}, jax.devices()[:8]))
    params = param_inventory(cfg)
    held = {p: planner.chip_weights(params, cfg, planner.Mesh(1, 8), p).held for p in ("bf16", "int8", "int4")}
    assert held["int8"] == memory_plan(model, 1, 1, "float32", "int8")["weights"]
    assert held["int4"] == memory_plan(model, 1, 1, "float32", "int4")["weights"]
    assert held["int4"] < 0.6 * held["int8"]
