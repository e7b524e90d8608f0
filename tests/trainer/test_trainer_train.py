"""The train loop in-process: it learns (synthetic floor, byte text), stops on a signal and resumes exactly,
survives a damaged checkpoint, fails fast when it cannot save; the schedule, multi-host detection."""

import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from click.testing import CliRunner

from trainer import distributed, sharding
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.cli import train_command
from trainer.config import ConfigError, load_config
from trainer.data import DataIterator, make_source
from trainer.metrics import Reporter
from trainer.status import RunStatus
from trainer.step import build_trainer, lr_schedule
from trainer.train import RunSpec, StopSignal, global_batch, run

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


class At(Reporter):
    """Reports as usual, and runs `action` once step `step` is reported: a signal or a failing disk, on cue."""

    def __init__(self, metrics_path, step, action):
        super().__init__(str(metrics_path), stderr=io.StringIO())
        self.step, self.action = step, action

    def metrics(self, row):
        super().metrics(row)
        if row["step"] == self.step:
            self.action()

    @property
    def messages(self):
        return self.err.getvalue()


def run_tiny(reporter, steps, overrides=(), **spec):
    try:
        return run(RunSpec(config=load_config("tiny", list(overrides)), steps=steps, num_devices=1,
                           mesh_shape={"data": 1, "expert": 1}, **spec), reporter)
    finally:
        reporter.close()


