"""The TPU VM startup script: shellcheck, quoting, what the container gets, and the watcher that
turns the trainer's status file into guest attributes (run for real against a loopback server
that answers as the metadata server does)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from provision import guest_attributes, rendering
from provision.config import config_from_dict, load_config
from provision.container import TRAINER_COMMAND
from provision.context import renderer_for
from provision.core import report_from_status
from tests.control import render_calls as calls

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NASTY = "$(touch /tmp/moe-pwned) `id` 'single' \"double\" spaces;&| \\ $HOME *"


def tool(name: str) -> str:
    """A linter installed by the test extra: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]' installs it"
    return found


def cfg_with(example: str = "v5e-64.yaml", **trainer):
    raw = yaml.safe_load((EXAMPLES / example).read_text())
    raw["trainer"].update(trainer)
    return config_from_dict(raw)


def shellcheck(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("shellcheck"), "--shell=bash", "--severity=style", "--norc", "-"],
                          input=script, capture_output=True, text=True)


@pytest.mark.parametrize("cfg", [
    pytest.param(lambda: load_config(EXAMPLES / "v5e-64.yaml"), id="v5e-64"),
    pytest.param(lambda: load_config(EXAMPLES / "local.yaml"), id="local-relative-output"),
    pytest.param(lambda: cfg_with("local.yaml", output_dir="/mnt/disks/ckpt/run 1"), id="absolute-output"),
    pytest.param(lambda: cfg_with("local.yaml", config=NASTY, output_dir=f"/tmp/{NASTY}", overrides={"a.b": NASTY}),
                 id="nasty"),
])
def test_shellcheck_has_nothing_to_say(cfg):
    loaded = cfg()
    result = shellcheck(calls.startup_script(loaded, renderer_for(loaded)))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_shellcheck_does_find_problems():
    """The check above could fail: shellcheck reports an unquoted variable."""
    result = shellcheck("#!/bin/bash\nrm $1\n")
    assert result.returncode == 1 and "SC2086" in result.stdout


def docker_run_args(script: str, **env: str) -> list[str]:
    """The arguments bash really passes to `docker run` in the script."""
    start = script.index("\ndocker run ") + 1
    end = script.index("\nnohup docker logs ", start)
    command = script[start:end].replace("docker run ", "printf '%s\\0' ", 1)
    prelude = "device_groups=(--group-add 44)\n"
    variables = {"PATH": os.environ["PATH"], "CONTAINER": "c", "RUN": "r", "IMAGE": "img:v1",
                 "STATE_DIR": "/var/lib/moe-tpu", "WORK_DIR": "/var/lib/moe-tpu/work", **env}
    out = subprocess.run(["bash", "-c", prelude + command], env=variables, capture_output=True, check=True).stdout
    return out.decode().split("\0")[:-1]


def test_the_container_gets_the_trainer_arguments_intact():
    cfg = cfg_with(config=NASTY, output_dir=f"gs://bucket/{NASTY}", overrides={"model.note": NASTY})
    script = calls.startup_script(cfg, renderer_for(cfg))
    args = docker_run_args(script)
    after_image = args[args.index("img:v1") + 1:]
    # The image's entry point is the trainer command: together they are trainer_argv.
    assert list(TRAINER_COMMAND) + after_image == rendering.trainer_argv(
        cfg, status_file="/var/lib/moe-tpu/status.json")
    pairs = list(zip(after_image, after_image[1:], strict=False))
    for pair in [("--config", NASTY), ("--output-dir", f"gs://bucket/{NASTY}"), ("--resume", "auto"),
                 ("--status-file", "/var/lib/moe-tpu/status.json"), ("--set", f"model.note={NASTY}")]:
        assert pair in pairs
    assert not Path("/tmp/moe-pwned").exists()


def test_what_the_container_gets_besides():
    loaded = load_config(EXAMPLES / "v5e-64.yaml")
    args = docker_run_args(calls.startup_script(loaded, renderer_for(loaded)))
    before_image = args[:args.index("img:v1")]
    assert before_image == [
        "--detach", "--name", "c", "--net=host", "--privileged", "--group-add", "44",
        "--volume", "/var/lib/moe-tpu:/var/lib/moe-tpu", "--workdir", "/var/lib/moe-tpu/work",
        "--label", "managed-by=moe-tpu", "--label", "moe-tpu-run=moe-demo", "--env", "MOE_TPU_RUN=r"]


def test_a_local_output_dir_outlives_the_container():
    # Relative (examples/local.yaml: runs/moe-local): under the mounted working directory.
    loaded = load_config(EXAMPLES / "local.yaml")
    script = calls.startup_script(loaded, renderer_for(loaded))
    args = docker_run_args(script)
    assert args[args.index("--workdir") + 1] == "/var/lib/moe-tpu/work"
    assert args[args.index("--output-dir") + 1] == "runs/moe-local"
    assert "OUTPUT_DIR=" not in script
    # Absolute: mounted at the same path, and owned by the trainer's user.
    loaded = cfg_with("local.yaml", output_dir="/mnt/disks/ckpt/run 1")
    script = calls.startup_script(loaded, renderer_for(loaded))
    assert "OUTPUT_DIR='/mnt/disks/ckpt/run 1'\n" in script
    assert 'chown "$TRAINER_UID:$TRAINER_UID" "$OUTPUT_DIR"' in script
    args = docker_run_args(script, OUTPUT_DIR="/mnt/disks/ckpt/run 1")
    assert args[args.index("--volume", args.index("--volume") + 1) + 1] == "/mnt/disks/ckpt/run 1:/mnt/disks/ckpt/run 1"


