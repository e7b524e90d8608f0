"""The serving engine across the processes of a multi-host group (a GKE LeaderWorkerSet's pods, the
emulator's local processes, or any processes given the same environment).

Every process loads the checkpoint, holding its shards of the weights and the KV cache on one mesh over all
processes' devices, and runs the same compiled steps in the same order: a step's collectives span the
processes, so each must be called everywhere with the same inputs. Process 0, the leader, serves HTTP and runs
the scheduler; before each program call its runner hands the call (the program's name and its host arrays:
tokens, positions, slots, sampling rows, whatever a program takes) to the workers, which run it and wait for
the next. Outputs are replicated, so every process holds the sampled tokens and only the leader reads them.

The channel is a TCP connection from each worker to the leader, not jax's broadcast_one_to_all a step: a
broadcast is a collective (it blocks forever when a peer is gone, and compiles for every new shape), where a
socket reports a dead peer as end-of-file at once. The leader listens on a free port, which it gives the
workers in one broadcast at start-up, until every worker has joined. Frames are a JSON header and the
arrays' raw bytes (never pickle: nothing received is executed). Workers send a heartbeat byte a second;
the leader's watchdog takes end-of-file, an error or HEARTBEAT_SILENCE_S of silence as the group failing.
A heartbeat shows a process alive, not stepping: a worker that stops stepping (or a leader whose own step
failed after its workers were handed the call) leaves the others waiting in a collective, so the watchdog
also asks the engine whether its step is stuck (trainer.serve.loop: no step completed for --step-timeout
seconds), and a step that raises on the leader fails the group too. On any of these its owner
(trainer/serve/cli.py) fails the requests, answers 503 on /health and exits non-zero: a step blocked in a
collective never returns, so nothing waits for it. A worker exits 0 when the leader says stop, non-zero
when its own step fails or the leader goes away.

Under Pathways (JAX_PLATFORMS=proxy) one controller drives the whole slice: no group, no channel.

The group's environment, as a LeaderWorkerSet sets it (README: Serving):
  LWS_GROUP_SIZE          processes in the group; 1 or unset: one process
  LWS_WORKER_INDEX        0 for the leader, 1.. for the workers
  LWS_LEADER_ADDRESS      the leader's address (no port)
  JAX_COORDINATOR_ADDRESS HOST:PORT of jax.distributed's coordinator [LWS_LEADER_ADDRESS:8476]
  MOE_SERVE_LOCAL_DEVICES CPU only: fake XLA devices of this process
  MOE_SERVE_FAULT         tests only: hold:PATH or fail:PATH, this process's next program call, once PATH
                          exists, holds for ever (its heartbeat going on) or raises (the leader's after
                          handing it to the workers)
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

COORDINATOR_PORT = 8476  # jax.distributed's usual coordinator port
CONNECT_TIMEOUT_S = 120.0  # workers joining the leader's channel after loading the checkpoint
HEARTBEAT_S = 1.0
HEARTBEAT_SILENCE_S = 10.0  # a worker silent this long is gone (a host that vanished sends no end-of-file)
STOP_TIMEOUT_S = 30.0
_FRAME = struct.Struct("!II")  # header bytes, payload bytes


@dataclasses.dataclass(frozen=True)
class Group:
    """This process's place in a multi-host serving group."""

    size: int
    index: int
    coordinator: str  # HOST:PORT
    leader: str  # the leader's address, where workers reach its channel
    local_devices: int | None = None  # CPU only: fake devices of this process

    @property
    def is_leader(self) -> bool:
        return self.index == 0


