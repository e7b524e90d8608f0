"""`python -m trainer.serve` as a multi-host group: 2 processes x 4 fake CPU devices (jax.distributed over the
loopback, the environment a LeaderWorkerSet sets) serve one model on an expert=4,model=2 mesh over both, and
return token for token what 1 process x 8 devices returns on that mesh, chunked 1,024-token prompts arriving
mid-stream included; SIGTERM to the leader drains, stops the worker, and both exit 0; a worker killed
mid-stream fails the requests with an error, turns /health 503 and the leader exits non-zero; so does a worker
held in its step (its heartbeat going on), or a step failing on the leader alone, and the worker exits too."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from trainer.serve import multihost

pytestmark = pytest.mark.compile_bound

# A chunk of 512: the long prompts still arrive in 2 chunks between the others' decode steps. 4 slots, one a
# device of `expert`: the decode's one row count (trainer/serve/spans.py), so that each process compiles 4
# programs (prefill and decode at spans 512 and 1,040), where 8 slots compiled 6 (the decode for 4 rows and
# for 8; a program's name crosses the channel whatever its rows, and the small group below runs two counts).
MESH, SLOTS, MAX_LEN, CHUNK, NEW = "expert=4,model=2", 4, 1040, 512, 8
_draw = random.Random(46)
SHORT = [[_draw.randrange(256) for _ in range(_draw.randint(2, 40))] for _ in range(12)]
LONG = [[_draw.randrange(256) for _ in range(1024)] for _ in range(2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """The group's processes, started as a LeaderWorkerSet starts its pods: the same command, LWS_* apart."""

    def __init__(self, run, tmp_path, *, mesh=MESH, local_devices=4, slots=SLOTS, max_len=MAX_LEN, args=(),
                 envs=({}, {})):
        self.port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "trainer.serve", "--checkpoint", str(run), "--port", str(self.port),
                   "--mesh", mesh, "--slots", str(slots), "--max-len", str(max_len), "--chunk", str(CHUNK),
                   "--warm-up", "smallest", *args]  # a span a request reaches compiles then, on every process
        self.logs = [tmp_path / f"process-{i}.log" for i in range(2)]
        self.processes = []
        for i in range(2):
            # XLA's optimisations off, as in this process (the module is compile_bound): compiling dominates.
            env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "LWS_GROUP_SIZE": "2",
                   "LWS_WORKER_INDEX": str(i), "LWS_LEADER_ADDRESS": "127.0.0.1",
                   "JAX_COORDINATOR_ADDRESS": coordinator, "MOE_SERVE_LOCAL_DEVICES": str(local_devices), **envs[i]}
            with open(self.logs[i], "w") as log:
                self.processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.leader, self.worker = self.processes

    def log(self, i: int) -> str:
        return "".join(line for line in self.logs[i].read_text().splitlines(keepends=True) if "[Gloo]" not in line)

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while "ready:" not in self.log(0):
            assert time.monotonic() < deadline and self.leader.poll() is None, self.log(0) + self.log(1)
            time.sleep(0.2)

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def group(trained_tiny, tmp_path):
    """The group, starting: a test waits for it to be ready (`wait_ready`) after what it can do meanwhile."""
    started = Group(trained_tiny.output_dir, tmp_path)
    try:
        yield started
    finally:
        started.kill()


