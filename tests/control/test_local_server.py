"""The dry run's server runner (provision/emulator/local_server.py): a detached process found again from its
record by another instance (as a later command's emulator does), forwarding, streaming, last words, stop."""

import json
import time
from pathlib import Path

from provision.emulator.local_server import LocalServers, dry_run_adapter, flag_value

FAKE = str(Path(__file__).with_name("fake_server.py"))


def _wait(servers: LocalServers, key: str) -> tuple:
    deadline = time.monotonic() + 120  # a loaded machine starts Python slowly
    while (state := servers.state(key)).phase == "starting" and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


def test_a_server_outlives_its_starter_and_is_found_forwarded_to_and_stopped(tmp_path):
    first = LocalServers(tmp_path)
    first.start("projects/p/locations/r/endpoints/1/deployedModels/2", ["python", FAKE, "--host", "0.0.0.0",
                "--port", "8080"], {"X": "1"}, tmp_path / "server.log")
    key = "projects/p/locations/r/endpoints/1/deployedModels/2"
    later = LocalServers(tmp_path)  # another command: only the record tells it where the server is
    phase, url, last_words = _wait(later, key)
    assert phase == "ready" and url.startswith("http://127.0.0.1:") and not url.endswith(":8080"), last_words
    assert later.keys() == [key]
    status, ctype, body = later.forward(key, "POST", "/v1/completions", json.dumps({"prompt": "a b"}).encode())
    assert status == 200 and ctype == "application/json" and json.loads(body)["choices"][0]["text"] == "a b"
    status, ctype, chunks = later.forward(key, "POST", "/v1/completions",
                                          json.dumps({"prompt": "a b", "stream": True}).encode(), stream=True)
    text = b"".join(chunks).decode()
    assert status == 200 and ctype == "text/event-stream" and text.endswith("data: [DONE]\n\n") and '"b"' in text
    first.start(key, ["python", FAKE, "--port", "1"], {}, tmp_path / "other.log")  # already runs: kept
    assert later.state(key).url == url
    assert later.stop(key) is True and later.state(key).phase == "stopped" and later.keys() == []
    assert later.stop(key) is False  # idempotent


def test_a_server_that_exits_fails_with_its_last_words(tmp_path):
    servers = LocalServers(tmp_path)
    servers.start("k", ["python", FAKE, "--fail"], {}, tmp_path / "server.log")
    phase, _, last_words = _wait(servers, "k")
    assert phase == "failed" and "checkpoint is of another model" in last_words
    assert servers.stop("k") is False and servers.keys() == []


def test_the_dry_run_serves_the_local_output_of_the_run(tmp_path):
    from provision.config import load_config
    from provision.container import server_container

    cfg = load_config(Path(__file__).parents[2] / "examples" / "v5e-64.yaml")
    argv = list(server_container(cfg, "image").argv)
    adapted, _ = dry_run_adapter(cfg, tmp_path)(argv, {})
    assert flag_value(adapted, "--checkpoint") == str(tmp_path.resolve() / "runs" / cfg.run / "output")
    other, _ = dry_run_adapter(cfg, tmp_path)(["--checkpoint", "gs://b/runs/other-run"], {})
    assert flag_value(other, "--checkpoint") == str(tmp_path.resolve() / "runs" / "other-run" / "output")
    assert dry_run_adapter(cfg, tmp_path)(["--checkpoint", "/data/x"], {})[0] == ["--checkpoint", "/data/x",
                                                                                 "--devices", "1"]


def test_emulator_reset_stops_the_model_servers_of_the_world(tmp_path):
    from tests.control.cli_helpers import invoke

    servers = LocalServers(tmp_path)
    servers.start("k", ["python", FAKE, "--host", "0.0.0.0"], {}, tmp_path / "server.log")
    assert _wait(servers, "k").phase == "ready"
    code, out, _ = invoke("emulator", "reset", "--state", str(tmp_path / "emulator.json"))
    assert code == 0 and "model servers stopped: 1" in out
    assert servers.keys() == [] and servers.state("k").phase == "stopped"


def test_a_server_started_here_is_judged_by_its_handle_not_by_proc(tmp_path, monkeypatch):
    """Just after Popen returns, the kernel may still be building the program's /proc/PID/cmdline (empty):
    a server started here is not taken for dead then, and stopping it cannot wait forever."""
    from provision.emulator import local_server

    servers = LocalServers(tmp_path)
    servers.start("k", ["python", FAKE, "--host", "0.0.0.0", "--port", "8080"], {}, tmp_path / "server.log")
    monkeypatch.setattr(local_server, "_alive", lambda pid, port: False)  # what an empty cmdline says
    assert _wait(servers, "k").phase == "ready"
    pid = servers.record("k")["pid"]
    assert servers.stop("k") is True and servers.keys() == []
    monkeypatch.undo()
    assert not local_server._alive(pid, 0)
