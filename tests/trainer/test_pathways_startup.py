"""The trainer under Pathways: the proxy's address from JAX_BACKEND_TARGET, a short connection timeout,
and an unreachable proxy failing fast with a message that names it (no jax needed before that)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from trainer import distributed


def test_proxy_address_and_timeout_from_the_environment():
    assert distributed.proxy_address({"JAX_BACKEND_TARGET": "grpc://moe-head-0-0.moe:29000"}) == ("moe-head-0-0.moe",
                                                                                                   29000)
    with pytest.raises(RuntimeError, match="needs JAX_BACKEND_TARGET=grpc://HOST:PORT"):
        distributed.proxy_address({"JAX_BACKEND_TARGET": "grpc://no-port"})
    assert distributed.proxy_timeout({}) == distributed.DEFAULT_PROXY_TIMEOUT_S
    assert distributed.proxy_timeout({distributed.PROXY_TIMEOUT_ENV: "60"}) == 60
    with pytest.raises(RuntimeError, match="must be a number of seconds"):
        distributed.proxy_timeout({distributed.PROXY_TIMEOUT_ENV: "soon"})


def test_check_proxy_waits_for_a_proxy_that_comes_up_and_gives_up_on_one_that_does_not():
    now = [0.0]
    attempts = []

    def connect(address, timeout):
        attempts.append(now[0])
        if now[0] < 2.0:
            raise ConnectionRefusedError(111, "Connection refused")
        return socket.socket()

    env = {"JAX_BACKEND_TARGET": "grpc://head:29000", distributed.PROXY_TIMEOUT_ENV: "5"}
    distributed.check_proxy(env, connect=connect, clock=lambda: now[0],
                            sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert attempts[-1] >= 2.0 and len(attempts) == 5
    now[0] = 0.0

    def refused(address, timeout):
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(RuntimeError, match=r"proxy at head:29000 .* did not answer within 5 s: Connection refused"):
        distributed.check_proxy(env, connect=refused, clock=lambda: now[0],
                                sleep=lambda s: now.__setitem__(0, now[0] + s))


def test_trainer_with_an_unreachable_proxy_exits_within_10_s_naming_the_address(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != distributed.PROXY_TIMEOUT_ENV}
    env.update(JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://127.0.0.1:{port}")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "--steps", "2",
                           "--output-dir", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "did not answer" in proc.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"