def read_rows(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def restore_params(output_dir, step):
    path = os.path.join(output_dir, "checkpoints", str(step), "state")
    return ocp.StandardCheckpointer().restore(path)["params"]


def test_tiny_approaches_the_entropy_floor_of_the_markov_source(trained_tiny):
    rows = trained_tiny.rows  # 120 steps on one device (tests/trainer/conftest.py)
    floor = rows[-1]["entropy_floor"]
    final = np.mean([r["loss"] for r in rows[-10:]])
    assert rows[0]["loss"] > floor + 3
    assert floor - 0.1 < final < floor + 0.15, (final, floor)
    keys = {"step", "loss", "aux_loss", "z_loss", "drop_fraction", "expert_load", "tokens_per_s",
            "step_time_s", "mfu", "grad_norm", "lr", "entropy_floor"}
    assert keys <= set(rows[-1])
    assert rows[-1]["mfu"] is None  # the CPU's peak is unknown
    assert len(rows[-1]["expert_load"]) == 8 and sum(rows[-1]["expert_load"]) == pytest.approx(1.0)


def test_the_loop_reads_the_devices_only_at_logged_steps(tmp_path, monkeypatch, trained_tiny):
    """9 steps logged every 3rd: the loop reads the steps' metrics three times (one transfer each, checked for
    divergence step by step), never waiting on a step between, and makes no implicit transfer (jax's
    transfer guard would raise). Its rows are those of the same run logged at every step."""
    reads = []
    device_get = jax.device_get

    def counted(tree):
        reads.append(sorted(tree[0]) if isinstance(tree, list) and tree else tree)
        return device_get(tree)

    monkeypatch.setattr(jax, "device_get", counted)
    with jax.transfer_guard_device_to_host("disallow"):
        sparse = run_tiny(Reporter(str(tmp_path / "sparse.jsonl")), 9, ["train.log_every=3", "optim.decay_steps=120"])
    monkeypatch.undo()
    every = trained_tiny.rows  # the same model, data and schedule, logged at every step
    assert sparse.step == 9 and sparse.loss == pytest.approx(every[8]["loss"], rel=1e-5)
    rows = read_rows(tmp_path / "sparse.jsonl")
    assert [r["step"] for r in rows] == [3, 6, 9]
    first = rows[0]  # how the process started: the state's initialisation, the compile, the first step
    assert first["first_step_s"] >= first["init_s"] + first["compile_s"] and first["init_s"] > 0
    assert first["compile_s"] > 0 and "init_s" not in rows[1]
    marks = [v for k, v in first.items() if k.startswith("startup_")]  # trainer/startup.py's stages, in order
    assert "startup_state_s" in first and marks == sorted(marks) and marks[-1] <= first["first_step_s"]
    np.testing.assert_allclose([r["loss"] for r in rows], [every[i]["loss"] for i in (2, 5, 8)], rtol=1e-5)
    metric_reads = [r for r in reads if isinstance(r, list) and "loss" in r]
    assert len(metric_reads) == 3 and len(reads) == 3 + 2, reads  # and the start step, read twice


def test_the_runtimes_host_buffer_is_small_where_pinning_it_is_slow_unless_the_environment_sets_it():
    """The TPU runtime's pinned host buffer, which its start spends seconds pinning without transparent
    hugepages, is the project's smaller size there, the runtime's own where hugepages are always on, and
    whatever the environment names in any case."""
    from trainer import startup

    env = {}
    startup.runtime_defaults(env, hugepages=False)
    assert env == {"TPU_PREMAPPED_BUFFER_SIZE": str(startup.PREMAPPED_BUFFER_BYTES)}
    assert startup.PREMAPPED_BUFFER_BYTES < 4 * 2**30  # the runtime's own default
    with_hugepages = {}
    startup.runtime_defaults(with_hugepages, hugepages=True)
    assert with_hugepages == {}
    mine = {"TPU_PREMAPPED_BUFFER_SIZE": "4294967296"}
    startup.runtime_defaults(mine, hugepages=False)
    assert mine == {"TPU_PREMAPPED_BUFFER_SIZE": "4294967296"}


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


def test_ctrl_c_stops_at_that_step_with_a_checkpoint_and_resume_continues_exactly(tmp_path):
    """10 steps straight == 3 steps, SIGINT (Ctrl-C), then `--resume auto` to 10: the same losses and
    parameters. (SIGTERM takes the same path; test_trainer_cli sends it to a real process.)"""
    overrides = ["optim.decay_steps=10", "train.checkpoint_every=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    straight = run_tiny(Reporter(str(tmp_path / "a.jsonl")), 10, overrides, output_dir=str(a))
    assert (straight.step, straight.stopped_by_signal) == (10, False)
    status = RunStatus([str(tmp_path / "b-status.json")])
    reporter = At(tmp_path / "b.jsonl", 3, lambda: os.kill(os.getpid(), signal.SIGINT))
    handler_before = signal.getsignal(signal.SIGINT)
    try:
        stopped = run(RunSpec(config=load_config("tiny", overrides), steps=10, num_devices=1,
                              mesh_shape={"data": 1, "expert": 1}, output_dir=str(b)), reporter, status=status)
    finally:
        reporter.close()
    assert (stopped.step, stopped.stopped_by_signal, stopped.stop_reason, stopped.checkpoint_step) == \
        (3, True, "SIGINT", 3)
    assert signal.getsignal(signal.SIGINT) is handler_before  # the loop's handler is gone again
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["3"]
    assert "stopped by SIGINT at step 3 of 10, not finished; checkpoint at step 3 in" in reporter.messages
    assert json.loads((tmp_path / "b-status.json").read_text())["step"] == 3

    result = CliRunner().invoke(train_command, [
        "--config", "tiny", "--devices", "1", "--steps", "10", *[f"--set={o}" for o in overrides],
        "--output-dir", str(b), "--metrics", str(tmp_path / "b2.jsonl"),
        "--status-file", str(tmp_path / "b2-status.json")])
    assert result.exit_code == 0, result.output
    assert f"resumed from {b / 'checkpoints'} at step 3" in result.output
    rows_a, rows_b, rows_b2 = (read_rows(tmp_path / f"{n}.jsonl") for n in ("a", "b", "b2"))
    assert [r["step"] for r in rows_b] == [1, 2, 3] and [r["step"] for r in rows_b2] == list(range(4, 11))
    np.testing.assert_allclose([r["loss"] for r in rows_b + rows_b2], [r["loss"] for r in rows_a], rtol=1e-6)
    params_a, params_b = restore_params(a, 10), restore_params(b, 10)
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        np.testing.assert_allclose(params_a[name], params_b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    for path in (b / "status.json", tmp_path / "b2-status.json"):
        status = json.loads(path.read_text())
        assert {k: status[k] for k in ("state", "step", "total_steps", "start_step", "exit_code", "error")} == \
            {"state": "finished", "step": 10, "total_steps": 10, "start_step": 3, "exit_code": 0, "error": None}
        assert status["loss"] == pytest.approx(rows_a[-1]["loss"], rel=1e-6)
    assert [r["step"] for r in read_rows(b / "metrics.jsonl")] == list(range(4, 11))
    # --resume never refuses a directory that holds checkpoints.
    result = CliRunner().invoke(train_command, ["--config", "tiny", "--devices", "1", "--resume", "never",
                                                "--output-dir", str(b)])
    assert result.exit_code == 2 and "already holds checkpoints" in result.output


# orbax's background event loop, closed after the failure, still hears from a finished read
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_latest_checkpoint_is_reported_and_the_one_before_it_resumes(tmp_path, monkeypatch):
    """Reported once: its failed reads, however late they are collected, print nothing more."""
    import gc

    out = tmp_path / "out"
    run_tiny(Reporter(str(tmp_path / "a.jsonl")), 4, ["train.checkpoint_every=2"], output_dir=str(out))
    rows_a = read_rows(tmp_path / "a.jsonl")
    arrays = out / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d"
    largest = max(arrays.iterdir(), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:  # a write cut short
        f.truncate(100)

    reporter = At(tmp_path / "b.jsonl", 0, lambda: None)
    printed = []  # what reaches the process's hook for exceptions raised where nobody can catch them
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    result = run_tiny(reporter, 6, ["train.checkpoint_every=2"], output_dir=str(out))
    gc.collect()
    assert printed == [], [(u.object, u.exc_value) for u in printed]
    assert f"the checkpoint at step 4 ({out / 'checkpoints' / '4'}) cannot be restored" in reporter.messages
    assert f"moved it to {out / 'checkpoints' / '4'}.unreadable-" in reporter.messages
    assert "and resumed from step 2 instead" in reporter.messages
    assert result.start_step == 2 and result.step == 6
    rows_b = read_rows(tmp_path / "b.jsonl")
    assert [r["step"] for r in rows_b] == [3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in rows_b[:2]], [r["loss"] for r in rows_a[2:]], rtol=1e-6)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert [n for n in names if n.isdigit()] == ["2", "4", "6"]
    assert [n.split("-")[0] for n in names if not n.isdigit()] == ["4.unreadable"]

    # Another model's checkpoints are not damage: nothing moves, and the error names what differs.
    reporter = Reporter(str(tmp_path / "c.jsonl"), stderr=io.StringIO())
    with pytest.raises(ConfigError, match=r"written by a different run: model.d_model is 64 in the checkpoint, "
                                          r"32 now"):
        run_tiny(reporter, 8, ["train.checkpoint_every=2", "model.d_model=32"], output_dir=str(out))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == names


# orbax's background event loop, closed after the failure, still hears from a finished read
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_that_cannot_be_saved_fails_at_once_naming_the_path(tmp_path):
    """The checkpoint directory turns into a file mid-run: the save raises at once, naming step and path."""
    checkpoints = tmp_path / "out" / "checkpoints"

    def break_the_disk():
        shutil.rmtree(checkpoints)
        checkpoints.write_text("")

    with pytest.raises(CheckpointError) as err:
        run_tiny(At(tmp_path / "m.jsonl", 2, break_the_disk), 6, ["train.checkpoint_every=3"],
                 output_dir=str(tmp_path / "out"))
    assert str(err.value).startswith(f"cannot save the checkpoint at step 3 to {checkpoints}: ")
    assert "Not a directory" in str(err.value)


def test_a_second_ctrl_c_stops_at_once():
    stop = StopSignal()
    restore = stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert (stop.requested, stop.reason) == (True, "SIGINT")
        os.kill(os.getpid(), signal.SIGTERM)  # a later signal does not rename the first
        assert stop.reason == "SIGINT"
        os.kill(os.getpid(), signal.SIGINT)  # before the loop acts on the first: the same stop
        stop.acted = True  # the loop stopped for it and saves the checkpoint: now a second Ctrl-C is at once
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


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
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.1:8476,10.0.0.2:8476"}, True),
    ({"MEGASCALE_NUM_SLICES": "2"}, True),
    ({"MEGASCALE_NUM_SLICES": "1", "TPU_WORKER_HOSTNAMES": "w-0"}, False),
    ({"JAX_NUM_PROCESSES": "4"}, True),
    ({"JAX_NUM_PROCESSES": "1"}, False),
    ({"MOE_TRAIN_DISTRIBUTED": "1"}, True),
    ({"CLUSTER_SPEC": "not json"}, False),
])
def test_multi_host_detection(env, expected):
    assert distributed.wants_distributed(env) is expected
    assert distributed.initialize({}, tpu_vm=False) == "single-host"
    assert not distributed.on_tpu_vm(exists=lambda path: False)


def test_a_tpu_vm_with_no_metadata_server_and_nothing_set_trains_alone():
    """A one-chip TPU in a container or a workstation: no metadata server answers, nothing in the environment
    names other hosts, so jax.distributed is not started (it would fail asking metadata.google.internal)."""
    asked = []

    def no_server(env, key):
        asked.append(key)
        return None

    assert distributed.initialize({}, tpu_vm=True, read=no_server) == "single-host"
    assert asked == ["worker-network-endpoints"]
    assert distributed.initialize({"TPU_WORKER_HOSTNAMES": "w-0", "TPU_SKIP_MDS_QUERY": "true"}, tpu_vm=True,
                                  read=no_server) == "single-host"
    assert asked == ["worker-network-endpoints"]  # GKE's single-host pod: no metadata asked
    # The real reader, at an address where nothing listens: None at once, no exception.
    assert distributed.read_metadata({"GCE_METADATA_IP": "127.0.0.1:9"}, "worker-network-endpoints") is None


def test_a_tpu_vm_slice_is_known_from_its_metadata_server():
    """A multi-host slice made with `gcloud compute tpus` says nothing in the environment; its metadata server
    lists the workers (a real HTTP server here, answering as the metadata server does)."""
    import http.server
    import threading

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            known = self.headers.get("Metadata-Flavor") == "Google" and self.path.endswith("/worker-network-endpoints")
            body = b"w-0,w-1,w-2,w-3" if known else b"not found"
            self.send_response(200 if known else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"GCE_METADATA_IP": f"127.0.0.1:{server.server_port}"}
        assert distributed.tpu_vm_evidence(env) == "the TPU VM's metadata lists 4 workers"
        assert distributed.read_metadata(env, "agent-worker-number") is None
        assert distributed.tpu_vm_evidence({**env, "MOE_TRAIN_DISTRIBUTED": "0"}) is None
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_multi_host_start_names_what_made_it_try():
    jax.devices()  # a started backend: jax.distributed refuses to start, as any failure would
    with pytest.raises(RuntimeError) as failed:
        distributed.initialize({"TPU_WORKER_HOSTNAMES": "w-0,w-1"}, tpu_vm=False)
    assert "(TPU_WORKER_HOSTNAMES lists 2 hosts, so this is taken for one of several hosts)" in str(failed.value)
    assert "Set MOE_TRAIN_DISTRIBUTED=0 to train on this host alone" in str(failed.value)
    result = CliRunner().invoke(train_command, ["--config", "tiny", "--steps", "1"],
                                env={"MEGASCALE_NUM_SLICES": "2"})
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "multi-host start-up failed: jax.distributed.initialize() failed (MEGASCALE_NUM_SLICES=2, so" \
        in result.output


def test_a_trainer_on_a_chip_keeps_its_compiled_programs_where_the_dry_run_does():
    from provision.emulator.local_trainer import compilation_cache_env

    env = {"XDG_CACHE_HOME": "/var/cache/me"}
    assert distributed.compilation_cache_dir(env) == "/var/cache/me/moe-tpu/jax"
    assert compilation_cache_env(env) == {"JAX_COMPILATION_CACHE_DIR": distributed.compilation_cache_dir(env)}
    assert distributed.use_compilation_cache("cpu", env) is None  # the dry run sets its own
    assert distributed.use_compilation_cache("tpu", {**env, "JAX_COMPILATION_CACHE_DIR": "/mine"}) is None
    before = jax.config.jax_compilation_cache_dir  # this suite's (tests/conftest.py): kept
    assert before and distributed.use_compilation_cache("tpu", env) is None
    assert jax.config.jax_compilation_cache_dir == before
    # Quick programs kept too, unless the environment says otherwise (the suite's own setting is 0).
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        distributed.use_compilation_cache("tpu", {**env, distributed.MIN_COMPILE_TIME_VARIABLE: "1"})
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
        distributed.use_compilation_cache("tpu", env)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def test_pathways_detection():
    assert distributed.wants_pathways({"JAX_PLATFORMS": "proxy"})
    assert not distributed.wants_pathways({"JAX_PLATFORMS": "cpu"})


def test_rerunning_a_finished_run_says_so_without_compiling(tmp_path):
    """The latest checkpoint is at the last step: one line, status "finished" with exit code 0, no train step
    built or compiled, no new metrics and no new checkpoint."""
    args = ["--config", "tiny", "--devices", "1", "--steps", "2", "--set", "train.checkpoint_every=1",
            "--output-dir", str(tmp_path)]
    first = CliRunner().invoke(train_command, [*args, "--metrics", str(tmp_path / "first.jsonl")])
    assert first.exit_code == 0, first.output
    assert re.search(r"^(compiled|loaded) the train step", first.output, re.M)  # loaded: an earlier test kept it
    again = CliRunner().invoke(train_command, [*args, "--metrics", str(tmp_path / "again.jsonl")])
    assert again.exit_code == 0, again.output
    assert again.output == (f"already finished: the latest checkpoint in {tmp_path / 'checkpoints'} is at "
                            "step 2 of 2; nothing to train\n")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]
    assert (tmp_path / "again.jsonl").read_text() == ""
    status = json.loads((tmp_path / "status.json").read_text())
    assert {k: status[k] for k in ("state", "step", "total_steps", "start_step", "exit_code", "error")} == \
        {"state": "finished", "step": 2, "total_steps": 2, "start_step": 2, "exit_code": 0, "error": None}