def group_of(env: Mapping[str, str]) -> Group | None:
    """The group the environment describes, or None for one process (also under Pathways, where one
    controller drives the slice). A ValueError names the variable that is wrong."""
    if "proxy" in env.get("JAX_PLATFORMS", "").split(","):
        return None
    size = _count(env, "LWS_GROUP_SIZE", 1)
    if size <= 1:
        return None
    index = _count(env, "LWS_WORKER_INDEX", None, low=0)
    if index >= size:
        raise ValueError(f"LWS_WORKER_INDEX={index} must be below LWS_GROUP_SIZE={size}")
    leader = env.get("LWS_LEADER_ADDRESS", "").strip()
    coordinator = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
    if not leader and not coordinator:
        raise ValueError("LWS_GROUP_SIZE > 1 needs LWS_LEADER_ADDRESS (the leader's address) or "
                         "JAX_COORDINATOR_ADDRESS=HOST:PORT")
    if coordinator and (":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit()):
        raise ValueError(f"JAX_COORDINATOR_ADDRESS must be HOST:PORT, got {coordinator!r}")
    coordinator = coordinator or f"{leader}:{COORDINATOR_PORT}"
    local = _count(env, "MOE_SERVE_LOCAL_DEVICES", None) if env.get("MOE_SERVE_LOCAL_DEVICES") else None
    return Group(size, index, coordinator, leader or coordinator.rsplit(":", 1)[0], local)


def _count(env: Mapping[str, str], name: str, default: int | None, low: int = 1) -> int:
    text = env.get(name, "").strip()
    if not text and default is not None:
        return default
    if not text.isdigit() or int(text) < low:
        raise ValueError(f"{name} must be a whole number of at least {low}, got {text!r}")
    return int(text)


def local_device_count(group: Group, devices: int | None) -> int | None:
    """Fake CPU devices for this process: MOE_SERVE_LOCAL_DEVICES, else `--devices` (the group's total)
    shared evenly; None leaves the platform's own. A ValueError says what does not add up."""
    if devices is None:
        return group.local_devices
    if group.local_devices is not None and group.local_devices * group.size != devices:
        raise ValueError(f"--devices {devices} is the group's total, but MOE_SERVE_LOCAL_DEVICES="
                         f"{group.local_devices} x LWS_GROUP_SIZE={group.size} is {group.local_devices * group.size}")
    if devices % group.size:
        raise ValueError(f"--devices {devices} must split evenly over LWS_GROUP_SIZE={group.size} processes")
    return devices // group.size


joined = False  # this process started jax.distributed for a group (`start`)


def start(group: Group) -> None:
    """jax.distributed for the group (before anything touches a backend); on CPU its collectives are gloo's."""
    import jax

    global joined
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A process gone before the channel watches it (while loading), or the coordinator gone, ends the
    # others' waits within a minute (jax's default: 100 s); a jax without the setting keeps its own.
    timeouts = {"heartbeat_timeout_seconds": 60}
    if "heartbeat_timeout_seconds" not in inspect.signature(jax.distributed.initialize).parameters:
        timeouts = {}
    jax.distributed.initialize(group.coordinator, group.size, group.index, **timeouts)
    joined = True


# ---------------------------------------------------------------------- frames


def encode(op: str, name: str = "", inputs: tuple = ()) -> bytes:
    """A frame: the op, the program's name, and `inputs` (tuples, lists and dicts of arrays, nested) as a
    JSON structure whose leaves index the arrays that follow as raw bytes."""
    arrays: list[np.ndarray] = []

    def shape_of(x):
        if isinstance(x, (tuple, list)):
            return {"seq": [shape_of(v) for v in x]}
        if isinstance(x, dict):
            return {"map": {k: shape_of(v) for k, v in x.items()}}
        a = np.asarray(x, order="C")
        arrays.append(a)
        return {"array": [a.dtype.str, list(a.shape)]}

    header = json.dumps({"op": op, "name": name, "inputs": shape_of(tuple(inputs))}).encode()
    payload = b"".join(a.tobytes() for a in arrays)
    return _FRAME.pack(len(header), len(payload)) + header + payload


def decode(frame_header: bytes, payload: bytes) -> tuple[str, str, tuple]:
    """(op, name, inputs) of a frame `encode` made (a ValueError for anything else)."""
    at = 0

    def build(node):
        nonlocal at
        if "seq" in node:
            return tuple(build(v) for v in node["seq"])
        if "map" in node:
            return {k: build(v) for k, v in node["map"].items()}
        dtype, shape = np.dtype(node["array"][0]), tuple(int(n) for n in node["array"][1])
        count = int(np.prod(shape, dtype=np.int64))
        a = np.frombuffer(payload, dtype, count=count, offset=at).reshape(shape)
        at += dtype.itemsize * count
        return a

    try:
        header = json.loads(frame_header)
        return str(header["op"]), str(header["name"]), build(header["inputs"])
    except (KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"not a frame of the group's channel ({type(e).__name__}: {e})") from None


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int | None = None) -> tuple[str, str, tuple] | None:
    """The next frame from `sock`, or None at end-of-file; a ValueError when it is not one `encode` made (or
    is larger than `limit` bytes)."""
    sizes = _read_exactly(sock, _FRAME.size)
    if sizes is None:
        return None
    header_bytes, payload_bytes = _FRAME.unpack(sizes)
    if limit is not None and header_bytes + payload_bytes > limit:
        raise ValueError(f"a frame of {header_bytes + payload_bytes} bytes, past {limit}")
    header, payload = _read_exactly(sock, header_bytes), _read_exactly(sock, payload_bytes)
    if header is None or payload is None:
        return None
    return decode(header, payload)


