"""Streams cannot starve the calls that keep a fleet together (services/stream_slots.py).

Each streaming RPC holds one thread of the gRPC server's pool. Before the cap, 64 concurrent
streams through the router held all 64 threads, the runners' lease heartbeats queued behind them
and timed out, the leases expired, and the router cancelled every stream on those runners. Now
streams get at most ``max_streams`` threads, the pool has spare ones for short calls, and one
stream too many is refused at once with UNAVAILABLE."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from fake_runner import FakeBehaviour, FakeRunner

from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from runner_service.registration import RunnerRegistration
from services.bootstrap import ServerConfig
from services.channel import open_channel
from services.errors import InvalidArgument, Unavailable
from services.proto import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc
from services.stream_slots import StreamSlots


class _Context:
    """The part of ``grpc.ServicerContext`` StreamSlots uses: termination callbacks."""

    def __init__(self, ended: bool = False) -> None:
        self.callbacks = []
        self.ended = ended

    def add_callback(self, fn) -> bool:
        if self.ended:
            return False
        self.callbacks.append(fn)
        return True

    def end(self) -> None:
        self.ended = True
        for fn in self.callbacks:
            fn()


def test_slots_cap_streams_and_free_them_when_each_rpc_ends() -> None:
    slots = StreamSlots(2, "the router")
    a, b = _Context(), _Context()
    slots.take(a)
    slots.take(b)
    assert slots.in_use == 2
    with pytest.raises(Unavailable, match=r"the router is serving its maximum of 2 concurrent streams"):
        slots.take(_Context())
    assert slots.in_use == 2  # a refusal holds nothing
    a.end()
    a.end()  # a callback run twice frees one slot, once
    assert slots.in_use == 1
    slots.take(_Context(ended=True))  # an RPC that already ended gives its slot back at once
    assert slots.in_use == 1
    b.end()
    assert slots.in_use == 0
    with pytest.raises(InvalidArgument):
        StreamSlots(0, "x")


def test_server_config_sizes_the_pool_for_streams_plus_control_calls() -> None:
    from services.stream_slots import OPEN_STREAMS

    assert OPEN_STREAMS == 4  # reflection streams an unauthenticated peer may hold (docs/security.md §5)
    assert ServerConfig(service="s").pool_threads == 256 + 16 + 4
    assert ServerConfig(service="s", max_streams=4, control_threads=2).pool_threads == 4 + 2 + 4
    assert ServerConfig(service="s", max_workers=9).pool_threads == 9
    with pytest.raises(InvalidArgument, match="--max-streams"):
        ServerConfig(service="s", max_streams=0)


def _stream(address: str, tokens: int, out: list, i: int) -> None:
    """One Generate through ``address``; ``out[i]`` = (tokens, finish reason) or (code, details).
    The fake runner echoes the prompt's characters, so a prompt longer than ``tokens`` ends LENGTH."""
    try:
        with open_channel(address) as ch:
            msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                text=f"{i:03d}" + "x" * tokens, sampling=generation_pb2.SamplingParams(max_tokens=tokens)), timeout=60))
        out[i] = (sum(len(m.token_ids) for m in msgs), msgs[-1].finish_reason)
    except grpc.RpcError as e:
        out[i] = (e.code(), e.details())


def test_one_stream_over_the_cap_is_unavailable_and_control_calls_still_answer() -> None:
    runner = FakeRunner("r0", FakeBehaviour(delay_s=0.05))
    router = RouterServer(RouterConfig(static_runners=(runner.address,), health_interval_s=0.1),
                          ServerConfig(service="router", max_streams=4, control_threads=4))
    router.start()
    try:
        router.router.wait_ready(1, 10)
        out: list = [None] * 4
        threads = [threading.Thread(target=_stream, args=(router.address, 40, out, i)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while router.slots.in_use < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with open_channel(router.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(text="one more"),
                                                                     timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "maximum of 4 concurrent streams" in err.value.details()
            # The pool's spare threads answer control calls while all four streams run.
            t0 = time.monotonic()
            listed = router_pb2_grpc.RouterControlStub(ch).ListRunners(router_pb2.ListRunnersRequest(), timeout=2)
            assert time.monotonic() - t0 < 1.0 and len(listed.runners) == 1
            assert router.slots.in_use == 4
        for t in threads:
            t.join(30)
        assert out == [(40, generation_pb2.FINISH_REASON_LENGTH)] * 4
        # A stream's slot is released when the server's handler returns, which can be just after
        # the client has read the last message.
        deadline = time.monotonic() + 5
        while router.slots.in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.slots.in_use == 0
    finally:
        router.stop()
        runner.stop()


def test_80_streams_leave_the_runners_lease_alive_and_all_finish() -> None:
    """The review's repro, scaled down in time: more streams than the old pool (64) through a
    router whose runner holds a short lease renewed by heartbeat."""
    # Health checks get a 5 s deadline: router, runner and 80 clients share this process's GIL,
    # and what is under test is the lease, not how fast one busy process answers a check.
    router = RouterServer(RouterConfig(min_lease_s=0.3, default_lease_s=2.0, health_interval_s=0.5,
                                       health_timeout_s=5.0), ServerConfig(service="router"))
    router.start()
    runner = FakeRunner("r0", FakeBehaviour(delay_s=0.06))
    # A 2 s lease renewed every ~0.7 s: slack for a busy test process (router, runner and 80
    # clients share one GIL), yet far shorter than the streams, which a starved pool would
    # make the heartbeats wait for.
    reg = RunnerRegistration(router.address, runner_id="r0", address=runner.address, model="fake",
                             max_num_seqs=128, load_fn=lambda: {}, lease_seconds=2.0)
    try:
        reg.start()
        assert reg.registered.wait(5)
        router.router.wait_ready(1, 10)
        n, tokens = 80, 100  # each stream lasts ~6 s: three leases
        out: list = [None] * n
        threads = [threading.Thread(target=_stream, args=(router.address, tokens, out, i)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out == [(tokens, generation_pb2.FINISH_REASON_LENGTH)] * n
        assert reg.registrations == 1  # the lease never lapsed
    finally:
        reg.stop()
        router.stop()
        runner.stop()