def test_a_restarted_run_loads_its_kept_programs_and_damaged_ones_are_compiled_again(tmp_path):
    """train.program_cache (trainer/program_cache.py, on by default), as a user restarts a run: processes of
    their own, one compilation cache. The first keeps its initial state's program and its train step; the second loads
    both (it says so, and rewrites neither) and takes the same steps; entries damaged since are misses,
    removed, and the steps the same."""
    import time

    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    kept = tmp_path / "cache" / "moe-tpu-programs"

    def run(name):
        metrics = tmp_path / f"{name}.jsonl"
        out = subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "--devices", "1", "--steps", "3",
                              "--metrics", str(metrics)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], out.stdout + out.stderr

    def entries():  # the init's is written on a thread beside the steps: whole before the process ends
        deadline = time.monotonic() + 30
        while len(found := {p: p.stat() for p in kept.glob("[0-9a-f]*")}) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return {path: stat.st_mtime_ns for path, stat in found.items()}

    first, said = run("first")
    made = entries()
    assert len(made) == 2 and "compiled the train step" in said
    again, said = run("again")
    assert again == first and entries() == made
    assert "loaded the train step an earlier run of this config compiled" in said
    for path in made:
        path.write_bytes(b"not a program")
    damaged, said = run("damaged")
    assert damaged == first and "compiled the train step" in said
    # Removed, not kept again: jax's own cache served the programs (test_only_a_program_compiled_here_is_kept...).
    assert not any(path.exists() for path in made)