def _exchange_port(port: int) -> int:
    """The leader's channel port, from the leader to every process (one collective at start-up, which also
    shows that the group's collectives work before the checkpoint's steps need them)."""
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(port)))


# ---------------------------------------------------------------------- the leader


class Leader:
    """The leader's end of the channel: hands each program call to the workers (`mirror`, the runner's
    `on_call`), watches them (a thread), tells them to stop. `on_failure(reason)` is called once, on the
    watchdog's thread, when a worker is gone while the group serves, or when `stuck()` (set by the owner:
    the engine's loop) gives a reason."""

    def __init__(self, group: Group, on_failure: Callable[[str], None] | None = None):
        self.group, self.on_failure = group, on_failure
        self.stuck: Callable[[], str | None] | None = None
        self._fault = fault_of(os.environ)
        self.workers: dict[int, socket.socket] = {}
        self.stopping = threading.Event()
        self.failed: str | None = None
        self._closed: set[int] = set()
        self._all_closed = threading.Event()

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> Leader:
        """Waits for every worker to join; then the watchdog starts."""
        server = socket.create_server(("", 0), backlog=self.group.size)
        try:
            _exchange_port(server.getsockname()[1])
            server.settimeout(timeout)
            while len(self.workers) < self.group.size - 1:
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self.group.size)) - set(self.workers))
                    raise RuntimeError(f"worker(s) {missing} did not join the leader's channel within "
                                       f"{timeout:g} s") from None
                index = self._hello(sock, timeout)
                if index is None:  # not one of the group's workers: not let in
                    sock.close()
                    continue
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.workers[index] = sock
        finally:
            server.close()
        threading.Thread(target=self._watch, name="moe-tpu-group-watchdog", daemon=True).start()
        return self

    def _hello(self, sock: socket.socket, timeout: float) -> int | None:
        """The worker index a joining process gives, or None when it gives none the group is waiting for."""
        sock.settimeout(timeout)
        try:
            frame = read_frame(sock, limit=4096)
        except (OSError, ValueError):
            return None
        if frame is None or frame[0] != "hello" or len(frame[2]) != 1 or np.shape(frame[2][0]) != ():
            return None
        index = int(frame[2][0])
        return index if 0 < index < self.group.size and index not in self.workers else None

    def mirror(self, name: str, inputs: tuple) -> None:
        """Sends the program call to every worker (the engine's thread, before it runs the call itself)."""
        if self.failed:
            raise RuntimeError(self.failed)
        frame = encode("call", name, inputs)
        for index, sock in self.workers.items():
            try:
                sock.sendall(frame)
            except OSError as e:
                raise RuntimeError(f"worker {index} of the serving group is gone ({e.strerror or e})") from None
        if self._fault is not None:
            self._fault()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Tells the workers to stop; True when each closed its end within `timeout`."""
        self.stopping.set()
        for sock in self.workers.values():
            try:
                sock.sendall(encode("stop"))
            except OSError:
                pass
        return self._all_closed.wait(timeout) if self.workers else True

    def _watch(self) -> None:
        seen = {index: time.monotonic() for index in self.workers}
        by_socket = {sock: index for index, sock in self.workers.items()}
        while len(self._closed) < len(self.workers):
            open_ = [s for s, i in by_socket.items() if i not in self._closed]
            ready, _, _ = select.select(open_, [], [], HEARTBEAT_S)
            now = time.monotonic()
            for sock in ready:
                index = by_socket[sock]
                try:
                    data = sock.recv(4096)
                except OSError as e:
                    data, error = b"", e.strerror or str(e)
                else:
                    error = "its connection closed"
                if data:
                    seen[index] = now
                    continue
                self._closed.add(index)
                if not self.stopping.is_set():
                    return self._fail(f"worker {index} of the serving group stopped ({error})")
            silent = [i for i, t in seen.items() if i not in self._closed and now - t > HEARTBEAT_SILENCE_S]
            if silent and not self.stopping.is_set():
                return self._fail(f"worker {silent[0]} of the serving group sent nothing for "
                                  f"{HEARTBEAT_SILENCE_S:g} s")
            stuck = self.stuck() if self.stuck is not None and not self.stopping.is_set() else None
            if stuck:
                return self._fail(f"the serving group stopped stepping: {stuck}")
        self._all_closed.set()

    def _fail(self, reason: str) -> None:
        self.failed = reason
        if self.on_failure is not None:
            self.on_failure(reason)


# ---------------------------------------------------------------------- a worker


class Worker:
    """A worker's end of the channel: joins the leader, sends heartbeats, runs each call it is handed."""

    def __init__(self, group: Group):
        self.group = group
        self.sock: socket.socket | None = None
        self.stopping = threading.Event()
        self._fault = fault_of(os.environ)

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> Worker:
        port = _exchange_port(0)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((self.group.leader, port), timeout=10)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cannot reach the leader's channel at {self.group.leader}:{port}: "
                                       f"{e.strerror or e}") from None
                time.sleep(0.5)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(encode("hello", "", (np.int32(self.group.index),)))
        threading.Thread(target=self._heartbeat, name="moe-tpu-group-heartbeat", daemon=True).start()
        return self

    def follow(self, run: Callable[..., object]) -> int:
        """Runs each call the leader hands over (`run(name, *inputs)`) until it says stop (returns 0); the
        leader gone returns 1."""
        while True:
            try:
                frame = read_frame(self.sock)
            except OSError:
                frame = None
            if frame is None:
                return 1
            op, name, inputs = frame
            if op == "stop":
                self.stopping.set()
                self.sock.close()
                return 0
            if self._fault is not None:
                self._fault()
            run(name, *inputs)

    def _heartbeat(self) -> None:
        """A byte a second; a send that fails means the leader is gone: exit at once (the main thread may be
        blocked in a collective that waits for it and will not return)."""
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self.sock.sendall(b"h")
            except OSError as e:
                if self.stopping.is_set():
                    return
                print(f"serve: the leader of the serving group is gone ({e.strerror or e}): exiting", file=sys.stderr)
                exit_now(1)


def fault_of(env: Mapping[str, str]) -> Callable[[], None] | None:
    """MOE_SERVE_FAULT's fault point (tests only; see the module's docstring), or None when unset: called before
    each program call of this process (a worker's) or after handing it to the workers (the leader's)."""
    action, _, path = env.get("MOE_SERVE_FAULT", "").partition(":")
    if action not in ("hold", "fail") or not path:
        return None

    def fault() -> None:
        if not os.path.exists(path):
            return
        print(f"serve: MOE_SERVE_FAULT={action}:{path}: this process's step {action}s", file=sys.stderr)
        while action == "hold":
            time.sleep(3600)
        raise RuntimeError(f"the step failed (MOE_SERVE_FAULT={action}:{path})")

    return fault


def leave(code: int) -> None:
    """A process of a group that exits with `code` other than 0 leaves at once (`exit_now`); 0 (the group
    stopped together) goes through Python's exit, jax.distributed's shutdown included."""
    if joined and code:
        exit_now(code)


def exit_now(code: int) -> None:
    """Ends the process without Python's exit handlers: jax.distributed's shutdown waits at a barrier for
    every process, which a group that lost one never reaches."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
