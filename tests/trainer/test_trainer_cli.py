"""The command line from the outside: expert-parallel invariance, signals and exit codes, usage errors."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
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
    """tiny in float32 with ample capacity: the same losses on 1 device, 1x8 and 2x4 meshes. The command runs
    in this process (its 8 fake devices; `--devices` takes the first N), not an interpreter each: the
    process's own start-up and signals are the next test's."""
    meshes = {"1x1": ("1", "data=1,expert=1"), "1x8": ("8", "data=1,expert=8"), "2x4": ("8", "data=2,expert=4")}
    jax.devices()  # jax started with the session's 8 fake devices, as --devices expects in-process
    for name, (d, m) in meshes.items():
        result = CliRunner().invoke(train_command, [
            "--config", "tiny", "--steps", "5", "--devices", d, "--mesh", m, "--set", "moe.capacity_factor=8",
            "--set", "dtype=float32", "--metrics", str(tmp_path / f"{name}.jsonl")])
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    losses = {name: [r["loss"] for r in rows(tmp_path / f"{name}.jsonl")] for name in meshes}
    assert len(losses["1x1"]) == 5 and losses["1x1"][-1] < losses["1x1"][0]
    np.testing.assert_allclose(losses["1x8"], losses["1x1"], atol=1e-4)
    np.testing.assert_allclose(losses["2x4"], losses["1x1"], atol=1e-4)
    assert all(r["drop_fraction"] == 0 for name in meshes for r in rows(tmp_path / f"{name}.jsonl"))


def read_status(path):
    with open(path) as f:
        return json.load(f)


def test_sigterm_saves_a_checkpoint_and_exits_143_and_a_failed_save_exits_1(tmp_path):
    """SIGTERM: the step's checkpoint, one line saying where and how to continue, status "stopped", 143.
    Ctrl-C whose checkpoint cannot be saved: exit 1 at once, naming the path (orbax would wait minutes)."""
    procs, logs = {}, {}
    for name in ("SIGTERM", "unsaved"):
        logs[name] = open(tmp_path / f"{name}.err", "w")  # noqa: SIM115 - a pipe would fill up
        procs[name] = subprocess.Popen(
            trainer_cmd("--steps", "100000", "--devices", "2", "--output-dir", str(tmp_path / name),
                        "--metrics", str(tmp_path / f"{name}.jsonl"), "--set", "train.checkpoint_every=100000"),
            stdout=subprocess.DEVNULL, stderr=logs[name],
            env={**os.environ, "MOE_TPU_STATUS_FILE": str(tmp_path / f"{name}-worker.json")})
    deadline = time.monotonic() + 240
    for name, proc in procs.items():
        status = tmp_path / name / "status.json"
        while not (status.exists() and read_status(status)["state"] == "running") and proc.poll() is None:
            assert time.monotonic() < deadline, "the run never reported a step"
            time.sleep(0.02)
        if name == "unsaved":
            shutil.rmtree(tmp_path / name / "checkpoints")
            (tmp_path / name / "checkpoints").write_text("")
        proc.send_signal(signal.SIGTERM if name == "SIGTERM" else signal.SIGINT)
    for name, proc in procs.items():
        proc.wait(timeout=60)
        logs[name].close()
        err = (tmp_path / f"{name}.err").read_text()
        assert "Traceback" not in err
        step = rows(tmp_path / f"{name}.jsonl")[-1]["step"]
        checkpoint = tmp_path / name / "checkpoints" / str(step)
        if name == "unsaved":
            message = f"cannot save the checkpoint at step {step} to {tmp_path / name / 'checkpoints'}: "
            assert proc.returncode == 1 and f"Error: {message}" in err, err[-3000:]
            expected = {"state": "failed", "step": step, "exit_code": 1}
        else:
            assert proc.returncode == 143, err[-3000:]
            assert os.path.isdir(checkpoint)
            assert (f"stopped by {name} at step {step} of 100000, not finished; checkpoint at step {step} in "
                    f"{checkpoint}; run the same command again (--resume auto) to continue") in err.splitlines()
            expected = {"state": "stopped", "step": step, "exit_code": 143, "error": None}
        for status in (tmp_path / name / "status.json", tmp_path / f"{name}-worker.json"):
            got = read_status(status)
            assert got == {**got, **expected, "total_steps": 100000, "start_step": 0}
        assert [r["step"] for r in rows(tmp_path / name / "metrics.jsonl")] == list(range(1, step + 1))
    assert read_status(tmp_path / "unsaved" / "status.json")["error"].startswith(message)


def test_usage_error_writes_a_failed_status_with_exit_code_2(tmp_path):
    jax.devices()
    result = CliRunner().invoke(train_command, ["--config", "tiny", "--devices", "1", "--set", "optim.lr=nan",
                                                "--output-dir", str(tmp_path), "--status-file",
                                                str(tmp_path / "worker" / "status.json")])
    assert result.exit_code == 2 and "optim.lr must be a finite number" in result.output
    for path in (tmp_path / "status.json", tmp_path / "worker" / "status.json"):
        status = read_status(path)
        assert status["state"] == "failed" and status["exit_code"] == 2
        assert "optim.lr must be a finite number" in status["error"]


def test_bad_config_from_the_command_line_exits_2_without_traceback():
    p = subprocess.run(trainer_cmd("--devices", "2", "--set", "moe.num_expert=4"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "did you mean 'moe.num_experts'" in p.stderr


def test_a_mesh_larger_than_the_devices_suggests_the_devices_flag():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    p = subprocess.run(trainer_cmd("--mesh", "data=2,expert=4"), capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--mesh data=2,expert=4 needs 8 devices, but there are 1; on CPU, add --devices 8" in p.stderr


@pytest.mark.parametrize("args, needle", [
    (["--config", "no-such-config"], "unknown config 'no-such-config'"),
    (["--set", "model.d_modle=8"], "did you mean 'model.d_model'"),
    (["--set", "moe.top_k=0"], "top_k"),
    (["--mesh", "data=3"], "needs 3 devices, but there are 8; on CPU, add --devices 3"),
    (["--mesh", "data=2,expert=8"], "add --devices 16 to run on 16 fake devices"),
    # Axes that leave no device for data: no "needs 0 devices", and the --devices hint.
    (["--mesh", "expert=16"], "--mesh expert=16 needs a multiple of expert x model = 16 devices, but there are 8; "
                              "on CPU, add --devices 16 to run on 16 fake devices"),
    (["--mesh", "expert=3"], "needs a multiple of expert x model = 3 devices, but there are 8; on CPU, add "
                             "--devices 3"),
    (["--mesh", "data=2,expert=4", "--set", "moe.num_experts=6"], "moe.num_experts (6) must be divisible"),
    (["--mesh", "data=8", "--set", "data.global_batch_size=12"], "must be divisible by the mesh size"),
    (["--set", "data.source=text", "--set", "data.path=/nonexistent/*.txt"], "matches no files"),
    (["--mesh", "data=2,expert=4", "--set", "moe.routing_groups=3"], "cannot be built for this config"),
    (["--steps", "-1"], "--steps"),
    (["--steps", "99999999999999999999"], "'--steps': 99999999999999999999 is not in the range 0<=x<=2147483647"),
    (["--set", "optim.warmup_steps=2147483648"], "optim.warmup_steps must be between 0 and 2147483647 (the step "
                                                  "counter is a 32-bit integer)"),
    (["--metrics", "/nonexistent/dir/m.jsonl"], "--metrics"),
    (["--output-dir", __file__], "is a file, not a directory"),
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