def test_only_a_program_compiled_here_is_kept_and_it_runs_loaded():
    """A program jax's persistent cache served is not kept (on a CPU it serializes without its code and fails
    when called); one compiled in this process is, and loads and runs to the same result."""
    import time

    import jax.numpy as jnp

    from trainer import program_cache

    salt = float(time.time_ns() % 1_000_003)  # a program no earlier run compiled: this compile is XLA's
    x = jnp.arange(8.0)

    def lowered():  # a new function each time: traced and lowered again, as a restarted process does
        return jax.jit(lambda v: jnp.tanh(v[:, None] - v[None, :]).sum(0) * salt).lower(x)

    compiled, keepable = program_cache.compile_to_keep(lowered())
    assert keepable and jax.config.jax_compilation_cache_dir  # the suite's cache (tests/conftest.py)
    served, served_keepable = program_cache.compile_to_keep(lowered())
    assert not served_keepable and np.array_equal(served(x), compiled(x))
    name = f"test-{os.getpid()}-{int(salt)}"
    try:
        assert program_cache.store(name, compiled)
        loaded = program_cache.load(name, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
        assert loaded is not None and np.array_equal(loaded(x), compiled(x))
    finally:
        (program_cache.directory() / name).unlink(missing_ok=True)


def test_a_kept_programs_key_changes_with_the_config_the_environment_and_the_schedule(monkeypatch):
    from trainer import program_cache

    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    cfg = load_config("tiny")
    base = program_cache.key("step", cfg, mesh, decay_steps=10)
    assert program_cache.key("step", cfg, mesh, decay_steps=10) == base
    assert program_cache.key("init", cfg, mesh, decay_steps=10) != base
    assert program_cache.key("step", cfg, mesh, decay_steps=11) != base
    assert program_cache.key("step", load_config("tiny", ["optim.lr=0.002"]), mesh, decay_steps=10) != base
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert program_cache.key("step", cfg, mesh, decay_steps=10) != base
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")  # where programs are kept is not their make
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"].replace(" --xla_cpu_enable_fast_math=false", ""))
    assert program_cache.key("step", cfg, mesh, decay_steps=10) == base
    # The same in every process (no object's address, no set's order in it): two of them, hashes seeded apart.
    code = ("import jax; from trainer import program_cache, sharding; from trainer.config import load_config; "
            "print(program_cache.key('step', load_config('tiny'), sharding.make_mesh({'data': 1, 'expert': 1}, "
            "jax.devices()[:1]), decay_steps=10))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONHASHSEED=seed)) for seed in ("1", "2")]
    keys = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert len(keys[0]) == 64 and keys[0] == keys[1]


def test_divergence_stops_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """A learning rate that blows the model up: exit 1 naming the step, no checkpoint of that state saved (the
    good ones stay, none rotated out), and the status file says failed. Its loss stays finite (10**7 nats at
    step 2, where it trained to the end and said 'finished'): past four times a uniform guess's loss
    (ln 256 nats on tiny) the run stops as for a NaN."""
    args = ["--config", "tiny", "--devices", "1", "--steps", "40", "--set", "optim.lr=1e4",
            "--set", "train.checkpoint_every=1", "--set", "train.keep_checkpoints=2", "--output-dir", str(tmp_path),
            "--metrics", str(tmp_path / "m.jsonl")]
    result = CliRunner().invoke(train_command, args)
    assert result.exit_code == 1, result.output
    assert "training diverged at step " in result.output and "Traceback" not in result.output
    assert "nats, over 22.2 (4 times the loss of guessing every token uniformly" in result.output
    step = int(result.output.split("training diverged at step ")[1].split(":")[0])
    assert step < 40
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept and max(kept) < step and f"last good checkpoint, step {max(kept)}" in result.output
    params = restore_params(tmp_path, max(kept))
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(params))
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and f"step {step}" in status["error"]


def test_a_resumed_run_whose_state_goes_nan_under_a_finite_loss_keeps_its_good_checkpoints(trained_tiny, tmp_path):
    """optim.eps 0: the embedding rows of tokens the data never holds get 0/0 updates, NaN, while the loss stays
    finite (nothing reads them). Every save then wrote NaN parameters and, with keep 3, rotated the three good
    checkpoints out ("finished", exit 0). Now the first save of a non-finite state stops the run: exit 1 naming
    the step and the arrays, the good checkpoints as they were."""
    shutil.copytree(trained_tiny.output_dir, tmp_path / "run")
    good = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert len(good) == 3
    result = CliRunner().invoke(train_command, [
        "--config", "tiny", "--devices", "1", "--steps", "124", "--set", "optim.eps=0", "--set",
        "train.checkpoint_every=1", "--output-dir", str(tmp_path / "run"), "--metrics", str(tmp_path / "m.jsonl")])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert ("training diverged at step 121: its loss and gradient norm are finite, but the parameters or optimizer "
            "state after it hold NaN or infinite values (params.embed") in result.output
    assert f"the last good checkpoint, step {good[-1]} in {tmp_path / 'run' / 'checkpoints'}, is kept" in result.output
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == good
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and "step 121" in status["error"]


def test_resuming_another_models_checkpoint_is_refused_naming_the_difference(tmp_path):
    args = ["--config", "tiny", "--devices", "1", "--set", "train.checkpoint_every=1", "--output-dir", str(tmp_path)]
    first = CliRunner().invoke(train_command, [*args, "--steps", "2", "--metrics", str(tmp_path / "a.jsonl")])
    assert first.exit_code == 0, first.output
    other = CliRunner().invoke(train_command, [*args, "--steps", "4", "--set", "model.d_model=32",
                                               "--metrics", str(tmp_path / "b.jsonl")])
    assert other.exit_code == 2, other.output
    assert "model.d_model is 64 in the checkpoint, 32 now" in other.output
    longer = CliRunner().invoke(train_command, [*args, "--steps", "4", "--metrics", str(tmp_path / "c.jsonl")])
    assert longer.exit_code == 0, longer.output
    assert "the learning-rate schedule changes: its cosine decay ends at step 4, not at step 2" in longer.output
    assert "optim.decay_steps=2" in longer.output


@pytest.mark.parametrize("args, code, needle", [
    (["--seed", str(2**70)], 2, "is not in the range 0<=x<=2147483647"),
    (["--set", f"train.seed={2**70}"], 2, "train.seed must be between 0 and 2147483647"),
    (["--metrics", "/dev/full"], 1, "cannot write the metrics to /dev/full: No space left on device"),
    (["--metrics", "/"], 2, "/ is a directory, not a file"),
    (["--config", "/dev/zero"], 2, "/dev/zero is a device, not a file"),
])
def test_bad_arguments_are_messages_never_tracebacks(tmp_path, args, code, needle):
    result = CliRunner().invoke(train_command, ["--devices", "1", "--steps", "1", *args])
    assert result.exit_code == code, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_second_trainer_on_the_same_output_directory_is_refused_naming_the_first(tmp_path):
    import fcntl

    from trainer import cli

    lock = tmp_path / ".lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"4242\n", 0)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the first trainer, still running
    try:
        result = CliRunner().invoke(train_command, ["--config", "tiny", "--devices", "1", "--steps", "1",
                                                    "--output-dir", str(tmp_path)])
    finally:
        os.close(fd)
    assert result.exit_code == 2, result.output
    assert f"another trainer (pid 4242) is training in {tmp_path}" in result.output
    assert not (tmp_path / "checkpoints").exists() and not cli._held


def test_saving_small_arrays_that_devices_hold_alike_compiles_no_slices(tmp_path):
    """Orbax writes an array that several devices hold alike in parallel, each replica slicing out its part
    with an operation compiled once per shape; for small arrays the Checkpointer has one replica write it
    whole (trainer/checkpoint.py: the first save of tiny on data=2,expert=4 took 3 s, nearly all compiling)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8])
    held = NamedSharding(mesh, P(None, "expert"))  # split over expert, alike on both data rows
    state = {f"w{i}": jax.device_put(jnp.arange((6 + 2 * i) * 12, dtype=jnp.float32).reshape(6 + 2 * i, 12), held)
             for i in range(5)}
    lowered = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(duration)

    ckpt = Checkpointer(str(tmp_path / "c"), every=1, keep=1, async_save=False)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        ckpt.save(1, state, {}, force=True)
        ckpt.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert lowered == []  # no program made for the save (orbax's default lowered one per array here)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=held) for k, v in state.items()}
    restored, _ = ckpt.restore(1, abstract)
    ckpt.close()
    assert all(np.array_equal(restored[k], state[k]) for k in state)


def test_checkpoints_written_without_compression_take_their_arrays_bytes_and_either_kind_restores(tmp_path):
    """train.checkpoint_compression=false: the arrays written as they lie (orbax compresses each with zstd
    otherwise, and weights' exponents compress); a Checkpointer of either setting restores both exactly."""
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(3), 4)
    state = {f"w{i}": (0.02 * jax.random.normal(k, (256, 256))).astype(jnp.bfloat16) for i, k in enumerate(keys)}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    written = {}
    for compression in (True, False):
        ckpt = Checkpointer(str(tmp_path / str(compression)), every=1, keep=1, async_save=False,
                            compression=compression)
        ckpt.save(1, state, {"position": 7}, force=True)
        ckpt.close()
        written[compression] = sum(f.stat().st_size for f in (tmp_path / str(compression)).rglob("*") if f.is_file())
    arrays = sum(v.nbytes for v in state.values())
    assert written[False] >= arrays > written[True] and written[True] < 0.95 * written[False], (written, arrays)
    # and as this project's checkpoints were written before the choice (orbax's standard handler)
    with ocp.CheckpointManager(str(tmp_path / "before"), item_handlers={
            "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}) as before:
        before.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=ocp.args.JsonSave({"position": 7})))
    for name, compression in (("True", False), ("False", True), ("before", False)):  # read by the other setting
        ckpt = Checkpointer(str(tmp_path / name), every=1, keep=1, compression=compression)
        restored, data = ckpt.restore(1, abstract)
        ckpt.close()
        assert data == {"position": 7}
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state)


