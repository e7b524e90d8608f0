"""The serving engine with tensor parallelism (a `model` mesh axis): on expert=2,model=4 it returns the
greedy tokens one device returns, and a batch-1 decode step reads fewer weight bytes a device than on
expert=8 alone; `python -m trainer.serve --mesh` takes the axis and refuses meshes the model cannot split."""

import json

import jax
import pytest
from click.testing import CliRunner

from provision import planner
from trainer import sharding
from trainer.config import load_config
from trainer.params import param_inventory
from trainer.serve.cli import serve_command
from trainer.serve.engine import Engine, Request, SamplingParams
from trainer.serve.memory import memory_plan
from trainer.serve.weights import build_serving_model, decode_weight_bytes, init_weights

pytestmark = pytest.mark.compile_bound  # small programs, each compiled once: XLA's optimisations cost more

PROMPTS = ([7, 3, 250, 19, 4], [1, 2, 3], list(range(40, 52)))


def serving_on(shape, weights=None):
    """`tiny` with one block (half the compiling) on a mesh of this shape, with `weights` (another mesh's) laid out on it, or fresh ones."""
    devices = jax.devices()[:shape["data"] * shape["expert"] * shape.get("model", 1)]
    cfg = load_config("tiny", ["model.num_layers=1"])
    model = build_serving_model(cfg, sharding.make_mesh(shape, devices))
    if weights is None:
        return model, init_weights(model)
    return model, jax.device_put(weights, {k: model.shardings[k] for k in weights})


def greedy(model, weights):
    engine = Engine(model, weights, slots=2, max_len=24, chunk=8)
    requests = [engine.submit(Request(list(p), SamplingParams(max_tokens=6))) for p in PROMPTS]
    engine.run()
    greedy.engine = engine
    return [r.output for r in requests]


def test_expert_2_model_4_decodes_as_one_device_and_reads_fewer_weight_bytes_than_expert_8():
    one, weights = serving_on({"data": 1, "expert": 1})
    tp, tp_weights = serving_on({"data": 1, "expert": 2, "model": 4}, weights)
    w_in = tp_weights["params"]["stacks.0.0.ffn.w_in"]  # [1, E, D, F]: experts over `expert`, F over `model`
    assert w_in.sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, "model")
    assert w_in.addressable_shards[0].data.shape == (1, 4, 64, 16)
    assert tp_weights["params"]["stacks.0.0.attn.wq"].sharding.spec[2] == "model"  # heads split too

    expected = greedy(one, weights)
    assert greedy(tp, tp_weights) == expected
    assert [len(o) for o in expected] == [6, 6, 6]
    # The KV cache's heads are split over `model` as attention's are: a quarter of it on each device, as
    # the start-up memory check and `plan --serve` count it.
    cache = greedy.engine.cache  # k and v: [layers, slots, max_len, kv_heads, head_size]
    assert cache.k.sharding.spec[3] == "model" and cache.k.addressable_shards[0].data.shape == (1, 2, 24, 1, 16)
    on_a_device = sum(a.addressable_shards[0].data.nbytes for a in (cache.k, cache.v))
    assert memory_plan(tp, 2, 24, "float32", False)["kv_cache"] == on_a_device == (cache.k.nbytes + cache.v.nbytes) // 4
    assert planner.engine_kv_layout(tp.cfg, planner.Mesh(1, 2, model=4)).hold_ways == 4
    int8 = Engine(tp, tp_weights, slots=2, max_len=24, chunk=8, kv_dtype="int8").cache
    assert int8.k.sharding.spec[3] == int8.k_scale.sharding.spec[3] == "model"

    ep, ep_weights = serving_on({"data": 1, "expert": 8}, weights)
    assert ep_weights["params"]["stacks.0.0.ffn.w_in"].addressable_shards[0].data.shape == (1, 1, 64, 64)
    tp_bytes, ep_bytes = decode_weight_bytes(tp, tp_weights), decode_weight_bytes(ep, ep_weights)
    # By hand, float32: expert=8 reads the embedding and the head, the block's attention, router and
    # norms whole, and its one expert (3 x 64 x 64); expert=2,model=4 a quarter of attention and
    # of each of the top-2 experts (it holds 4 of the 8, each split 4 ways).
    embed = 2 * 256 * 64 * 4
    attention, router_norms, expert = 4 * 64 * 64 * 4, (64 * 8 + 2 * 64) * 4, 3 * 64 * 64 * 4
    assert ep_bytes == embed + attention + router_norms + expert + 64 * 4
    assert tp_bytes == embed + attention // 4 + router_norms + 2 * expert // 4 + 64 * 4
    assert tp_bytes < ep_bytes
    # `moe-tpu plan --serve` predicts both figures from the parameter inventory alone.
    params = param_inventory(tp.cfg)
    assert planner.decode_weight_bytes_per_chip(params, tp.cfg, planner.Mesh(1, 2, model=4)) == tp_bytes
    assert planner.decode_weight_bytes_per_chip(params, ep.cfg, planner.Mesh(1, 8)) == ep_bytes
    assert planner.decode_weight_bytes_per_chip(params, tp.cfg, planner.Mesh(1, 2, model=4), tokens=8) == \
        decode_weight_bytes(tp, tp_weights, tokens=8)
    # A batch of 8 touches E(1-(1-k/E)^8) = 7.2 of the 8 experts: each device reads every expert it holds.
    assert decode_weight_bytes(tp, tp_weights, tokens=8) == (embed + attention // 4 + router_norms
                                                                        + 4 * expert // 4 + 64 * 4)


def test_the_serve_command_takes_a_model_axis_and_refuses_meshes_the_model_cannot_split(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(load_config("tiny").to_dict()))
    cases = [
        ("expert=1,model=8", "model.num_heads (4) must be divisible by the mesh's model axis (8)"),
        ("data=1,expert=2,model=3", "--mesh data=1,expert=2,model=3 needs 6 devices, but there are 8"),
        ("expert=2,tensor=4", "unknown axis 'tensor'"),
        # Accepted: the model is built on the mesh, then the (empty) checkpoint directory is what fails.
        ("expert=2,model=4", "holds no checkpoint"),
    ]
    for mesh, needle in cases:
        result = CliRunner().invoke(serve_command, ["--checkpoint", str(run), "--mesh", mesh])
        assert result.exit_code == 2, (mesh, result.output)
        assert needle in result.output and "Traceback" not in result.output, (mesh, result.output)
    assert "'model': 4" in result.output  # the accepted mesh, as start-up reports it
