"""Hardening: no input, local state or fault ends in a traceback, an internal error, a hang or a
silently wrong result. One test per class of failure, driven through the real entry point (and the
real client libraries against the emulator)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import config_from, invoke

from provision.app import App
from provision.config import load_config
from provision.errors import CloudError, StockoutError
from provision.kinds.tpu_vm.slices import slice_up
from provision.kinds.vertex.jobs import job_submit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(tmp_path: Path, example: str = "v5e-64.yaml", **changes) -> Path:
    """A copy of an example with dotted__keys changed (None deletes a key), written to tmp_path."""
    return config_from(EXAMPLES / example, tmp_path, **changes)


def _no_traceback(code: int, err: str, expected_code: int = 2) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err and "internal error" not in err, err


# --- 1. work bounded by the size of the input ------------------------------------------------

def _alias_bomb(levels: int = 25) -> str:
    text = "region: &a0 [x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, levels):
        text += f"k{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]\n"
    return text


# Each shape's work is bounded in tests/test_safeyaml.py (events read, where a check stopped);
# here the command answers with the message and exit 2. A slow path would show as a slow suite,
# never as a flaky time limit.
@pytest.mark.parametrize("text, needle", [
    (_alias_bomb(), "aliases expand to more than"),
    ("region: &a [1, *a]\n", "an alias refers to the value that contains it"),
    ("region: " + "[" * 200_000 + "\n", "nested more than 64 levels deep"),
    ("region: " + "{" * 200_000 + "\n", "nested more than 64 levels deep"),
    ("region: " + "[" * 500 + "]" * 500 + "\n", "nested more than 64 levels deep"),
    ("".join(" " * i + f"k{i}:\n" for i in range(1_000)), "nested more than 64 levels deep"),  # 0.5 MB
    ("a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 10_000)),
     "aliases nest it more than 64 levels deep"),
], ids=["alias fan-out", "self alias", "deep [", "deep {", "deep [ closed", "deep block", "alias chain"])
def test_small_hostile_yaml_fails_fast_with_a_message(workdir, text, needle):
    (workdir / "moe-tpu.yaml").write_text(text)
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert needle in err and "moe-tpu.yaml" in err


def test_a_huge_file_of_comments_is_read_quickly(workdir):
    path = _config(workdir)
    text = path.read_text()
    path.write_text(("# " + "x" * 78 + "\n") * (20 * 1024 * 1024 // 80) + text)
    cfg = load_config(path)
    assert cfg.run == "moe-demo"


# --- 2. local state and out-of-range values are usage errors, not internal errors ------------

def test_a_duration_too_long_for_python_names_the_key(workdir):
    _config(workdir, slice__max_wait="99999999999h")
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert "moe-tpu.yaml: slice.max_wait: duration '99999999999h' is too long" in err


def test_state_dir_that_is_a_file_is_named_with_the_fix(workdir):
    _config(workdir)
    (workdir / ".moe-tpu").write_text("not a directory")
    code, out, err = invoke("--dry-run", "slice", "status")
    _no_traceback(code, err)
    assert ".moe-tpu is a file" in err and "move or delete" in err
    code, out, err = invoke("validate")  # read-only: needs no state directory
    assert code == 0, err


def test_garbage_in_the_remembered_config_is_named_with_the_fix(workdir):
    (workdir / ".moe-tpu").mkdir()
    (workdir / ".moe-tpu" / "last-config").write_bytes(b"\xff\xfe\x00garbage\x00\n")
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert "last-config" in err and "--config" in err


@contextlib.contextmanager
def unwritable(path: Path):
    """A directory nobody can write to: read-only bits, and for root (who ignores them, as CI runs)
    the immutable attribute."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True, capture_output=True)


def test_validate_works_in_a_directory_it_cannot_write(workdir):
    _config(workdir)
    with unwritable(workdir):
        with pytest.raises(OSError):
            (workdir / "probe").touch()  # the directory really is unwritable
        code, out, err = invoke("validate")
    assert code == 0, err
    assert not (workdir / ".moe-tpu").exists()