def test_arrays_are_written_in_chunks_of_at_most_chunk_bytes_and_restore_exactly(tmp_path, monkeypatch):
    """trainer/checkpoint.py CHUNK_BYTES: an array larger than it is stored in chunks no larger (orbax had written
    a device's part of each array as one chunk, read and decompressed on one thread), a smaller one whole; the
    state restores bit for bit."""
    import jax.numpy as jnp

    from trainer import checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 1 << 20)
    state = {"big": (0.02 * jax.random.normal(jax.random.key(5), (1024, 1536))).astype(jnp.bfloat16),  # 3 MiB
             "small": jnp.arange(24, dtype=jnp.float32).reshape(4, 6), "step": jnp.int32(9)}
    ckpt = Checkpointer(str(tmp_path / "c"), every=1, keep=1, async_save=False)
    ckpt.save(1, state, {}, force=True)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    restored, _ = ckpt.restore(1, abstract)
    ckpt.close()
    stored = ocp.PyTreeCheckpointHandler().metadata(tmp_path / "c" / "1" / "state").tree
    big = stored["big"].storage.chunk_shape
    assert 2 * np.prod(big) <= 1 << 20 and np.prod(big) < state["big"].size, big
    assert stored["small"].storage.chunk_shape == (4, 6)
    assert all(np.asarray(restored[k]).tobytes() == np.asarray(state[k]).tobytes() for k in state)


