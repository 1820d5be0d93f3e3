"""Fuzzing the router's ``warmserve.v1.RouterControl`` (every RPC, on a router of its own: fuzzed
registrations must not reach the generation router) and its ``warmserve.v1.Generation``
(relayed to a tiny in-process runner), over real gRPC on loopback. Each answer is a documented
status, the router keeps serving, a granted lease is within the configured bounds, and the
runner behind the router holds no sequence or KV block afterwards."""

from __future__ import annotations

import math

import pytest
from fuzz_harness import (
    Case,
    assert_serving,
    batches,
    cases,
    check_status,
    fuzz_channel,
    fuzz_settings,
    run_case,
)
from generation_hints import GENERATION_HINTS
from hypothesis import given
from hypothesis import strategies as st
from kserve_stack import TinyStack

from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from services.bootstrap import ServerConfig
from services.generation_client import GENERATION_SERVICE
from services.proto import generation_pb2, router_pb2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTROL = router_pb2.DESCRIPTOR.services_by_name["RouterControl"]
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
#: Long health intervals: the fuzzed registrations name addresses nobody serves.
CONTROL_CONFIG = RouterConfig(health_interval_s=60.0, health_timeout_s=0.2)

CONTROL_HINTS = {
    "warmserve.v1.RegisterRunnerRequest.runner_id": st.sampled_from(("runner-0", "r1", "x" * 300)),
    "warmserve.v1.RegisterRunnerRequest.address": st.sampled_from(
        ("127.0.0.1:1", ":50061", "[::1]:2", "0.0.0.0:3", "host:99999", "127.0.0.1", "dns:///x:1")),
    "warmserve.v1.RegisterRunnerRequest.lease_seconds": st.sampled_from(
        (0.0, 0.1, 1.0, 1e9, -1.0, math.inf, -math.inf, math.nan)),
    "warmserve.v1.HeartbeatRequest.runner_id": st.sampled_from(("runner-0", "r1")),
    "warmserve.v1.DrainRequest.runner_id": st.sampled_from(("runner-0", "r1", "")),
}


@pytest.fixture(scope="module")
def control():
    server = RouterServer(CONTROL_CONFIG, ServerConfig(service="router-control-fuzz", max_streams=64))
    server.start()
    channel = fuzz_channel(server.address)
    try:
        yield channel
    finally:
        channel.close()
        server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = TinyStack(tmp_path_factory.mktemp("router-fuzz"))
    channel = fuzz_channel(stack.address)
    try:
        yield stack, channel
    finally:
        channel.close()
        stack.close()


def _check_lease(case: Case, responses: list) -> None:
    if case.method.name == "RegisterRunner" and responses:
        granted = responses[0].lease_seconds
        assert CONTROL_CONFIG.min_lease_s <= granted <= CONTROL_CONFIG.max_lease_s, f"{case!r} granted {granted}"


@given(batch=batches(cases(CONTROL, CONTROL_HINTS)))
@fuzz_settings(2000)
def test_every_router_control_rpc_answers_a_documented_status(control, batch):
    for case in batch:
        code, responses, cancelled = run_case(control, case)
        check_status("warmserve.v1.RouterControl", case, code, cancelled)
        _check_lease(case, responses)
        assert_serving(control, "warmserve.v1.RouterControl")


@given(batch=batches(cases(GENERATION, GENERATION_HINTS)))
@fuzz_settings(2000)
def test_every_router_generation_rpc_answers_a_documented_status_and_the_runner_frees_its_kv_blocks(stack, batch):
    tiny, channel = stack
    for case in batch:
        code, _, cancelled = run_case(channel, case)
        check_status("warmserve.v1.Generation@router", case, code, cancelled)
        assert_serving(channel, GENERATION_SERVICE)
        assert tiny.wait_idle(5.0), f"{case!r} left {tiny.engine.stats()}"
