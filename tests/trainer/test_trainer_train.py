"""The train loop in-process: it learns (synthetic floor, byte text), the schedule, multi-host detection."""

import json
import math
import pathlib

import jax
import numpy as np
import pytest

from trainer import distributed, sharding
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer.data import DataIterator, make_source
from trainer.metrics import Reporter
from trainer.train import RunSpec, build_trainer, global_batch, lr_schedule, run

ROOT = pathlib.Path(__file__).resolve().parents[2]


def train(tmp_path, steps, overrides=(), **spec):
    """Runs the loop on one device; returns the metric rows."""
    metrics = tmp_path / "metrics.jsonl"
    reporter = Reporter(str(metrics))
    try:
        result = run(RunSpec(config=load_config("tiny", list(overrides)), steps=steps, num_devices=1,
                             mesh_shape={"data": 1, "expert": 1}, **spec), reporter)
    finally:
        reporter.close()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert result.step == steps and [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows


def test_tiny_approaches_the_entropy_floor_of_the_markov_source(tmp_path):
    rows = train(tmp_path, 120)
    floor = rows[-1]["entropy_floor"]
    final = np.mean([r["loss"] for r in rows[-10:]])
    assert rows[0]["loss"] > floor + 3
    assert floor - 0.1 < final < floor + 0.15, (final, floor)
    keys = {"step", "loss", "aux_loss", "z_loss", "drop_fraction", "expert_load", "tokens_per_s",
            "step_time_s", "mfu", "grad_norm", "lr", "entropy_floor"}
    assert keys <= set(rows[-1])
    assert rows[-1]["mfu"] is None  # the CPU's peak is unknown
    assert len(rows[-1]["expert_load"]) == 8 and sum(rows[-1]["expert_load"]) == pytest.approx(1.0)


def test_byte_level_text_loss_falls_well_below_uniform(tmp_path):
    """Also: checkpoints every N steps keep the last K, and --profile-steps writes a trace."""
    out = tmp_path / "out"
    overrides = ["data.source=text", f"data.path={ROOT}/trainer/*.py", "train.checkpoint_every=20",
                 "train.keep_checkpoints=2"]
    rows = train(tmp_path, 60, overrides, output_dir=str(out), profile_steps=(2, 3))
    assert "entropy_floor" not in rows[-1]
    assert np.mean([r["loss"] for r in rows[-5:]]) < math.log(256) - 2.0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["40", "60"]
    assert list((out / "profile").rglob("*.xplane.pb"))
    # The periodic (asynchronous) checkpoint at 40 holds exactly the state that made step 41's loss.
    cfg = load_config("tiny", overrides)
    trainer = build_trainer(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]), 60)
    ckpt = Checkpointer(str(out / "checkpoints"), every=20, keep=2)
    state, data_state = ckpt.restore(40, trainer.abstract_state)
    ckpt.close()
    data = DataIterator(make_source(cfg, cfg.train.seed), cfg.data.global_batch_size, 256)
    data.restore(data_state)
    assert data.position == 40 and int(state["step"]) == 40
    _, metrics = trainer.step_fn(state, global_batch(trainer, next(data)))
    assert float(metrics["loss"]) == pytest.approx(rows[40]["loss"], rel=1e-6)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = load_config("tiny", ["optim.lr=1.0", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1"]).optim
    lr = lr_schedule(cfg, total_steps=14)
    values = [float(lr(s)) for s in range(16)]
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4] == pytest.approx(1.0) and values[9] == pytest.approx(0.55)
    assert values[14:] == pytest.approx([0.1, 0.1])
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0"}, False),
    ({"TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, True),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, True),
    ({"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": ["a:1"], "workerpool1": ["b:1"]}})}, True),
    ({"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": ["a:1"]}})}, False),
    ({"TPU_WORKER_HOSTNAMES": "w-0,w-1", "MOE_TRAIN_DISTRIBUTED": "0"}, False),
])
def test_multi_host_detection(env, expected):
    assert distributed.wants_distributed(env) is expected
    assert distributed.initialize({}, tpu_vm=False) == "single-host"
    assert not distributed.on_tpu_vm(exists=lambda path: False)


def test_pathways_detection():
    assert distributed.wants_pathways({"JAX_PLATFORMS": "proxy"})
    assert not distributed.wants_pathways({"JAX_PLATFORMS": "cpu"})