def test_script_shape():
    loaded = load_config(EXAMPLES / "v5e-64.yaml")
    script = calls.startup_script(loaded, renderer_for(loaded))
    for line in ["STATE_DIR=/var/lib/moe-tpu", "STATUS_FILE=/var/lib/moe-tpu/status.json",
                 "IMAGE=us-west4-docker.pkg.dev/my-project/moe/trainer:v1", "TRAINER_UID=1000",
                 'rm -f "$STATUS_FILE"', 'nohup python3 "$WATCHER" "$STATUS_FILE" 10 docker wait "$CONTAINER" '
                 '>>"$LOG" 2>&1 &']:
        assert line in script.splitlines()


# --- the watcher --------------------------------------------------------------------------------

def watcher_source() -> str:
    loaded = load_config(EXAMPLES / "v5e-64.yaml")
    script = calls.startup_script(loaded, renderer_for(loaded))
    start = script.index("<<'WATCHER_PY'\n") + len("<<'WATCHER_PY'\n")
    return script[start:script.index("\nWATCHER_PY\n", start)]


class MetadataServer:
    """Answers guest-attribute PUTs as the metadata server does; keeps what was set, in order."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, str]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802 - the stdlib's name
                prefix = "/computeMetadata/v1/instance/guest-attributes/moe-tpu/"
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                ok = self.path.startswith(prefix) and self.headers.get("Metadata-Flavor") == "Google"
                if ok:
                    server.puts.append((self.path[len(prefix):], body))
                self.send_response(200 if ok else 403)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def attributes(self) -> dict[str, str]:
        return dict(self.puts)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def metadata():
    server = MetadataServer()
    yield server
    server.close()


def run_watcher(tmp_path: Path, metadata: MetadataServer, exit_code: int, statuses: list[dict]) -> str:
    """Run the watcher while a stand-in for `docker wait` writes `statuses` and prints `exit_code`."""
    (tmp_path / "watch.py").write_text(watcher_source())
    status_file = tmp_path / "status.json"
    writer = (
        "import json, os, sys, time\n"
        f"for status in json.loads({json.dumps(json.dumps(statuses))}):\n"
        f"    tmp = {str(status_file)!r} + '.tmp'\n"
        "    open(tmp, 'w').write(json.dumps(status)); os.replace(tmp, " f"{str(status_file)!r})\n"
        "    time.sleep(0.15)\n"
        f"print({exit_code})\n")
    env = {**os.environ, "GCE_METADATA_HOST": metadata.host}
    result = subprocess.run([sys.executable, str(tmp_path / "watch.py"), str(status_file), "0.02",
                             sys.executable, "-c", writer], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def status(state: str, step: int, loss: float | None, exit_code: int | None = None) -> dict:
    return {"state": state, "step": step, "total_steps": 20, "start_step": 10, "loss": loss,
            "tokens_per_s": 100.0, "time": 1700000000 + step, "exit_code": exit_code, "error": None}


@pytest.mark.parametrize("code, final", [(0, "finished"), (143, "stopped"), (1, "failed"), (137, "failed")])
def test_watcher_sets_the_guest_attributes(tmp_path, metadata, code, final):
    out = run_watcher(tmp_path, metadata, code, [status("starting", 10, None), status("running", 15, 2.5)])
    expected = {"state": final, "step": "15", "total-steps": "20", "start-step": "10", "loss": "2.5",
                "tokens-per-s": "100.0", "exit-code": str(code), "updated": metadata.attributes["updated"]}
    if final == "failed":  # the container's last words (none here: no docker), else the exit code
        expected["error"] = f"exit code {code}"
    assert metadata.attributes == expected
    assert int(metadata.attributes["updated"]) >= 1700000015
    states = [value for key, value in metadata.puts if key == "state"]
    assert states == ["starting", "running", final]
    assert f"exited with {code}: {final}" in out


def test_a_real_slice_reports_tokens_per_s_as_the_dry_run_does(tmp_path, metadata):
    """What the watcher publishes reads back with tokens/s (the progress line's figure and the ETA's
    companion), and the emulator's local trainer publishes the very same keys."""
    run_watcher(tmp_path, metadata, 0, [status("running", 15, 2.5)])
    published = [value for key, value in metadata.puts if key == "tokens-per-s"]
    assert published == ["100.0"]
    assert report_from_status(metadata.attributes).tokens_per_s == 100.0
    keys = {key for key, _ in metadata.puts} - {"updated"}
    assert keys == {guest_attributes.key(f) for f in guest_attributes.FIELDS} - {"error"}


def test_watcher_reports_failed_when_the_wait_itself_fails(tmp_path, metadata):
    (tmp_path / "watch.py").write_text(watcher_source())
    env = {**os.environ, "GCE_METADATA_HOST": metadata.host}
    subprocess.run([sys.executable, str(tmp_path / "watch.py"), str(tmp_path / "none.json"), "0.02",
                    sys.executable, "-c", "import sys; sys.exit(1)"], env=env, check=True, timeout=60)
    assert metadata.attributes.keys() == {"state", "error", "updated"} and metadata.attributes["state"] == "failed"


def test_watcher_survives_a_missing_metadata_server(tmp_path):
    (tmp_path / "watch.py").write_text(watcher_source())
    env = {**os.environ, "GCE_METADATA_HOST": "127.0.0.1:9"}  # nothing listens on the discard port
    result = subprocess.run([sys.executable, str(tmp_path / "watch.py"), str(tmp_path / "s.json"), "0.02",
                             sys.executable, "-c", "print(0)"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    assert "cannot set guest attribute state" in result.stderr
