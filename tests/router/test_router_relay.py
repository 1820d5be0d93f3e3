"""The router over real gRPC against in-process fake runners (tests/fake_runner.py): relay,
retry-before-first-token, failure after tokens, cancellation, deadlines, backpressure, policies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from fake_runner import FakeBehaviour, FakeRunner, expected_ids
from grpc_health.v1 import health_pb2

from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from services.bootstrap import ServerConfig
from services.channel import open_channel
from services.proto import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc


class Harness:
    """A router server on a free port plus fake runners registered with it."""

    def __init__(self, config: RouterConfig) -> None:
        self.server = RouterServer(config, ServerConfig(service="router", port=0))
        self.server.start()
        self.router = self.server.router
        self.channel = open_channel(self.server.address)
        self.gen = generation_pb2_grpc.GenerationStub(self.channel)
        self.control = router_pb2_grpc.RouterControlStub(self.channel)
        self.runners: list[FakeRunner] = []

    def add(self, runner_id: str, behaviour: FakeBehaviour | None = None) -> FakeRunner:
        runner = FakeRunner(runner_id, behaviour)
        self.runners.append(runner)
        self.control.RegisterRunner(router_pb2.RegisterRunnerRequest(
            runner_id=runner_id, address=runner.address, lease_seconds=60), timeout=5)
        return runner

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
        for r in self.runners:
            r.stop()

    def states(self) -> dict[str, int]:
        return {r.runner_id: r.state for r in self.control.ListRunners(router_pb2.ListRunnersRequest()).runners}


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(RouterConfig(health_interval_s=0.1, health_timeout_s=0.5))
    try:
        yield h
    finally:
        h.close()


def text_request(text: str, max_tokens: int = 8, **kw) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=text, sampling=generation_pb2.SamplingParams(max_tokens=max_tokens),
                                          **kw)


def collect(stream) -> tuple[list[int], list[generation_pb2.GenerateResponse]]:
    msgs = list(stream)
    return [t for m in msgs for t in m.token_ids], msgs


def test_relays_the_runner_stream_unchanged(harness: Harness) -> None:
    harness.add("r0")
    req = text_request("hello router", max_tokens=5)
    ids, msgs = collect(harness.gen.Generate(req, timeout=5))
    assert ids == [ord(c) for c in "hello"] == expected_ids(req)
    assert "".join(m.text for m in msgs) == "hello"
    assert msgs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 5
    assert {m.runner_id for m in msgs} == {"r0"}
    assert harness.router.registry.snapshot()[0].outstanding == 0


def test_no_runner_is_unavailable_with_a_clear_message(harness: Harness) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(harness.gen.Generate(text_request("x"), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no runner is ready (no runner is registered)" in e.value.details()
    harness.add("r0")
    harness.control.Drain(router_pb2.DrainRequest(runner_id="r0"))
    with pytest.raises(grpc.RpcError) as e:
        list(harness.gen.Generate(text_request("x"), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "r0" in e.value.details() and "DRAINING" in e.value.details()


def test_retries_on_another_runner_before_the_first_token() -> None:
    # Health checks every 60 s: with the fixture's 0.1 s and readmit_after=1, a check that
    # passes between the ejection and ListRunners re-admits "a" (seen in CI under load).
    harness = Harness(RouterConfig(health_interval_s=60, health_timeout_s=0.5))
    try:
        _retry_before_first_token(harness)
    finally:
        harness.close()


def _retry_before_first_token(harness: Harness) -> None:
    bad = harness.add("a", FakeBehaviour(fail_before_first=True))
    good = harness.add("b")
    # Round robin in id order sends the first request to "a", which fails before any token.
    req = text_request("retry me", routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
    ids, msgs = collect(harness.gen.Generate(req, timeout=5))
    assert ids == expected_ids(req)
    assert {m.runner_id for m in msgs} == {"b"}
    assert (bad.stats.requests, good.stats.requests) == (1, 1)
    assert harness.states()["a"] == router_pb2.RunnerStatus.STATE_UNHEALTHY


def test_failure_after_tokens_is_unavailable_naming_the_runner_and_not_retried(harness: Harness) -> None:
    harness.add("a", FakeBehaviour(fail_after=3))
    other = harness.add("b")
    req = text_request("abcdefgh", routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
    got: list[int] = []
    with pytest.raises(grpc.RpcError) as e:
        for m in harness.gen.Generate(req, timeout=5):
            got.extend(m.token_ids)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "runner a (127.0.0.1:" in e.value.details() and "after 3 tokens" in e.value.details()
    assert got == expected_ids(req)[:3]
    assert other.stats.requests == 0


def test_all_runners_failing_names_each_of_them(harness: Harness) -> None:
    harness.add("a", FakeBehaviour(fail_before_first=True))
    harness.add("b", FakeBehaviour(fail_before_first=True))
    with pytest.raises(grpc.RpcError) as e:
        list(harness.gen.Generate(text_request("x"), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "a: 127.0.0.1:" in e.value.details() and "b: 127.0.0.1:" in e.value.details()
    assert "is going away" in e.value.details()


def test_runner_errors_pass_through_with_their_code(harness: Harness) -> None:
    runner = harness.add("a", FakeBehaviour(invalid=True))
    harness.add("b", FakeBehaviour(invalid=True))
    with pytest.raises(grpc.RpcError) as e:
        list(harness.gen.Generate(text_request("x"), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "the fake refuses this prompt"
    assert runner.stats.requests + harness.runners[1].stats.requests == 1  # not retried


def test_unknown_routing_value_is_invalid_argument(harness: Harness) -> None:
    harness.add("a")
    with pytest.raises(grpc.RpcError) as e:
        list(harness.gen.Generate(text_request("x", routing=42), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "42" in e.value.details()


def test_client_cancellation_cancels_the_runner_call(harness: Harness) -> None:
    runner = harness.add("a", FakeBehaviour(delay_s=0.05))
    call = harness.gen.Generate(text_request("x" * 100, max_tokens=100), timeout=10)
    it = iter(call)
    next(it)
    next(it)
    call.cancel()
    deadline = time.monotonic() + 3
    while (runner.stats.cancelled == 0 or runner.stats.active) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert runner.stats.cancelled == 1 and runner.stats.active == 0
    assert runner.stats.produced < 100
    while harness.router.registry.snapshot()[0].outstanding and time.monotonic() < deadline:
        time.sleep(0.02)
    assert harness.router.registry.snapshot()[0].outstanding == 0


def test_deadline_propagates_to_the_runner(harness: Harness) -> None:
    runner = harness.add("a", FakeBehaviour(delay_s=0.2))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(harness.gen.Generate(text_request("x" * 50, max_tokens=50), timeout=0.8))
    elapsed = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 2.0
    (seen,) = runner.stats.deadlines
    assert 0 < seen < 0.85  # the runner got the remaining time (plus clock rounding), not an unbounded call
    end = time.monotonic() + 2
    while runner.stats.active and time.monotonic() < end:
        time.sleep(0.02)
    assert runner.stats.active == 0


def test_backpressure_a_paused_client_pauses_the_runner(harness: Harness) -> None:
    runner = harness.add("a", FakeBehaviour(pad_bytes=16 * 1024))
    n = 4000  # 4000 x 16 KiB = 62.5 MiB if nothing held the runner back
    call = harness.gen.Generate(text_request("y" * n, max_tokens=n), timeout=60)
    it = iter(call)
    for _ in range(3):
        next(it)
    time.sleep(1.0)  # the client stops reading: flow-control windows fill, then the runner stalls
    paused_at = runner.stats.produced
    time.sleep(0.5)
    assert runner.stats.produced == paused_at  # stalled: nothing is produced while nobody reads
    assert paused_at < n // 2  # bounded by the HTTP/2 windows on both hops, not the whole answer
    rest = sum(1 for _ in it)
    assert rest == n - 3 + 1  # remaining tokens + the final message
    assert runner.stats.produced == n


def test_least_outstanding_spreads_concurrent_requests(harness: Harness) -> None:
    gate = threading.Event()
    a = harness.add("a", FakeBehaviour(gate=gate))
    b = harness.add("b", FakeBehaviour(gate=gate))
    calls = [harness.gen.Generate(text_request(f"p{i}", max_tokens=2), timeout=10) for i in range(6)]
    end = time.monotonic() + 5
    while a.stats.requests + b.stats.requests < 6 and time.monotonic() < end:
        time.sleep(0.02)
    assert (a.stats.requests, b.stats.requests) == (3, 3)
    outstanding = {r.runner_id: r.outstanding
                   for r in harness.control.ListRunners(router_pb2.ListRunnersRequest()).runners}
    assert outstanding == {"a": 3, "b": 3}
    gate.set()
    for i, c in enumerate(calls):
        assert [t for m in c for t in m.token_ids] == [ord("p"), ord(str(i))]


def test_prefix_affinity_keeps_a_prefix_on_one_runner(harness: Harness) -> None:
    for rid in ("a", "b", "c"):
        harness.add(rid)
    owners = set()
    for i in range(8):
        req = text_request("You are a helpful assistant. Question " * 3 + str(i),
                           routing=generation_pb2.ROUTING_POLICY_PREFIX_AFFINITY)
        owners |= {m.runner_id for m in harness.gen.Generate(req, timeout=5)}
    assert len(owners) == 1
    spread = set()
    for i in range(30):
        req = text_request(f"{i:03d} distinct", routing=generation_pb2.ROUTING_POLICY_PREFIX_AFFINITY)
        spread |= {m.runner_id for m in harness.gen.Generate(req, timeout=5)}
    assert spread == {"a", "b", "c"}


def test_model_info_is_forwarded(harness: Harness) -> None:
    with pytest.raises(grpc.RpcError) as e:
        harness.gen.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    harness.add("r7")
    info = harness.gen.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=5)
    assert (info.runner_id, info.model, info.vocab_size) == ("r7", "fake", 256)


def test_health_checks_eject_and_readmit(harness: Harness) -> None:
    runner = harness.add("a")
    runner.set_serving(False)
    end = time.monotonic() + 5
    while harness.states()["a"] != router_pb2.RunnerStatus.STATE_UNHEALTHY and time.monotonic() < end:
        time.sleep(0.05)
    listed = harness.control.ListRunners(router_pb2.ListRunnersRequest()).runners[0]
    assert listed.state == router_pb2.RunnerStatus.STATE_UNHEALTHY and listed.consecutive_failures >= 3
    runner.set_serving(True)
    while harness.states()["a"] != router_pb2.RunnerStatus.STATE_READY and time.monotonic() < end:
        time.sleep(0.05)
    assert harness.states()["a"] == router_pb2.RunnerStatus.STATE_READY
    assert [t for m in harness.gen.Generate(text_request("ok"), timeout=5) for t in m.token_ids] == [111, 107]


def test_static_runners_are_admitted_by_health_checks() -> None:
    runner = FakeRunner("static")
    dead_port = FakeRunner("gone")
    dead_port.stop()
    h = Harness(RouterConfig(static_runners=(runner.address, dead_port.address),
                             health_interval_s=0.1, health_timeout_s=0.3))
    try:
        assert h.router.wait_ready(1, timeout_s=5)
        states = h.states()
        assert states[runner.address] == router_pb2.RunnerStatus.STATE_READY
        assert states[dead_port.address] == router_pb2.RunnerStatus.STATE_UNHEALTHY
        listed = {r.runner_id: r for r in h.control.ListRunners(router_pb2.ListRunnersRequest()).runners}
        assert listed[runner.address].static and listed[runner.address].lease_expires_in_s == -1
        ids, _ = collect(h.gen.Generate(text_request("static"), timeout=5))
        assert ids == [ord(c) for c in "static"]
    finally:
        h.close()
        runner.stop()


def test_router_health_and_reflection_are_served(harness: Harness) -> None:
    from grpc_health.v1 import health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(harness.channel)
    for service in ("", "warmserve.v1.Generation", "warmserve.v1.RouterControl"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_runner_silent_past_the_first_token_timeout_is_ejected_and_the_request_retried() -> None:
    h = Harness(RouterConfig(health_interval_s=0.1, health_timeout_s=0.5, first_token_timeout_s=0.5))
    try:
        frozen_gate = threading.Event()  # never set: the runner accepts calls, then says nothing
        frozen = h.add("frozen", FakeBehaviour(gate=frozen_gate))
        h.add("ok")
        for i in range(4):  # round robin: some of these are sent to the frozen runner first
            sent = time.monotonic()
            req = text_request(f"hello {i}", max_tokens=7, routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
            got = list(h.gen.Generate(req, timeout=20))
            assert time.monotonic() - sent < 10.0  # bounded by the 0.5 s timeout, not the 20 s deadline
            assert [t for m in got for t in m.token_ids] == [ord(c) for c in f"hello {i}"]
            assert {m.runner_id for m in got} == {"ok"}
        assert frozen.stats.requests >= 1 and frozen.stats.produced == 0
        frozen_gate.set()
    finally:
        h.close()


def test_ejecting_a_runner_retries_its_calls_that_streamed_nothing() -> None:
    """No first-token timeout: calls stuck on a frozen runner are moved as soon as health checks
    eject it, not when its lease lapses (60 s here) or their deadline passes (30 s)."""
    h = Harness(RouterConfig(health_interval_s=0.1, health_timeout_s=0.5, first_token_timeout_s=0))
    try:
        gate = threading.Event()  # never set while the test runs: the runner hangs before any token
        frozen = h.add("frozen", FakeBehaviour(gate=gate))
        h.add("ok")
        results: dict[int, tuple[list[int], set[str], float]] = {}

        def one(i: int) -> None:
            req = text_request(f"hi {i}", max_tokens=5, routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
            ids, msgs = collect(h.gen.Generate(req, timeout=30))
            results[i] = (ids, {m.runner_id for m in msgs}, time.monotonic())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        end = time.monotonic() + 5
        while frozen.stats.requests < 2:  # round robin sends every other request there
            assert time.monotonic() < end, frozen.stats
            time.sleep(0.02)
        time.sleep(0.5)
        assert len(results) == 2  # the two on the frozen runner are stuck
        ejected_at = time.monotonic()
        frozen.set_serving(False)  # health checks now fail: the router ejects it
        for t in threads:
            t.join(timeout=15)
        assert not any(t.is_alive() for t in threads)
        for i, (ids, runners, done_at) in results.items():
            assert ids == [ord(c) for c in f"hi {i}"] and runners == {"ok"}
            assert done_at - ejected_at < 5.0  # moved at the ejection
        assert h.states()["frozen"] == router_pb2.RunnerStatus.STATE_UNHEALTHY
        end = time.monotonic() + 5
        while frozen.stats.cancelled < 2:  # the stuck calls were cancelled on the frozen runner
            assert time.monotonic() < end, frozen.stats
            time.sleep(0.02)
    finally:
        gate.set()
        h.close()