# --- 3. messages name the key that is wrong --------------------------------------------------

@pytest.mark.parametrize("changes, key", [
    ({"slice__count": 10**12}, "slice.count: must be between 1 and 256"),
    ({"slice__max_wait": "100000h"}, "slice.max_wait: duration '100000h' is too long"),
    ({"vertex__timeout": "9999h"}, "vertex.timeout: duration '9999h' is too long"),
    ({"dry_run": {"steps": 10**20}}, "dry_run.steps: must be between 1 and 2147483647"),  # the trainer's int32 step
])
def test_out_of_range_values_name_their_key_at_validate(workdir, changes, key):
    _config(workdir, **changes)
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert key in err and "does not render" not in err


def test_a_startup_script_over_the_metadata_limit_fails_validate(workdir):
    from provision.templates import builtin_templates_dir

    _config(workdir)
    mine = workdir / "templates"
    mine.mkdir()
    startup = (builtin_templates_dir() / "startup.sh.j2").read_text()
    (mine / "startup.sh.j2").write_text(startup + ("# " + "x" * 98 + "\n") * 3000)
    code, out, err = invoke("--templates", str(mine), "validate")
    _no_traceback(code, err)
    assert "startup script it renders is 303 KiB" in err and "at most 256 KiB" in err
    assert "startup.sh.j2" in err


def test_a_bad_environment_variable_is_named_not_the_flag(workdir):
    code, out, err = invoke("validate", env={"MOE_TPU_OUTPUT": "yaml"})
    assert code == 2
    assert "MOE_TPU_OUTPUT" in err and "'--output'" not in err


def test_stockout_hint_does_not_suggest_what_the_config_already_does(tmp_path):
    cfg = load_config(_config(tmp_path, zones=["us-west4-a"]))  # capacity: spot, one zone: no failover
    app = App(dry_run=True, scenario="stockout", output="json", workdir=tmp_path)
    try:
        with pytest.raises(StockoutError) as info:
            slice_up(app.context(cfg))
    finally:
        app.close()
    assert "capacity: spot" not in info.value.hint and "reservation" in info.value.hint


# --- 4. nothing silently accepted ------------------------------------------------------------

def test_scenario_without_dry_run_is_an_error(workdir):
    _config(workdir)
    code, out, err = invoke("--scenario", "stockout", "slice", "status")
    _no_traceback(code, err)
    assert "--scenario" in err and "--dry-run" in err


@pytest.mark.parametrize("changes, needle", [
    ({"slice__count": True}, "slice.count: must be an integer"),
    ({"recovery__max_restarts": False}, "recovery.max_restarts: must be an integer"),
    ({"zones": ["us-west4-a", "us-west4-a"]}, "zone 'us-west4-a' is listed twice"),
    ({"slice__capacity": "reserved", "slice__reservation": "r; rm -rf /"}, "slice.reservation: reservation"),
])
def test_values_that_were_silently_taken_are_errors(workdir, changes, needle):
    _config(workdir, **changes)
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert needle in err


# --- 5. an existing resource that no longer matches the config is not adopted -----------------

@pytest.mark.parametrize("changes, difference", [
    ({"slice__accelerator": "v5litepod-16", "trainer__mesh": "data=4,expert=4"},
     "accelerator is v5litepod-64 (the config asks for v5litepod-16)"),
    ({"slice__capacity": "on-demand"}, "capacity is spot (the config asks for on-demand)"),
    ({"slice__count": 2}, "slice count is 1 (the config asks for 2)"),
])
def test_slice_up_refuses_to_adopt_a_queued_resource_that_differs(tmp_path, changes, difference):
    app = App(dry_run=True, output="json", workdir=tmp_path)
    try:
        slice_up(app.context(load_config(_config(tmp_path))))
        changed = load_config(_config(tmp_path, **changes))
        with pytest.raises(CloudError) as info:
            slice_up(app.context(changed))
        recreated = slice_up(app.context(changed), recreate=True)
    finally:
        app.close()
    assert difference in info.value.message and "moe-tpu down" in info.value.hint
    assert info.value.exit_code == 1
    nodes = [r for r in recreated if r.kind == "node"]
    assert len(nodes) == changed.slice.count and {n.accelerator for n in nodes} == {changed.slice.accelerator}


