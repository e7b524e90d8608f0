"""The command line from the outside: expert-parallel invariance, SIGTERM and exact resume, usage errors."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from click.testing import CliRunner

from trainer.cli import set_fake_devices, train_command


def trainer_cmd(*args):
    return [sys.executable, "-m", "trainer", "--config", "tiny", *args]


def rows(path):
    return [json.loads(line) for line in open(path) if line.startswith("{")]


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    return err


def test_expert_parallel_invariance_through_the_command_line(tmp_path):
    """tiny in float32 with ample capacity: the same losses on 1 device, 1x8 and 2x4 meshes."""
    meshes = {"1x1": ("1", "data=1,expert=1"), "1x8": ("8", "data=1,expert=8"), "2x4": ("8", "data=2,expert=4")}
    procs = {name: subprocess.Popen(
        trainer_cmd("--steps", "5", "--devices", d, "--mesh", m, "--set", "moe.capacity_factor=8",
                    "--set", "dtype=float32", "--metrics", str(tmp_path / f"{name}.jsonl")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name, (d, m) in meshes.items()}
    for proc in procs.values():
        finish(proc)
    losses = {name: [r["loss"] for r in rows(tmp_path / f"{name}.jsonl")] for name in meshes}
    assert len(losses["1x1"]) == 5 and losses["1x1"][-1] < losses["1x1"][0]
    np.testing.assert_allclose(losses["1x8"], losses["1x1"], atol=1e-4)
    np.testing.assert_allclose(losses["2x4"], losses["1x1"], atol=1e-4)
    assert all(r["drop_fraction"] == 0 for name in meshes for r in rows(tmp_path / f"{name}.jsonl"))


def restore_params(output_dir, step):
    path = os.path.join(output_dir, "checkpoints", str(step), "state")
    return ocp.StandardCheckpointer().restore(path)["params"]


def test_sigterm_checkpoints_and_resume_continues_exactly(tmp_path):
    """10 steps straight == k steps, SIGTERM, resume to 10: same losses, same parameters."""
    common = ["--devices", "1", "--set", "optim.decay_steps=10", "--set", "train.checkpoint_every=4"]
    straight = subprocess.Popen(trainer_cmd("--steps", "10", *common, "--output-dir", str(tmp_path / "a"),
                                            "--metrics", str(tmp_path / "a.jsonl")),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "b.jsonl"
    interrupted = subprocess.Popen(trainer_cmd("--steps", "100000", *common, "--output-dir",
                                               str(tmp_path / "b"), "--metrics", str(metrics)),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(rows(metrics)) >= 3) and interrupted.poll() is None:
        assert time.monotonic() < deadline, "the run never logged three steps"
        time.sleep(0.02)
    interrupted.send_signal(signal.SIGTERM)
    err = finish(interrupted, timeout=60)
    stopped_at = rows(metrics)[-1]["step"]
    assert "stopped by SIGTERM" in err and f"checkpoint at step {stopped_at}" in err
    assert os.path.isdir(tmp_path / "b" / "checkpoints" / str(stopped_at))
    if stopped_at >= 10:
        pytest.skip(f"the machine was too slow to stop before step 10 (stopped at {stopped_at})")
    resumed = subprocess.run(trainer_cmd("--steps", "10", *common, "--output-dir", str(tmp_path / "b"),
                                         "--metrics", str(tmp_path / "b2.jsonl")),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    finish(straight)
    a, b2 = rows(tmp_path / "a.jsonl"), rows(tmp_path / "b2.jsonl")
    assert [r["step"] for r in b2] == list(range(stopped_at + 1, 11))
    np.testing.assert_allclose([r["loss"] for r in b2], [r["loss"] for r in a[stopped_at:]], rtol=1e-6)
    np.testing.assert_allclose([r["loss"] for r in rows(metrics)], [r["loss"] for r in a[:stopped_at]],
                               rtol=1e-6)
    params_a, params_b = restore_params(tmp_path / "a", 10), restore_params(tmp_path / "b", 10)
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        np.testing.assert_allclose(params_a[name], params_b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # --resume never refuses a directory that holds checkpoints.
    jax.devices()
    result = CliRunner().invoke(train_command, ["--config", "tiny", "--devices", "1", "--resume", "never",
                                                "--output-dir", str(tmp_path / "b")])
    assert result.exit_code == 2 and "already holds checkpoints" in result.output


def test_bad_config_from_the_command_line_exits_2_without_traceback():
    p = subprocess.run(trainer_cmd("--devices", "2", "--set", "moe.num_expert=4"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "did you mean 'moe.num_experts'" in p.stderr


@pytest.mark.parametrize("args, needle", [
    (["--config", "no-such-config"], "unknown config 'no-such-config'"),
    (["--set", "model.d_modle=8"], "did you mean 'model.d_model'"),
    (["--set", "moe.top_k=0"], "top_k"),
    (["--mesh", "data=3"], "needs 3 devices"),
    (["--mesh", "data=2,expert=4", "--set", "moe.num_experts=6"], "moe.num_experts (6) must be divisible"),
    (["--mesh", "data=8", "--set", "data.global_batch_size=12"], "must be divisible by the mesh size"),
    (["--set", "data.source=text", "--set", "data.path=/nonexistent/*.txt"], "matches no files"),
    (["--mesh", "data=2,expert=4", "--set", "moe.routing_groups=3"], "cannot be built for this config"),
    (["--steps", "-1"], "--steps"),
    (["--metrics", "/nonexistent/dir/m.jsonl"], "--metrics"),
    *([(["--output-dir", "gs://bucket/run"], "need the gcsfs package")]
      if not importlib.util.find_spec("gcsfs") and not importlib.util.find_spec("tensorflow") else []),
    (["--profile-steps", "5:2"], "--profile-steps"),
    (["--resume", "sometimes"], "--resume"),
    (["--devices", "9"], "--devices 9"),
])
def test_usage_errors_exit_2_with_a_message(args, needle):
    jax.devices()  # jax runs already: --devices must not touch XLA_FLAGS of this process
    result = CliRunner().invoke(train_command, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


def test_devices_flag_replaces_the_fake_device_count():
    env = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"}
    set_fake_devices(2, env)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1  --xla_force_host_platform_device_count=2"
    assert env["JAX_PLATFORMS"] == "cpu"