def complete(base: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": " ".join(map(str, prompt)), "max_tokens": NEW, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()


def one_process_greedy(run) -> list[list[int]]:
    """What this process (8 fake devices) returns on the same mesh: the reference."""
    from trainer.serve.engine import Request, SamplingParams
    from trainer.serve.startup import load

    engine = load(str(run), tokenizer_path=None, mesh_text=MESH, slots=SLOTS, max_len=MAX_LEN, chunk=CHUNK,
                  kv_dtype=None, quantized=None, device_memory_gb=None, progress=lambda _: None).engine
    requests = [engine.submit(Request(list(p), SamplingParams(max_tokens=NEW))) for p in SHORT + LONG]
    engine.run()
    return [r.output for r in requests]


def test_two_processes_serve_what_one_serves_and_stop_together_on_sigterm(group, trained_tiny):
    expected = one_process_greedy(trained_tiny.output_dir)  # while the group loads and compiles
    group.wait_ready()
    answers: dict[int, list[int]] = {}

    def ask(i, prompt):
        choice = complete(group.base, prompt)["choices"][0]
        answers[i] = [int(w) for w in choice["text"].split()]

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(SHORT)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the short ones are decoding when the long prompts come, prefilled a chunk a step
    threads += [threading.Thread(target=ask, args=(len(SHORT) + i, p)) for i, p in enumerate(LONG)]
    for t in threads[len(SHORT):]:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert [answers.get(i) for i in range(len(SHORT) + len(LONG))] == expected
    assert all(len(a) == NEW for a in expected)

    # SIGTERM to the leader with a stream open: it finishes, the worker is told to stop, both exit 0.
    with httpx.stream("POST", f"{group.base}/v1/completions", timeout=60,
                      json={"prompt": "3 17 9", "max_tokens": 24, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        group.leader.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert [p.wait(timeout=60) for p in group.processes] == [0, 0], group.log(0) + group.log(1)
    assert "stopped the group's 1 worker(s)" in group.log(0) and "stopped by the leader" in group.log(1)


@pytest.fixture
def small_group(trained_tiny, tmp_path, request):
    """A group of 2 processes x 1 device (expert=2) with a short cache: compiled in a fraction of `group`'s time,
    for what needs a group but not its mesh. Parametrized indirectly, its parameter is Group's `args` and `envs`."""
    started = Group(trained_tiny.output_dir, tmp_path, mesh="expert=2", local_devices=1, slots=4, max_len=512,
                    **getattr(request, "param", {}))
    try:
        yield started
    finally:
        started.kill()


def test_a_worker_killed_mid_stream_fails_the_requests_turns_health_503_and_the_leader_exits_1(small_group):
    group = small_group
    group.wait_ready()
    errors = []

    def stream():
        with httpx.stream("POST", f"{group.base}/v1/completions", timeout=60,
                          json={"prompt": "3 17 9", "max_tokens": 500, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait()
            rest = [line for line in lines if line]
        errors.append(json.loads(rest[-2][6:])["error"]["message"])

    started = threading.Barrier(4)
    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()  # all 3 are streaming
    group.worker.kill()
    killed = time.monotonic()
    health = None
    while time.monotonic() - killed < 10 and health != 503:
        health = httpx.get(f"{group.base}/health").status_code
    assert health == 503
    for t in threads:
        t.join(timeout=30)
    # The step under way may fail first (its collective's peer gone) or be failed by the channel's watchdog.
    assert len(errors) == 3 and all(e.startswith("the request failed: ") for e in errors), errors
    assert group.leader.wait(timeout=30 - (time.monotonic() - killed)) == 1
    assert "serve: worker 1 of the serving group stopped (" in group.log(0)
    assert "the group cannot go on; failing every request and exiting" in group.log(0)


# The leader's own step failing alone ("fail:fault" on process 0) ends the group the same way (measured: 503
# within 0.2 s, exit in 5 s); the loop's side of it is test_serve_server.py's on_failed_step test, and the
# suite's 10 minutes keep one group start here.
@pytest.mark.parametrize("small_group", [
    {"args": ("--step-timeout", "3"), "envs": ({}, {"MOE_SERVE_FAULT": "hold:fault"})},
], indirect=True, ids=["worker-held-in-its-step"])
def test_a_group_that_stops_stepping_answers_503_and_every_process_exits_non_zero(small_group):
    """A worker held inside its step while its heartbeat goes on (the leader then waits in a collective), or a
    leader whose own step fails after it handed the call to the worker (which then waits for it): the leader
    answers 503 within 30 s, fails the open stream and exits 1, and the worker exits non-zero."""
    group = small_group
    group.wait_ready()
    with httpx.stream("POST", f"{group.base}/v1/completions", timeout=60,
                      json={"prompt": "3 17 9", "max_tokens": 500, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        open("fault", "w").close()  # MOE_SERVE_FAULT's trigger, in the processes' working directory (the test's)
        faulted = time.monotonic()
        health = None
        while time.monotonic() - faulted < 30 and health is None:
            answer = httpx.get(f"{group.base}/health", timeout=5)
            health = answer.json() if answer.status_code == 503 else time.sleep(0.2)
        rest = [line for line in lines if line]
    assert health is not None, group.log(0) + group.log(1)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["message"].startswith("the request failed: ")
    assert group.leader.wait(timeout=30 - (time.monotonic() - faulted)) == 1, group.log(0)
    assert group.worker.wait(timeout=30) != 0, group.log(1)
    assert "MOE_SERVE_FAULT" in group.log(0) + group.log(1)
    assert "the group cannot go on; failing every request and exiting" in group.log(0)


def test_a_call_crosses_the_channel_whole():
    """Whatever host arrays a program takes (nested, 0-d, bool) arrive as sent: new inputs need no protocol."""
    inputs = (np.arange(8, dtype=np.int32).reshape(1, 8), (np.float32([0.5, 1]), np.int32([3, -1])), np.int32(7),
              np.bool_(True), {"mask": np.ones((2, 3), np.uint8)})
    left, right = socket.socketpair()
    with left, right:
        left.sendall(multihost.encode("call", "prefill", inputs))
        op, name, back = multihost.read_frame(right)
        left.close()
        assert multihost.read_frame(right) is None  # end-of-file: the peer is gone
    assert (op, name) == ("call", "prefill")
    assert jax.tree.structure(back) == jax.tree.structure(inputs)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(inputs), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()

    # The leader lets in only a worker it waits for, never whatever else connects to its port.
    leader = multihost.Leader(multihost.Group(3, 0, "127.0.0.1:1", "127.0.0.1"))
    leader.workers[2] = None
    for sent, index in [(b"GET / HTTP/1.1\r\n\r\n", None), (multihost.encode("hello", "", (np.int32(3),)), None),
                        (multihost.encode("hello", "", (np.int32(2),)), None), (b"", None),
                        (multihost.encode("hello", "", (np.int32(1),)), 1)]:
        left, right = socket.socketpair()
        with left, right:
            left.sendall(sent)
            left.shutdown(socket.SHUT_WR)
            assert leader._hello(right, timeout=5) == index, sent


def test_the_group_is_read_from_the_leaderworkerset_environment():
    env = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2", "LWS_LEADER_ADDRESS": "lead.svc"}
    assert multihost.group_of(env) == multihost.Group(4, 2, "lead.svc:8476", "lead.svc")
    assert multihost.group_of({**env, "JAX_COORDINATOR_ADDRESS": "10.0.0.1:999", "MOE_SERVE_LOCAL_DEVICES": "4"}) \
        == multihost.Group(4, 2, "10.0.0.1:999", "lead.svc", 4)
    assert multihost.group_of({**env, "LWS_GROUP_SIZE": "1"}) is None
    assert multihost.group_of({**env, "JAX_PLATFORMS": "proxy"}) is None  # Pathways: one controller
    for bad, needle in [({"LWS_WORKER_INDEX": "4"}, "must be below LWS_GROUP_SIZE=4"),
                        ({"LWS_WORKER_INDEX": "x"}, "LWS_WORKER_INDEX must be a whole number"),
                        ({"LWS_LEADER_ADDRESS": ""}, "needs LWS_LEADER_ADDRESS"),
                        ({"JAX_COORDINATOR_ADDRESS": "nohost"}, "HOST:PORT")]:
        with pytest.raises(ValueError, match=needle):
            multihost.group_of({**env, **bad})
    group = multihost.group_of(env)
    assert multihost.local_device_count(group, 16) == 4
    assert multihost.local_device_count(multihost.group_of({**env, "MOE_SERVE_LOCAL_DEVICES": "2"}), None) == 2
    with pytest.raises(ValueError, match="split evenly"):
        multihost.local_device_count(group, 6)


def test_the_serve_command_refuses_a_group_it_cannot_form_and_starts_pathways_itself(tmp_path):
    """Exit 2 naming the variable, before anything is loaded; under Pathways the serve path runs the
    trainer's Pathways start-up (here it finds no proxy named)."""
    from click.testing import CliRunner

    from trainer.serve.cli import serve_command

    lws = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    cases = [({**lws, "LWS_LEADER_ADDRESS": ""}, [], "LWS_GROUP_SIZE > 1 needs LWS_LEADER_ADDRESS"),
             ({**lws, "MOE_SERVE_LOCAL_DEVICES": "4"}, ["--devices", "6"], "--devices 6 is the group's total"),
             ({"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": ""}, [], "JAX_PLATFORMS=proxy needs JAX_BACKEND_TARGET")]
    for env, args, needle in cases:
        result = CliRunner().invoke(serve_command, ["--checkpoint", str(tmp_path), "--port", str(free_port()), *args],
                                    env=env)
        assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output, result.output
