"""What handing a step's call from the leader to a worker costs (trainer/serve/multihost.py), against the other
way the engine could have taken, jax's broadcast_one_to_all of the same host arrays each step; in one run, two
processes on this machine joined by jax.distributed over the loopback (one CPU device each).

For a decode step of 8 and of 256 slots and a 512-token prefill chunk: the median round trip of the channel
(the leader encodes and sends the call, the worker reads and decodes it and answers one byte) and of the
broadcast (both processes call it; the leader's time until the arrays are on its host again).

    PYTHONPATH=. python benchmarks/serve_multihost_channel.py

Prints one JSON object: microseconds per call for each, and broadcast/channel ratios.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

ROUNDS = 200


def calls() -> dict[str, tuple]:
    """The host arrays of the engine's calls (trainer/serve/runner.py), by their shapes."""
    def decode(slots):
        return (np.zeros(slots, np.int32), np.zeros(slots, np.int32),
                (np.zeros(slots, np.float32), np.zeros(slots, np.int32), np.ones(slots, np.float32),
                 np.zeros(slots, np.int32)), np.bool_(False))

    prefill = (np.zeros((1, 512), np.int32), np.zeros(512, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
               np.int32(0), (np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                             np.zeros(1, np.int32)), np.bool_(False))
    return {"decode_8_slots": decode(8), "decode_256_slots": decode(256), "prefill_512_tokens": prefill}


def process(index: int, coordinator: str, port: int) -> None:
    import jax
    from jax.experimental import multihost_utils

    from trainer.serve import multihost

    jax.distributed.initialize(coordinator, 2, index)
    if index == 0:
        server = socket.create_server(("127.0.0.1", port))
        sock, _ = server.accept()
    else:
        for _ in range(100):
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = {}
    for name, inputs in calls().items():
        channel, broadcast = [], []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            if index == 0:
                sock.sendall(multihost.encode("call", name, inputs))
                assert sock.recv(1) == b"k"
            else:
                multihost.read_frame(sock)
                sock.sendall(b"k")
            channel.append(time.perf_counter() - started)
        for _ in range(ROUNDS):
            started = time.perf_counter()
            jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(inputs))
            broadcast.append(time.perf_counter() - started)
        results[name] = {"channel_us": round(statistics.median(channel) * 1e6, 1),
                         "broadcast_us": round(statistics.median(broadcast[ROUNDS // 10:]) * 1e6, 1)}
        results[name]["broadcast_over_channel"] = round(results[name]["broadcast_us"] / results[name]["channel_us"], 1)
    if index == 0:
        print(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) == 4:
        return process(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(i), coordinator, str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(2)]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    print(out.strip().splitlines()[-1])  # gloo prints its connections on stdout too


if __name__ == "__main__":
    main()