def test_a_run_without_an_output_dir_says_nothing_is_saved_and_ends_with_a_summary(tmp_path):
    reporter = At(tmp_path / "m.jsonl", 0, lambda: None)
    result = run_tiny(reporter, 2)
    lines = reporter.messages.splitlines()
    assert any(line.startswith(("compiled the train step", "loaded the train step")) and line.endswith(
        "no checkpoint is saved (no --output-dir: give one to keep the run and resume it)") for line in lines)
    assert lines[-1] == (f"finished step 2 of 2, loss {result.loss:.4f}; no checkpoint is saved (no --output-dir: "
                         "give one to keep the run and resume it)")


def test_the_array_handler_is_registered_without_orbaxs_override_warning(caplog):
    """It was 'WARNING:absl:Type handler registry type ... overriding jax.Array' at every start."""
    import logging

    from trainer.checkpoint import _replica_parallel_for_large_arrays_only

    with caplog.at_level(logging.DEBUG):
        _replica_parallel_for_large_arrays_only()
    assert [r.getMessage() for r in caplog.records if "overriding" in r.getMessage()] == []


def test_a_second_sigint_before_the_loop_acts_is_one_stop_and_ctrl_c_exits_130(tmp_path):
    """Two Ctrl-C in a row land before the loop looks: one stop with its checkpoint (the second used to
    raise KeyboardInterrupt from the handler, wherever the loop was). `train` then exits 130, status
    "stopped" (SIGTERM's is 143)."""
    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    reporter = At(tmp_path / "a.jsonl", 2, twice)
    stopped = run_tiny(reporter, 10, output_dir=str(tmp_path / "a"))
    assert (stopped.step, stopped.stop_reason, stopped.checkpoint_step) == (2, "SIGINT", 2)

    from trainer.cli import stopped_exit_code
    from trainer.status import STATE_OF_EXIT

    assert [stopped_exit_code(r) for r in ("SIGINT", "SIGTERM", "a preemption notice")] == [130, 143, 143]
    assert STATE_OF_EXIT[130] == STATE_OF_EXIT[143] == "stopped"  # the VM's watcher reads both as a stop