def test_job_submit_refuses_to_follow_a_running_job_that_differs(tmp_path):
    app = App(dry_run=True, output="json", workdir=tmp_path)
    try:
        job_submit(app.context(load_config(_config(tmp_path, "vertex.yaml"))))
        changed = load_config(_config(tmp_path, "vertex.yaml", image__tag="v2"))
        with pytest.raises(CloudError) as info:
            job_submit(app.context(changed))
    finally:
        app.close()
    assert "image is" in info.value.message and ":v2)" in info.value.message
    assert "job cancel" in info.value.hint


# --- 7. Ctrl-C keeps its promises --------------------------------------------------------------

@pytest.mark.parametrize("example, args, marker", [
    ("v5e-64.yaml", ["slice", "up"], "creating queued resource"),
    ("vertex.yaml", ["job", "submit", "--wait"], "submitting custom job"),
])
def test_ctrl_c_prints_the_hint_and_a_json_document(tmp_path, example, args, marker):
    import signal
    import subprocess
    import sys

    _config(tmp_path, example)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_TPU_")}
    proc = subprocess.Popen([sys.executable, "-m", "provision", "--dry-run", "--scenario", "long-queue",
                             "--output", "json", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "NO_COLOR": "1"})
    seen = ""
    while marker not in seen:
        line = proc.stderr.readline()
        assert line, f"exited before {marker!r}: {seen}"
        seen += line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, seen + err
    assert "`moe-tpu --dry-run down`" in err and "Traceback" not in err  # a dry run's hint acts on the emulator
    doc = json.loads(out)
    assert doc["result"] == "interrupted" and doc["command"] == " ".join(args[:2])
    assert isinstance(doc["resources"], list)


# --- 8. gRPC core log lines stay off the console -----------------------------------------------

