"""The router's control plane under attack (issue 23): registrations are bound to the credential
that made them, admitted only after a health and model check, bounded; the router presents its own
token to runners; a runner leaves with its own `register` scope."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from auth_tokens import make_creds
from fake_runner import FakeRunner

from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from runner_service.registration import RunnerRegistration
from services.bootstrap import ServerConfig
from services.channel import ClientSecurity, open_channel
from services.proto import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc

READY = router_pb2.RunnerStatus.STATE_READY


def _wait(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


class Fleet:
    """A router checking tokens, fake runners checking the router's token, their registrations."""

    def __init__(self, tmp_path, config: RouterConfig | None = None) -> None:
        self.creds = make_creds(tmp_path, **{"runner-0": "register", "runner-1": "register",
                                             "intruder": "register", "router": "generate,read",
                                             "client": "generate,read", "admin": "read,admin"})
        self.router = RouterServer(config or RouterConfig(health_interval_s=0.1, min_lease_s=0.3),
                                   ServerConfig(service="router", port=0, auth=self.creds.table),
                                   security=self.creds.security("router"))
        self.router.start()
        self.runners: list[FakeRunner] = []
        self.regs: list[RunnerRegistration] = []

    def runner(self, runner_id: str, model: str = "fake") -> FakeRunner:
        r = FakeRunner(runner_id, model=model, server_config=ServerConfig(service=runner_id, port=0,
                                                                         auth=self.creds.table))
        self.runners.append(r)
        return r

    def register(self, runner_id: str, runner: FakeRunner, identity: str | None = None) -> RunnerRegistration:
        reg = RunnerRegistration(self.router.address, runner_id=runner_id, address=runner.address, model="fake",
                                 max_num_seqs=4, load_fn=dict, lease_seconds=2.0, retry_s=0.1,
                                 security=self.creds.security(identity or runner_id))
        reg.start()
        self.regs.append(reg)
        return reg

    def control(self, method: str, request, identity: str | None = None):
        security = self.creds.security(identity) if identity else None
        with open_channel(self.router.address, security=security) as ch:
            return getattr(router_pb2_grpc.RouterControlStub(ch), method)(request, timeout=5)

    def states(self) -> dict[str, int]:
        return {r.runner_id: r.state
                for r in self.control("ListRunners", router_pb2.ListRunnersRequest(), "admin").runners}

    def generate(self, text: str = "hi") -> list[generation_pb2.GenerateResponse]:
        with open_channel(self.router.address, security=self.creds.security("client")) as ch:
            return list(generation_pb2_grpc.GenerationStub(ch).Generate(
                generation_pb2.GenerateRequest(text=text), timeout=10))

    def close(self) -> None:
        for reg in self.regs:
            reg.stop(drain=False)
        self.router.stop()
        for r in self.runners:
            r.stop()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_an_impostor_cannot_take_a_live_runner_id_and_gets_no_prompt(fleet: Fleet) -> None:
    real, impostor = fleet.runner("runner-0"), FakeRunner("impostor")
    fleet.runners.append(impostor)
    reg = fleet.register("runner-0", real)
    assert reg.registered.wait(5) and _wait(lambda: fleet.states().get("runner-0") == READY)
    grab = router_pb2.RegisterRunnerRequest(runner_id="runner-0", address=impostor.address, model="fake",
                                            lease_seconds=60)
    assert _code(lambda: fleet.control("RegisterRunner", grab)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: fleet.control("RegisterRunner", grab, "intruder")) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: fleet.control("RegisterRunner", grab, "client")) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: fleet.control("Drain", router_pb2.DrainRequest(runner_id="runner-0"))) \
        == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: fleet.control("Drain", router_pb2.DrainRequest(runner_id="runner-0"), "runner-0")) \
        == grpc.StatusCode.PERMISSION_DENIED  # Drain by anyone but an admin
    hb = router_pb2.HeartbeatRequest(runner_id="runner-0", lease_id="x", leaving=True)
    assert _code(lambda: fleet.control("Heartbeat", hb)) == grpc.StatusCode.UNAUTHENTICATED
    for _ in range(5):
        assert [t for m in fleet.generate() for t in m.token_ids] == [104, 105]
    assert impostor.stats.requests == 0 and real.stats.requests == 5
    assert fleet.router.router.registry.snapshot()[0].address == real.address


