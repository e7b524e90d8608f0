"""The Emulator: a loopback gRPC server over the emulated world, persisted after every RPC."""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, Self

import grpc

from provision.clock import SimClock
from provision.emulator import scenarios
from provision.emulator.scenarios import FLAKY_MAX_IN_A_ROW, check_scenario, flaky_roll
from provision.emulator.service import UNAVAILABLE_MESSAGE, Lost, handlers
from provision.emulator.validate import ApiError
from provision.emulator.world import World
from provision.errors import UsageError

CREATE_METHOD = "google.cloud.tpu.v2.Tpu/CreateQueuedResource"


class Emulator:
    """The Cloud TPU v2 API (and its Operations service) on 127.0.0.1, on a given clock.

    >>> with Emulator(scenario="happy") as emu:
    ...     client = emu.client()       # a real google.cloud.tpu_v2.TpuClient
    ...     emu.clock.advance(600)      # simulated time moves only when someone waits
    """

    def __init__(self, state_path: Path | None = None, scenario: str = "happy", clock=None,
                 seed: int = 0) -> None:
        self.scenario = check_scenario(scenario)
        self.state_path = Path(state_path) if state_path is not None else None
        self.clock = clock if clock is not None else SimClock()
        self.seed = seed
        self.world = World(seed=seed)
        self.port: int | None = None
        self._server: grpc.Server | None = None
        self._lock = threading.RLock()
        self._lose_create = False
        self._channels: list[grpc.Channel] = []

    # --- lifecycle -------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Load the saved world (if any), bind to a loopback address and serve; returns the port."""
        if self._server is not None:
            raise RuntimeError(f"the emulator is already serving on {self.address}")
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the emulator binds to loopback only, not {host!r}")
        self._load()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="emulator"),
                             handlers=handlers(self), options=[("grpc.so_reuseport", 0)])
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise OSError(f"cannot bind the emulator to {bind}: {exc}") from exc
        if not self.port:
            raise OSError(f"cannot bind the emulator to {bind}")
        self._host = host
        server.start()
        self._server = server
        return self.port

    def stop(self) -> None:
        """Save the world and stop serving. Safe to call twice."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
            with self._lock:
                self._save(self.clock.now())

    def __enter__(self) -> Self:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the emulator is not started")
        host = self._host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def client(self):
        """A real google.cloud.tpu_v2.TpuClient on an insecure channel to this emulator."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2
        from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel, credentials=AnonymousCredentials()))

    # --- one RPC ---------------------------------------------------------------
    def handle(self, method: str, fn: Callable[[float], Any], count: bool = True) -> Any:
        """Run one RPC under the lock at a fixed `now`, then persist; flaky failures happen here."""
        with self._lock:
            now = self.clock.now()
            try:
                if count and self.scenario == "flaky" and self._flaky_fails(method):
                    raise ApiError("UNAVAILABLE", UNAVAILABLE_MESSAGE)
                return fn(now)
            except Lost:
                raise ApiError("UNAVAILABLE", UNAVAILABLE_MESSAGE) from None
            finally:
                self.world.prune(now)
                self._save(now)

    def _flaky_fails(self, method: str) -> bool:
        """Roll for this RPC. A create picked to fail may instead be applied and its answer lost:
        always the world's first create, then half of the failing ones."""
        world = self.world
        world.rpc_count += 1
        fails = flaky_roll(self.seed, world.rpc_count) and world.failures_in_a_row < FLAKY_MAX_IN_A_ROW
        self._lose_create = False
        if method == CREATE_METHOD and (world.lost_creates == 0 or
                                        (fails and flaky_roll(self.seed + 1, world.rpc_count))):
            self._lose_create = True
            fails = False
        world.failures_in_a_row = world.failures_in_a_row + 1 if fails else 0
        return fails

    def lose_this_create(self) -> bool:
        """Called after a create was applied: whether its answer is lost (flaky)."""
        if not self._lose_create:
            return False
        self._lose_create = False
        self.world.lost_creates += 1
        self.world.failures_in_a_row += 1
        return True

    # --- persistence -----------------------------------------------------------
    def _load(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            data = json.loads(self.state_path.read_text())
            world = World.from_json(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"cannot read the emulator state {self.state_path}: {exc}",
                             hint=f"delete {self.state_path} to start a fresh emulated world") from exc
        self.world = world
        if hasattr(self.clock, "set"):
            self.clock.set(float(data["now"]))

    def _save(self, now: float) -> None:
        """Write the world atomically (temp file + os.replace): a kill never leaves half a file."""
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.world.to_json(max(now, self.clock.now())), indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=".emulator-", suffix=".tmp", dir=self.state_path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.state_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


__all__ = ["Emulator", "scenarios"]
