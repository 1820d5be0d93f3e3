"""A busy runner (``Overloaded``: every stream slot held) is not a broken one: the router tries
another runner, never ejects it nor counts a failure, and answers ``Overloaded`` itself when
every runner is busy (fake runners over real gRPC, tests/fake_runner.py)."""

from __future__ import annotations

import grpc
import pytest
from fake_runner import FakeBehaviour, FakeRunner, expected_ids

from router_service.config import RouterConfig
from router_service.registry import RunnerState
from router_service.servicer import RouterServer
from services.bootstrap import ServerConfig
from services.channel import open_channel
from services.errors import OVERLOADED_METADATA, Overloaded, is_overloaded
from services.proto import generation_pb2, generation_pb2_grpc
from services.stream_slots import StreamSlots


@pytest.fixture
def router():
    server = RouterServer(RouterConfig(policy="round-robin", health_interval_s=0.1, health_timeout_s=0.5),
                          ServerConfig(service="router", port=0))
    server.start()
    runners: list[FakeRunner] = []

    def add(runner_id: str, behaviour: FakeBehaviour) -> FakeRunner:
        runner = FakeRunner(runner_id, behaviour)
        runners.append(runner)
        server.router.registry.register(runner_id, runner.address, lease_s=60)
        return runner

    try:
        yield server, add
    finally:
        server.stop()
        for r in runners:
            r.stop()


def _generate(address: str, text: str) -> list[generation_pb2.GenerateResponse]:
    with open_channel(address) as ch:
        request = generation_pb2.GenerateRequest(text=text, sampling=generation_pb2.SamplingParams(max_tokens=4))
        return list(generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=10))


def _refused(server: RouterServer, reason: str) -> float:
    return server.server.registry.get_sample_value("warmserve_refused_total", {"reason": reason}) or 0.0


def test_a_busy_runner_is_skipped_never_ejected_and_the_request_served_elsewhere(router) -> None:
    server, add = router
    busy = add("r0-busy", FakeBehaviour(overloaded=True))
    add("r1", FakeBehaviour())
    for i in range(6):  # round robin: every other request picks the busy runner first
        msgs = _generate(server.address, f"hello {i}")
        assert [t for m in msgs for t in m.token_ids] == expected_ids(
            generation_pb2.GenerateRequest(text=f"hello {i}", sampling=generation_pb2.SamplingParams(max_tokens=4)))
        assert {m.runner_id for m in msgs} == {"r1"}
    assert busy.stats.requests >= 3
    states = {r.runner_id: r for r in server.router.registry.snapshot()}
    assert states["r0-busy"].state is RunnerState.READY
    assert states["r0-busy"].consecutive_failures == 0 and states["r0-busy"].last_error == ""
    assert _refused(server, "overloaded") == 0  # the router itself refused nothing


def test_every_runner_busy_is_overloaded_with_its_marker_and_counted(router) -> None:
    server, add = router
    add("r0", FakeBehaviour(overloaded=True))
    add("r1", FakeBehaviour(overloaded=True))
    with pytest.raises(grpc.RpcError) as err:
        _generate(server.address, "hi")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and is_overloaded(err.value)
    assert "busy" in err.value.details() and "r0" in err.value.details() and "r1" in err.value.details()
    assert OVERLOADED_METADATA in tuple(tuple(kv) for kv in err.value.trailing_metadata())
    assert all(r.state is RunnerState.READY and r.consecutive_failures == 0
               for r in server.router.registry.snapshot())
    assert _refused(server, "overloaded") == 1


def test_a_plain_unavailable_still_ejects(router) -> None:
    server, add = router
    add("r0", FakeBehaviour(fail_before_first=True))
    add("r1", FakeBehaviour())
    for i in range(2):
        _generate(server.address, f"x{i}")
    states = {r.runner_id: r.state for r in server.router.registry.snapshot()}
    assert states["r0"] is RunnerState.UNHEALTHY


def test_stream_slots_refuse_as_overloaded() -> None:
    class _Context:
        def add_callback(self, fn) -> bool:
            return True

    slots = StreamSlots(1, "runner r0")
    slots.take(_Context())
    with pytest.raises(Overloaded) as err:
        slots.take(_Context())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "overloaded"
    assert "maximum of 1 concurrent streams" in str(err.value)