def test_registration_floods_with_a_foreign_register_token_cannot_displace_runners(tmp_path) -> None:
    fleet = Fleet(tmp_path, RouterConfig(health_interval_s=0.1, min_lease_s=0.3, max_runners=8))
    stop = threading.Event()
    refused: list[grpc.StatusCode] = []
    try:
        for i in range(2):
            assert fleet.register(f"runner-{i}", fleet.runner(f"runner-{i}")).registered.wait(5)
        assert _wait(lambda: list(fleet.states().values()) == [READY, READY])

        def flood() -> None:
            with open_channel(fleet.router.address, security=fleet.creds.security("intruder")) as ch:
                stub = router_pb2_grpc.RouterControlStub(ch)
                while not stop.is_set():
                    for n in range(200):
                        rid = f"runner-{n % 2}" if n % 4 else f"bogus-{n}"
                        try:
                            stub.RegisterRunner(router_pb2.RegisterRunnerRequest(
                                runner_id=rid, address="127.0.0.1:9", model="fake", lease_seconds=60), timeout=5)
                        except grpc.RpcError as e:
                            refused.append(e.code())
                    stop.wait(0.5)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        ok = sum(bool(fleet.generate()) for _ in range(20))
        stop.set()
        t.join(30)
        assert ok == 20
        assert grpc.StatusCode.PERMISSION_DENIED in refused and grpc.StatusCode.RESOURCE_EXHAUSTED in refused
        states = fleet.states()
        assert states["runner-0"] == states["runner-1"] == READY
        assert all(s != READY for rid, s in states.items() if rid.startswith("bogus"))  # never health-checked OK
        assert len(states) <= 8
    finally:
        stop.set()
        fleet.close()


def test_the_same_identity_reclaims_its_id_after_a_restart_and_leaves_without_admin(fleet: Fleet) -> None:
    first = fleet.runner("runner-0")
    reg = fleet.register("runner-0", first)
    assert reg.registered.wait(5)
    reg.stop(drain=False)
    first.stop()  # killed: the lease is still live
    second = fleet.runner("runner-0")  # restarted on another port (a new pod IP)
    reg2 = fleet.register("runner-0", second)
    assert reg2.registered.wait(5) and _wait(lambda: fleet.states().get("runner-0") == READY)
    assert fleet.generate() and second.stats.requests == 1
    reg2.stop(drain=True)  # Heartbeat(leaving): needs only its own `register` scope
    assert fleet.states()["runner-0"] == router_pb2.RunnerStatus.STATE_DRAINING


def test_a_runner_serving_another_model_is_refused(fleet: Fleet) -> None:
    other = fleet.runner("runner-1", model="another-model")
    req = router_pb2.RegisterRunnerRequest(runner_id="runner-1", address=other.address, model="fake")
    assert _code(lambda: fleet.control("RegisterRunner", req, "runner-1")) == grpc.StatusCode.FAILED_PRECONDITION
    assert "runner-1" not in fleet.states()


def test_auth_off_a_live_ready_runner_is_not_replaced_from_another_address() -> None:
    router = RouterServer(RouterConfig(health_interval_s=0.1), ServerConfig(service="router", port=0))
    router.start()
    a, b = FakeRunner("a"), FakeRunner("b")
    try:
        with open_channel(router.address, security=ClientSecurity()) as ch:
            stub = router_pb2_grpc.RouterControlStub(ch)

            def reg(address: str, rid: str = "runner-0"):
                return stub.RegisterRunner(router_pb2.RegisterRunnerRequest(
                    runner_id=rid, address=address, model="fake", lease_seconds=60), timeout=5)

            reg(a.address)
            assert router.router.registry.is_ready("runner-0")
            assert _code(lambda: reg(b.address)) == grpc.StatusCode.FAILED_PRECONDITION
            reg(a.address)  # the same runner again (a restart on its fixed port) is fine
            reg("127.0.0.1:9", "runner-9")  # nothing answers there: registered, never READY
            assert not router.router.registry.is_ready("runner-9")
            a.stop()  # the holder dies: ejected by health checks, then the id may move
            assert _wait(lambda: not router.router.registry.is_ready("runner-0"))
            reg(b.address)
            assert router.router.registry.is_ready("runner-0")
    finally:
        router.stop()
        b.stop()
