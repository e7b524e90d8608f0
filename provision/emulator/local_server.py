"""The server of a dry run: the real `python -m trainer.serve`, run on this machine while an emulated model
is deployed (a Vertex AI endpoint's deployed model, a GKE Deployment's pod).

What a serving container does in the cloud, this does here: the emulated service hands over the container's
own argv and environment; the server listens on a free port of 127.0.0.1 instead of the container's, runs
on the CPU, adapted to this machine by the dry run's config where the command that deploys has one
(`adapt`, dry_run_adapter: the checkpoint mapped to the dry run's local output of that run). It runs detached, in its
own session: it outlives the `deploy` command, because `predict` and `down` are later commands, each
starting the emulator afresh from its state file. A record per server (pid, port, log path) under the
emulator's state directory lets any later command find it, forward requests to it and stop it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from provision.emulator.local_trainer import compilation_cache_env, process_runs
from trainer import signals
from trainer.outputs import Phase

SERVERS_DIR = "servers"
KILL_GRACE_S = 10.0
HEALTH_TIMEOUT_S = 2.0
FORWARD_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 12
GATE_WAIT_S = 0.25
# (argv, env) -> (argv, env): how the dry run's config makes the server small for this machine.
Adapt = Callable[[list[str], dict[str, str]], tuple[list[str], dict[str, str]]]


class ServerState(NamedTuple):
    """phase: starting (running, /health not 200 yet), ready (/health answers 200), failed (the process
    exited: `last_words` are the last lines of its log), or stopped (no server under that key)."""

    phase: str
    url: str | None
    last_words: str


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag value` set (replaced where present, else appended)."""
    out = list(argv)
    if flag in out[:-1]:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def flag_value(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    args = list(argv)
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def _safe(key: str) -> str:
    """A file name for a key (a resource name with slashes): its tail, readable, and a hash, unique."""
    tail = re.sub(r"[^A-Za-z0-9_.-]+", "-", key)[-40:].strip("-.")
    return f"{tail}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _alive(pid: int, port: int) -> bool:
    """Whether `pid` still runs a server on `port` (not a zombie, not a reused pid)."""
    return process_runs(pid, str(port))


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalServers:
    """The dry run's servers, one per key (the emulated resource that runs it), recorded under
    `state_dir`/servers/. Every method reads the records afresh: any command's emulator may ask."""

    def __init__(self, state_dir: str | Path, adapt: Adapt | None = None) -> None:
        self.dir = Path(state_dir) / SERVERS_DIR
        self.adapt = adapt
        self._children: dict[str, subprocess.Popen] = {}  # started here: polled, so that none is a zombie

    @staticmethod
    def free_port() -> int:
        """A port free on the loopback now (a multi-host group's JAX coordinator's, gke_lws.py)."""
        return free_port()

    # --- the emulated clock's gate (provision.clock.SimClock.gate) ---------------------------
    def active(self) -> bool:
        """Real time counts while a server is starting: its load and compile take what they take here."""
        return any(self.state(key).phase == Phase.STARTING for key in self.keys())

    def wait(self, seconds: float) -> None:
        signals.sleep(min(seconds, GATE_WAIT_S))  # a command's signal ends it at once

    def _path(self, key: str) -> Path:
        return self.dir / f"{_safe(key)}.json"

    def record(self, key: str) -> dict | None:
        try:
            record = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def keys(self) -> list[str]:
        """Every key with a record (a server running, or one that failed and was not stopped yet)."""
        found = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                key = json.loads(path.read_text()).get("key")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(key, str):
                found.append(key)
        return found

    def _running(self, record: dict) -> bool:
        child = self._children.get(record["key"])
        if child is not None and child.pid == record["pid"]:
            # Started here: its handle is the truth. Its command line is not: for a moment after Popen
            # returns the kernel may still be building the new program's (an empty /proc/PID/cmdline).
            return child.poll() is None
        return _alive(int(record["pid"]), int(record["port"]))

    def start(self, key: str, argv: list[str] | tuple[str, ...], env: dict[str, str], log_path: str | Path) -> None:
        """Start the server of `key` from its container's argv and environment (idempotent: one that runs
        already is kept)."""
        record = self.record(key)
        if record is not None and self._running(record):
            return
        port = free_port()
        command = [sys.executable if i == 0 and arg == "python" else arg for i, arg in enumerate(argv)]
        command = set_flag(set_flag(command, "--host", "127.0.0.1"), "--port", str(port))
        child_env = {**env, "AIP_HTTP_PORT": str(port)}
        if self.adapt is not None:
            command, child_env = self.adapt(command, child_env)
        full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **compilation_cache_env(os.environ), **child_env}
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=full_env, start_new_session=True)
        self._children[key] = proc
        from provision.statefiles import write_atomic

        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self._path(key), json.dumps({"key": key, "pid": proc.pid, "port": port, "log": str(log_path),
                                                  "argv": command}) + "\n")

    def state(self, key: str) -> ServerState:
        record = self.record(key)
        if record is None:
            return ServerState(Phase.STOPPED, None, "")
        url = f"http://127.0.0.1:{record['port']}"
        if not self._running(record):
            return ServerState(Phase.FAILED, url, log_tail(record["log"]) or "the server exited")
        try:
            status, _, _ = self._request(record, "GET", "/health", b"", timeout=HEALTH_TIMEOUT_S)
        except OSError:
            return ServerState(Phase.STARTING, url, "")
        return ServerState(Phase.READY if status == 200 else Phase.STARTING, url, "")

    def _request(self, record: dict, method: str, path: str, body: bytes, timeout: float, stream: bool = False):
        conn = http.client.HTTPConnection("127.0.0.1", int(record["port"]), timeout=timeout)
        try:
            conn.request(method, path, body=body or None, headers={"content-type": "application/json"})
            response = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        content_type = response.getheader("content-type", "application/octet-stream")
        if not stream:
            try:
                return response.status, content_type, response.read()
            finally:
                conn.close()
        return response.status, content_type, _chunks(conn, response)

    def forward(self, key: str, method: str, path: str, body: bytes, stream: bool = False):
        """One request to the server of `key`: (HTTP status, content type, the body, or with `stream` an
        iterator of its bytes as they come). OSError when no server answers."""
        record = self.record(key)
        if record is None or not self._running(record):
            raise ConnectionRefusedError(f"no server runs for {key}")
        return self._request(record, method, path, body, FORWARD_TIMEOUT_S, stream)

    def stop(self, key: str) -> bool:
        """SIGTERM, then SIGKILL after KILL_GRACE_S; the record removed. False when none ran. Never waits
        unbounded: it runs inside the emulator's transaction, and every API call waits on that."""
        record, child = self.record(key), self._children.pop(key, None)
        if record is None and child is None:
            return False
        if child is not None:  # started here: signalled through its handle (no pid reuse until it is reaped)
            ran = child.poll() is None
            if ran:
                child.terminate()
                try:
                    child.wait(KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait(KILL_GRACE_S)
        else:  # started by another command: its pid, checked against its port
            pid, port = int(record["pid"]), int(record["port"])
            ran = _alive(pid, port)
            if ran:
                _signal(pid, signal.SIGTERM)
                deadline = time.monotonic() + KILL_GRACE_S
                while _alive(pid, port) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _alive(pid, port):
                    _signal(pid, signal.SIGKILL)
        self._path(key).unlink(missing_ok=True)
        return ran


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _chunks(conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> Iterator[bytes]:
    try:
        while chunk := response.read1(65536):
            yield chunk
    finally:
        conn.close()


def dry_run_adapter(cfg, state_dir: str | Path) -> Adapt:
    """How the dry run of `cfg` runs a server here: a checkpoint in Cloud Storage that is a run's output
    (the config's own trainer.output_dir, or a path whose last part names a run this directory trained)
    becomes that run's local output (local_trainer.local_output_dir); a local checkpoint is served as it
    is. The server runs on one CPU device, as `moe-tpu sample` does, so that a greedy prediction of the
    dry run is token for token the one `sample` gives for the checkpoint (and it compiles fastest): the
    replica's --mesh (its chips, the cloud's) becomes that one device's, as dry_run.mesh shrinks training's. A
    LeaderWorkerSet group's processes (LWS_GROUP_SIZE > 1) have one device each, the mesh expert=N over them;
    a Pathways leader's server runs on this machine's CPU, as its one controller (no proxy is played)."""
    from provision.emulator.local_trainer import local_output_dir
    from trainer.meshspec import text_of

    def adapt(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        checkpoint = flag_value(argv, "--checkpoint")
        if checkpoint is not None and checkpoint.startswith("gs://"):
            path = checkpoint.rstrip("/")
            run = cfg.run if path == cfg.trainer.output_dir.rstrip("/") else path.rsplit("/", 1)[-1]
            argv = set_flag(argv, "--checkpoint", str(local_output_dir(Path(state_dir).resolve(), run)))
        if env.get("JAX_PLATFORMS") == "proxy":  # a Pathways leader's server: no proxy here, this CPU instead
            env = {k: v for k, v in env.items() if k not in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET")}
        group = int(env.get("LWS_GROUP_SIZE") or 1)
        if group > 1:  # a LeaderWorkerSet's group (emulator/gke_lws.py): one CPU device per process, the
            # mesh over the group's devices on the expert axis (the same sums as one device's: `sample`'s tokens)
            env = {**env, "MOE_SERVE_LOCAL_DEVICES": "1"}
            return set_flag(set_flag(argv, "--mesh", text_of(1, group)), "--devices", str(group)), env
        if flag_value(argv, "--mesh") is not None:  # the replica's mesh, made one device's like the dry run's
            argv = set_flag(argv, "--mesh", text_of(1, 1))
        return set_flag(argv, "--devices", "1"), env

    return adapt
