"""Fault injection for the `flaky` scenario: one server interceptor in front of every service.

A share (FLAKY_SHARE) of RPCs fails UNAVAILABLE before it reaches its service, never more than
FLAKY_MAX_IN_A_ROW in a row, so a client retrying a few times always gets through. A create
(CREATES) picked to fail may instead be applied and its answer lost: the client sees UNAVAILABLE
although the resource exists, and must find it before creating it again. The first create of each
kind in a world is always lost that way, so every dry run under `flaky` rehearses it.
Decisions are deterministic for a seed, and their bookkeeping (world.FaultState) is saved with
the world, so a sequence of commands replays the same way.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import grpc

from provision.emulator.scenarios import FLAKY_MAX_IN_A_ROW, FLAKY_SHARE

if TYPE_CHECKING:
    from provision.emulator.world import FaultState, World

UNAVAILABLE_MESSAGE = "The service is currently unavailable."
CREATES = ("google.cloud.tpu.v2.Tpu/CreateQueuedResource", "google.cloud.aiplatform.v1.JobService/CreateCustomJob",
           "google.container.v1.ClusterManager/CreateNodePool")


class Verdict(Enum):
    PASS = "pass"
    FAIL = "fail"  # UNAVAILABLE, not applied
    LOSE = "lose"  # applied, then UNAVAILABLE


def roll(seed: int, n: int, salt: int = 0) -> bool:
    """Whether RPC number n is picked to fail: deterministic for a seed."""
    digest = hashlib.sha256(f"{seed + salt}/{n}".encode()).digest()
    return random.Random(digest).random() < FLAKY_SHARE


def decide(state: FaultState, seed: int, method: str) -> Verdict:
    """The fate of the next RPC to `method` ("package.Service/Method"); updates `state`."""
    state.rpc_count += 1
    room = state.failures_in_a_row < FLAKY_MAX_IN_A_ROW
    fails = roll(seed, state.rpc_count) and room
    if method in CREATES and room and (state.lost_creates.get(method, 0) == 0
                                       or (fails and roll(seed, state.rpc_count, salt=1))):
        return Verdict.LOSE  # a failure once the create is applied (lost), else an answer (answered)
    state.failures_in_a_row = state.failures_in_a_row + 1 if fails else 0
    return Verdict.FAIL if fails else Verdict.PASS


def lost(state: FaultState, method: str) -> None:
    """A create was applied and its answer is being dropped."""
    state.lost_creates[method] = state.lost_creates.get(method, 0) + 1
    state.failures_in_a_row += 1


def answered(state: FaultState) -> None:
    """A create picked to be lost answered an error instead (it was not applied)."""
    state.failures_in_a_row = 0


class FaultInjector(grpc.ServerInterceptor):
    """Wraps every unary method of the server when `flaky`; the bookkeeping is one transaction
    `world_call(fn(world, now))` (Emulator.world_call) each time, and `seed` the world's."""

    def __init__(self, world_call: Callable[[Callable[[World, float], Any]], Any], seed: int, flaky: bool) -> None:
        self._world_call = world_call
        self._seed = seed
        self._flaky = flaky

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or handler.unary_unary is None or not self._flaky:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._wrap(details.method.lstrip("/"), handler.unary_unary),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def _wrap(self, method: str, behaviour):
        world_call, seed = self._world_call, self._seed

        def flaky(request, context: grpc.ServicerContext):
            verdict = world_call(lambda world, now: decide(world.faults, seed, method))
            if verdict is Verdict.FAIL:
                context.abort(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_MESSAGE)
            try:
                response = behaviour(request, context)
            except BaseException:  # the service answered an error: nothing was applied
                if verdict is Verdict.LOSE:
                    world_call(lambda world, now: answered(world.faults))
                raise
            if verdict is Verdict.LOSE:
                world_call(lambda world, now: lost(world.faults, method))
                context.abort(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_MESSAGE)
            return response
        return flaky