def test_a_busy_port_is_one_message_without_grpc_core_lines(tmp_path):
    import socket

    from tests.control.cli_helpers import run_process

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"GRPC_VERBOSITY": None}
        proc = run_process(["emulator", "serve", "--port", str(port)], cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: cannot bind the emulator to 127.0.0.1:{port}")
    assert "add_port.cc" not in proc.stderr


# --- 9. list without a config; emulator reset --------------------------------------------------

def test_list_without_a_config_says_what_it_needs_then_lists(workdir):
    code, out, err = invoke("--dry-run", "list")
    _no_traceback(code, err)
    assert "--project and --zone" in err
    _config(workdir)
    assert invoke("--dry-run", "slice", "up")[0] == 0
    (workdir / "moe-tpu.yaml").unlink()
    (workdir / ".moe-tpu" / "last-config").unlink()
    code, out, err = invoke("--dry-run", "--output", "json", "list", "--project", "my-project",
                            "--zone", "us-west4-a")
    assert code == 0, err
    kinds = sorted(r["kind"] for r in json.loads(out)["resources"])
    assert kinds == ["node", "queued_resource"]


def test_emulator_reset_clears_the_world(workdir):
    _config(workdir)
    assert invoke("--dry-run", "slice", "up")[0] == 0
    code, out, err = invoke("emulator", "reset")
    assert code == 0 and "emulated world cleared" in out, err
    code, out, err = invoke("--dry-run", "--output", "json", "slice", "status")
    assert code == 0 and json.loads(out)["resources"] == []


# --- 10. a run's lifecycle: teardown cut short, a lock held by a stuck command ----------------

def test_slice_up_after_a_teardown_cut_short_waits_it_out_and_creates_anew(tmp_path):
    from provision.kinds.tpu_vm.slices import queued_resource_name, slice_down, state_name

    cfg = load_config(_config(tmp_path))
    app = App(dry_run=True, output="json", workdir=tmp_path)
    try:
        session = app.session()
        slice_up(app.context(cfg))
        name = queued_resource_name(cfg, cfg.project, cfg.zones[0])
        session.tpu.delete_queued_resource(name, force=True)  # a kill during `down`: never waited for
        assert state_name(session.tpu.get_queued_resource(name)) == "DELETING"
        resources = slice_up(app.context(cfg))
        assert resources[0].state == "ACTIVE" and resources[0].name == name
        slice_down(app.context(cfg))
        session.tpu.delete_queued_resource(name, force=True) if session.tpu.get_queued_resource(name) else None
    finally:
        app.close()


def test_down_after_a_teardown_cut_short_ends_clean(workdir):
    _config(workdir)
    assert invoke("--dry-run", "slice", "up")[0] == 0
    cfg = load_config(workdir / "moe-tpu.yaml")
    app = App(dry_run=True, output="json", workdir=workdir)
    try:
        from provision.kinds.tpu_vm.slices import queued_resource_name

        app.session().tpu.delete_queued_resource(queued_resource_name(cfg, cfg.project, cfg.zones[0]), force=True)
    finally:
        app.close()
    code, out, err = invoke("--dry-run", "down")
    assert code == 0, err
    code, out, err = invoke("--dry-run", "--output", "json", "slice", "status")
    assert code == 0 and json.loads(out)["resources"] == []


def test_a_lock_held_by_a_stuck_command_is_named_at_once_and_given_up(workdir, monkeypatch):
    import fcntl

    from provision.emulator import store

    _config(workdir)
    (workdir / ".moe-tpu").mkdir()
    lock = workdir / ".moe-tpu" / "emulator.json.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    # A pid no process can have (past the kernel's largest): one that exists would be named with its command.
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    os.pwrite(fd, b"0" * store.TOKEN_BYTES + f"{pid}\n".encode(), 0)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a suspended `moe-tpu` holds mid-transaction
    monkeypatch.setattr(store, "LOCK_WAIT_S", 2.0)
    monkeypatch.setattr(store, "LOCK_NOTICE_S", 0.5)
    try:
        code, out, err = invoke("--dry-run", "slice", "status")
    finally:
        os.close(fd)
    _no_traceback(code, err, expected_code=1)
    assert f"waiting for another moe-tpu command (pid {pid}) that holds" in err and "emulator.json.lock" in err
    assert "gave up after 2s" in err
    assert invoke("--dry-run", "slice", "status")[0] == 0  # once it lets go, all is well


# Takes the world's lock as a moe-tpu command does (a token, then its pid), says so, and stops itself as Ctrl-Z
# would; once continued it holds the lock until killed.
_HOLD = """
import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, b"0" * 64 + f"{os.getpid():<15}\\n".encode(), 0)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(600)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_lock_held_by_a_stopped_command_is_given_up_at_once_naming_it_and_the_wait_is_bounded(workdir):
    """A command stopped with Ctrl-Z inside a transaction never lets go of the world's lock: the next one
    named its pid only and waited out a fixed minute. Now it names the command, sees that it is stopped and
    gives up at once (exit 1, how to resume it); a holder that runs is waited for MOE_TPU_LOCK_WAIT seconds."""
    import signal
    import sys
    import time

    _config(workdir)
    (workdir / ".moe-tpu").mkdir()
    lock = workdir / ".moe-tpu" / "emulator.json.lock"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        deadline = time.monotonic() + 10
        while _state(holder.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        code, out, err = invoke("--dry-run", "slice", "status", env={"MOE_TPU_LOCK_WAIT": "30"})
        took = time.monotonic() - started
        _no_traceback(code, err, expected_code=1)
        assert f"another moe-tpu command (pid {holder.pid}: python" in err and " -c " in err, err
        assert "is stopped (Ctrl-Z or SIGSTOP)" in err and f"kill -CONT {holder.pid}" in err and took < 15, err
        holder.send_signal(signal.SIGCONT)  # it runs now, and holds on
        code, out, err = invoke("--dry-run", "slice", "status", env={"MOE_TPU_LOCK_WAIT": "1"})
        _no_traceback(code, err, expected_code=1)
        assert f"gave up after 1s waiting for another moe-tpu command (pid {holder.pid}: python" in err, err
        code, out, err = invoke("--dry-run", "slice", "status", env={"MOE_TPU_LOCK_WAIT": "soon"})
        _no_traceback(code, err)
        assert "MOE_TPU_LOCK_WAIT=soon: give the seconds to wait for another command's lock" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert invoke("--dry-run", "slice", "status")[0] == 0  # once it is gone, all is well


# --- 11. caught at validate, not after provisioning --------------------------------------------

@pytest.mark.parametrize("changes, needle", [
    ({"trainer__mesh": "data=4,expert=4"}, "trainer.mesh: the trainer refuses it: mesh data=4,expert=4 covers "
                                           "16 chips, but the target (v5litepod-64) has 64"),
    ({"slice__count": 2}, "covers 64 chips, but the target (v5litepod-64 x 2) has 128"),
    ({"trainer__mesh": "data=8,pipe=8"}, "trainer.mesh: the trainer refuses it: mesh names an unknown axis 'pipe'"),
    ({"trainer__mesh": "data=1,expert=2,model=32"}, "trainer.mesh: the trainer refuses it: model.num_heads (16) "
                                                    "must be divisible by the mesh's model axis (32)"),
    ({"trainer__mesh": "data=4,expert=16", "trainer__overrides": {"moe.num_experts": 24}},
     "moe.num_experts (24) is not divisible by the mesh's expert axis (16)"),
    ({"dry_run": {"devices": 4, "mesh": "data=2,expert=4"}}, "dry_run.mesh: the trainer refuses it: mesh "
                                                            "data=2,expert=4 covers 8 chips, but dry_run.devices is 4"),
    ({"dry_run": {"trainer_config": "nosuch"}}, "dry_run.trainer_config: the trainer rejects it: unknown config"),
    ({"slice__network": "My Net"}, "slice.network: network 'My Net' is not a network name"),
    ({"slice__subnetwork": "sub net"}, "slice.subnetwork: subnetwork 'sub net' is not a subnetwork name"),
    ({"slice__service_account": "nobody"}, "slice.service_account: service account 'nobody' must be an email"),
    ({"trainer__steps": 10**22}, "trainer.steps: the trainer rejects it: steps must be at most 2,147,483,647 (the "
                                 "step counter is a 32-bit integer)"),
    ({"trainer__output_dir": "gs://"}, "trainer.output_dir: output_dir 'gs://' is not a Cloud Storage location"),
    ({"trainer__output_dir": "gs://My-Bucket/x"}, "output_dir 'gs://My-Bucket/x' is not a Cloud Storage location"),
    ({"trainer__output_dir": "gs://my bucket/a"}, "output_dir 'gs://my bucket/a' is not a Cloud Storage"),
    ({"trainer__overrides": {"data.path": "a\x00b"}}, "trainer.overrides.data.path: 'a\\x00b' holds a control"),
    ({"image__staging": "gs://my-bucket/\x1b[2J"}, "image.staging: 'gs://my-bucket/\\x1b[2J' holds a control"),
])
def test_mistakes_a_run_would_hit_after_provisioning_fail_validate_and_run(workdir, changes, needle):
    _config(workdir, **changes)
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert needle in err and "\x1b" not in err and "\x00" not in err
    code, out, err = invoke("--dry-run", "--output", "json", "run")
    _no_traceback(code, err)
    assert not any(c["rpc"].endswith("Create" + "QueuedResource") for c in json.loads(out)["calls"])


@pytest.mark.parametrize("output_dir", ["/", "/etc/moe", "/usr", "//", "/proc/self"])
def test_a_system_directory_is_no_output_dir(workdir, output_dir):
    _config(workdir, "local.yaml", trainer__output_dir=output_dir)
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert "is a system directory" in err
    _config(workdir, "local.yaml", trainer__output_dir="/mnt/moe")
    assert invoke("validate")[0] == 0


# --- 12. state files and what the user owns -------------------------------------------------------

def test_emulator_reset_deletes_only_an_emulated_world(workdir):
    config = _config(workdir)
    before = config.read_text()
    code, out, err = invoke("emulator", "reset", "--state", str(config))
    _no_traceback(code, err)
    assert "is not an emulated world" in err and config.read_text() == before


def test_emulator_reset_clears_the_dry_runs_too_and_says_so(workdir):
    _config(workdir)
    runs = workdir / ".moe-tpu" / "runs" / "moe-demo" / "output"
    runs.mkdir(parents=True)
    (runs / "status.json").write_text('{"state": "finished", "step": 40, "total_steps": 40}')
    code, out, err = invoke("emulator", "reset")
    assert code == 0, err
    assert "dry-run runs cleared: moe-demo" in out and not (workdir / ".moe-tpu" / "runs" / "moe-demo").exists()


@pytest.mark.parametrize("name", ["last-config", "emulator.json", "emulator.json.lock"])
def test_no_state_file_is_written_through_a_symlink(workdir, name):
    _config(workdir)
    victim = workdir / "precious.txt"
    victim.write_text("mine\n")
    (workdir / ".moe-tpu").mkdir()
    (workdir / ".moe-tpu" / name).symlink_to(victim)
    code, out, err = invoke("--dry-run", "slice", "status")
    assert victim.read_text() == "mine\n"
    assert "Traceback" not in err and "internal error" not in err
    assert f".moe-tpu/{name} is a symbolic link" in err
    if name != "last-config":  # the world or its lock: the command cannot go on (exit 2)
        assert code == 2, err


def test_render_out_never_writes_through_a_symlink(workdir):
    _config(workdir)
    victim = workdir / "precious.txt"
    victim.write_text("mine\n")
    out_dir = workdir / "rendered"
    out_dir.mkdir()
    (out_dir / "startup.sh").symlink_to(victim)
    code, out, err = invoke("render", "--out", str(out_dir))
    _no_traceback(code, err)
    assert "startup.sh is a symbolic link" in err and victim.read_text() == "mine\n"


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_render_out_that_is_a_fifo_or_a_device_is_named_and_never_offered_for_deletion(workdir, kind):
    _config(workdir)
    out = Path("/dev/null") if kind == "device" else workdir / "pipe"
    if kind == "fifo":
        os.mkfifo(out)
    code, out_text, err = invoke("render", "--out", str(out))
    _no_traceback(code, err)
    assert code == 2 and f"{out} is a {'FIFO' if kind == 'fifo' else 'device'}, not a directory" in err
    assert "delete" not in err


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_config_or_state_path_that_is_no_file_is_exit_2_naming_it(workdir, kind):
    path = workdir / "odd"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    code, out, err = invoke("validate", "-c", str(path))
    _no_traceback(code, err)
    assert str(path) in err and ("FIFO" in err or "device" in err or "directory" in err)
    code, out, err = invoke("emulator", "reset", "--state", str(path))
    _no_traceback(code, err)
    assert str(path) in err


@pytest.mark.parametrize("name", ["metrics.jsonl", "trainer.log", "status.json"])
def test_logs_refuses_a_fifo_in_the_runs_output_unopened(workdir, name):
    _config(workdir)
    output = workdir / ".moe-tpu" / "runs" / "moe-demo" / "output"
    output.mkdir(parents=True)
    os.mkfifo(output / name)  # opened, it would wait for a writer for ever
    code, out, err = invoke("--dry-run", "logs")
    _no_traceback(code, err)
    assert f"cannot read {output / name}: it is a FIFO, not a file" in err


def test_hints_of_a_dry_run_suggest_dry_run_commands(workdir):
    _config(workdir)
    assert invoke("--dry-run", "slice", "up")[0] == 0
    _config(workdir, slice__capacity="on-demand")
    code, out, err = invoke("--dry-run", "slice", "up")
    assert code == 1 and "`moe-tpu --dry-run down -c" in err and "`moe-tpu --dry-run slice up" in err, err


@pytest.mark.parametrize("changes, value", [
    ({"run": "a" * 5000}, "a"), ({"slice__network": "n" * 5000}, "n"), ({"trainer__" + "k" * 5000: 1}, "k"),
], ids=["run name", "network", "unknown key"])
def test_a_long_bad_value_is_named_not_printed_back(workdir, changes, value):
    _config(workdir, **changes)
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    key = next(iter(changes)).replace("__", ".")[:40]
    assert key in err and value * 250 not in err


def test_commands_that_only_read_leave_the_remembered_config_as_it_was(workdir):
    # `down` without --config after `slice up -c a.yaml` must find run a, whatever was looked at since.
    acting = _config(workdir, name="a.yaml", run="run-a")
    other = _config(workdir, name="b.yaml", run="run-b")
    remembered = workdir / ".moe-tpu" / "last-config"
    assert invoke("--dry-run", "slice", "status", "-c", str(acting))[0] == 0
    assert remembered.read_text().strip() == str(acting.resolve())
    for args in (["plan"], ["validate"], ["render", "--out", str(workdir / "rendered")], ["logs"], ["list"]):
        code, _, err = invoke("--dry-run", *args, "-c", str(other))
        assert code in (0, 1), (args, err)  # `logs` of a run that never started: exit 1, said so
        assert remembered.read_text().strip() == str(acting.resolve()), args


@pytest.mark.parametrize("example", ["serve-vertex.yaml", "serve-gke.yaml"])
def test_a_serve_max_len_whose_cache_fits_nowhere_is_refused_naming_the_key(workdir, example):
    """serve.max_len 10**9: the weights fit, their KV cache cannot; the refusal names the keys to lower. Past
    the server's int32 positions it is a config error naming the key."""
    config = _config(workdir, example, serve__max_len=10**9)
    code, out, err = invoke("--dry-run", "deploy", "-c", str(config))
    _no_traceback(code, err)
    assert "serve.max_len 1,000,000,000" in err and "lower serve.max_len or serve.slots" in err, err
    code, out, err = invoke("validate", "-c", str(_config(workdir, example, serve__max_len=2**31)))
    _no_traceback(code, err)
    assert "serve.max_len:" in err and "2147483646" in err, err


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' * 100_000 + "1" + "}" * 100_000])
def test_an_emulator_state_nested_too_deep_is_a_usage_error_naming_the_file(workdir, text):
    _config(workdir)
    (workdir / ".moe-tpu").mkdir()
    (workdir / ".moe-tpu" / "emulator.json").write_text(text)
    code, out, err = invoke("--dry-run", "slice", "status")
    _no_traceback(code, err)
    assert "emulator.json: it nests lists or objects deeper than a world this tool writes" in err, err


@pytest.mark.parametrize("keys, needle", [
    (150_000, "a config file is at most 1,048,576 (they are a few kilobytes)"),  # 2 MB of one flow mapping
    (50_000, "more problems past the first 50 (fix those first)"),  # 0.7 MB: read, its problems counted
])
def test_a_config_of_one_huge_flow_mapping_is_answered_at_once(workdir, keys, needle):
    """A message for each of 100,000 unknown keys (with its closest key) took minutes; a 50 MB file seemed to hang."""
    import time

    (workdir / "moe-tpu.yaml").write_text("{" + ", ".join(f"k{i}: {i}" for i in range(keys)) + "}\n")
    started = time.perf_counter()
    code, out, err = invoke("validate")
    _no_traceback(code, err)
    assert needle in err and time.perf_counter() - started < 20, err[-2000:]
    assert len(err.splitlines()) < 60
