"""RunnerRegistration against a real router server: register, heartbeat load, lease expiry,
re-registration after a router restart, wildcard addresses and drain on stop."""

from __future__ import annotations

import time

import pytest
from fake_runner import FakeRunner

from router_service.config import RouterConfig
from router_service.servicer import RouterServer, advertised_address
from runner_service.registration import RunnerRegistration
from services.bootstrap import ServerConfig
from services.channel import open_channel
from services.errors import InvalidArgument
from services.proto import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc


def _wait(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _router(port: int = 0) -> RouterServer:
    server = RouterServer(RouterConfig(min_lease_s=0.3, default_lease_s=1.0, health_interval_s=0.1),
                          ServerConfig(service="router", port=port))
    server.start()
    return server


def _listed(server: RouterServer) -> dict[str, router_pb2.RunnerStatus]:
    with open_channel(server.address) as ch:
        resp = router_pb2_grpc.RouterControlStub(ch).ListRunners(router_pb2.ListRunnersRequest(), timeout=5)
    return {r.runner_id: r for r in resp.runners}


def test_register_heartbeat_load_and_lease_expiry() -> None:
    router = _router()
    runner = FakeRunner("r0")
    load = {"running": 2, "waiting": 1, "kv_blocks_used": 30, "kv_blocks_total": 100}
    reg = RunnerRegistration(router.address, runner_id="r0", address=runner.address, model="fake",
                             max_num_seqs=4, load_fn=lambda: load, lease_seconds=0.6)
    try:
        reg.start()
        assert reg.registered.wait(5)
        assert _wait(lambda: "r0" in _listed(router) and _listed(router)["r0"].load.kv_blocks_used == 30)
        status = _listed(router)["r0"]
        assert (status.address, status.model, status.static) == (runner.address, "fake", False)
        assert status.load == router_pb2.RunnerLoad(running=2, waiting=1, kv_blocks_used=30, kv_blocks_total=100)
        assert 0 < status.lease_expires_in_s <= 0.6
        time.sleep(1.5)  # heartbeats (every 0.2 s) keep the 0.6 s lease alive
        assert "r0" in _listed(router) and reg.registrations == 1
        with open_channel(router.address) as ch:
            msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(
                generation_pb2.GenerateRequest(text="hey"), timeout=5))
        assert [t for m in msgs for t in m.token_ids] == [104, 101, 121]
        reg.stop(drain=True)
        assert _listed(router)["r0"].state == router_pb2.RunnerStatus.STATE_DRAINING
        assert _wait(lambda: "r0" not in _listed(router), 3.0)  # no heartbeats: the lease expires
    finally:
        reg.stop()
        router.stop()
        runner.stop()


def test_reregisters_after_the_router_restarts() -> None:
    router = _router()
    port = router.server.port
    reg = RunnerRegistration(router.address, runner_id="r0", address="127.0.0.1:9", model="m",
                             max_num_seqs=1, load_fn=dict, retry_s=0.1)
    try:
        reg.start()
        assert _wait(lambda: reg.registrations == 1)
        router.stop()
        router = _router(port)  # a new router knows nobody: the heartbeat says known=false
        assert _wait(lambda: reg.registrations == 2)
        assert "r0" in _listed(router)
    finally:
        reg.stop(drain=False)
        router.stop()


def test_registration_waits_for_a_router_that_is_not_up_yet() -> None:
    probe = _router()
    port = probe.server.port
    probe.stop()
    reg = RunnerRegistration(f"127.0.0.1:{port}", runner_id="late", address="127.0.0.1:9", model="m",
                             max_num_seqs=1, load_fn=dict, retry_s=0.1)
    router = None
    try:
        reg.start()
        time.sleep(0.3)
        assert reg.registrations == 0
        router = _router(port)
        assert _wait(lambda: reg.registrations == 1)
    finally:
        reg.stop(drain=False)
        if router is not None:
            router.stop()


def test_wildcard_address_is_replaced_by_the_peer_host() -> None:
    assert advertised_address("0.0.0.0:50061", "ipv4:10.1.2.3:4455") == "10.1.2.3:50061"
    assert advertised_address(":50061", "ipv6:[::1]:4455") == "[::1]:50061"
    assert advertised_address("runner-0:50061", "ipv4:10.1.2.3:4455") == "runner-0:50061"
    with pytest.raises(InvalidArgument, match="no host"):
        advertised_address("0.0.0.0:50061", "unix:/tmp/sock")
    router = _router()
    reg = RunnerRegistration(router.address, runner_id="w", address="0.0.0.0:50061", model="m",
                             max_num_seqs=1, load_fn=dict)
    try:
        reg.start()
        assert _wait(lambda: "w" in _listed(router))
        assert _listed(router)["w"].address == "127.0.0.1:50061"
    finally:
        reg.stop(drain=False)
        router.stop()


def test_registration_arguments_are_validated() -> None:
    with pytest.raises(InvalidArgument):
        RunnerRegistration("", runner_id="r", address="127.0.0.1:1", model="m", max_num_seqs=1, load_fn=dict)
    with pytest.raises(InvalidArgument):
        RunnerRegistration("127.0.0.1:1", runner_id="r", address="127.0.0.1:1", model="m", max_num_seqs=1,
                           load_fn=dict, lease_seconds=-1)
