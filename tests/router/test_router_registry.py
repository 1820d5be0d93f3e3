"""The runner table: leases on a controlled clock, ejection/re-admission, drain, atomic acquire."""

from __future__ import annotations

import pytest

from router_service.config import RouterConfig
from router_service.registry import RunnerLoad, RunnerRegistry, RunnerState
from services.errors import InvalidArgument


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _first(candidates):
    return candidates[0]


def test_lease_is_granted_clamped_and_expires() -> None:
    clock = Clock()
    reg = RunnerRegistry(RouterConfig(default_lease_s=6.0, min_lease_s=1.0, max_lease_s=20.0), clock)
    lease = reg.register("r0", "127.0.0.1:5001", model="m", max_num_seqs=4)
    assert (lease.lease_s, lease.heartbeat_interval_s) == (6.0, 2.0)
    assert reg.register("r1", "127.0.0.1:5002", lease_s=100.0).lease_s == 20.0
    assert reg.register("r2", "127.0.0.1:5003", lease_s=0.1).lease_s == 1.0
    clock.t += 5.0
    assert reg.heartbeat("r0", lease.lease_id, RunnerLoad(running=2, kv_blocks_total=10)) == 6.0
    clock.t += 4.0  # r0 renewed at +5 (expires +11); r2 (+1) and r1 (+20) as granted
    removed = reg.expire()
    assert [r.runner_id for r in removed] == ["r2"]
    snap = {r.runner_id: r for r in reg.snapshot()}
    assert set(snap) == {"r0", "r1"}
    assert snap["r0"].load == RunnerLoad(running=2, kv_blocks_total=10)
    assert reg.lease_remaining_s(snap["r0"]) == pytest.approx(2.0)
    clock.t += 2.5
    assert [r.runner_id for r in reg.expire()] == ["r0"]


def test_heartbeat_with_unknown_or_stale_lease_says_unknown() -> None:
    clock = Clock()
    reg = RunnerRegistry(RouterConfig(default_lease_s=3.0, min_lease_s=1.0), clock)
    first = reg.register("r0", "127.0.0.1:5001")
    assert reg.heartbeat("nobody", first.lease_id) is None
    second = reg.register("r0", "127.0.0.1:5001")  # the runner restarted
    assert reg.heartbeat("r0", first.lease_id) is None
    assert reg.heartbeat("r0", second.lease_id) == 3.0
    clock.t += 3.0  # expired but not yet reaped: the heartbeat must not revive it
    assert reg.heartbeat("r0", second.lease_id) is None
    assert reg.snapshot() == []


def test_registration_is_validated() -> None:
    reg = RunnerRegistry(RouterConfig(static_runners=("127.0.0.1:7000",)))
    with pytest.raises(InvalidArgument, match="runner_id is empty"):
        reg.register("", "127.0.0.1:1")
    with pytest.raises(InvalidArgument, match="host:port"):
        reg.register("r", "localhost")
    with pytest.raises(InvalidArgument, match="lease_seconds"):
        reg.register("r", "127.0.0.1:1", lease_s=-1)
    with pytest.raises(InvalidArgument, match="static"):
        reg.register("127.0.0.1:7000", "127.0.0.1:7000")
    with pytest.raises(InvalidArgument, match="host:port"):
        RouterConfig(static_runners=("127.0.0.1",))


def test_a_nan_lease_is_refused_not_granted_forever() -> None:
    """Found by tests/fuzz: NaN passed the ``< 0`` check and was granted as a lease that never expired."""
    reg = RunnerRegistry(RouterConfig())
    with pytest.raises(InvalidArgument, match="lease_seconds must be a number"):
        reg.register("r", "127.0.0.1:1", lease_s=float("nan"))
    assert reg.snapshot() == []
    assert reg.register("r", "127.0.0.1:1", lease_s=float("inf")).lease_s == RouterConfig().max_lease_s


def test_static_runner_waits_for_a_health_check_and_never_expires() -> None:
    clock = Clock()
    reg = RunnerRegistry(RouterConfig(static_runners=("127.0.0.1:7000",), readmit_after=1), clock)
    (r,) = reg.snapshot()
    assert (r.runner_id, r.static, r.state) == ("127.0.0.1:7000", True, RunnerState.UNHEALTHY)
    assert reg.acquire(_first) is None
    reg.record_result("127.0.0.1:7000", True)
    clock.t += 1e6
    assert reg.expire() == []
    assert reg.snapshot()[0].state is RunnerState.READY
    assert reg.lease_remaining_s(reg.snapshot()[0]) == -1.0


def test_ejection_after_k_failures_and_readmission() -> None:
    reg = RunnerRegistry(RouterConfig(eject_after=3, readmit_after=2))
    reg.register("r0", "127.0.0.1:5001")
    for _ in range(2):
        reg.record_result("r0", False, "boom")
    assert reg.snapshot()[0].state is RunnerState.READY
    reg.record_result("r0", True)  # a success resets the failure count
    for _ in range(2):
        reg.record_result("r0", False, "boom")
    assert reg.snapshot()[0].state is RunnerState.READY
    reg.record_result("r0", False, "boom")
    r = reg.snapshot()[0]
    assert (r.state, r.consecutive_failures) == (RunnerState.UNHEALTHY, 3)
    assert "r0 (127.0.0.1:5001) UNHEALTHY: boom" in reg.describe()
    reg.record_result("r0", True)
    assert reg.snapshot()[0].state is RunnerState.UNHEALTHY
    reg.record_result("r0", True)
    assert reg.snapshot()[0].state is RunnerState.READY


def test_drain_keeps_a_runner_out_until_it_registers_again() -> None:
    reg = RunnerRegistry(RouterConfig())
    reg.register("r0", "127.0.0.1:5001")
    assert reg.drain("r0") and not reg.drain("ghost")
    reg.record_result("r0", True)
    assert reg.snapshot()[0].state is RunnerState.DRAINING
    assert reg.acquire(_first) is None
    reg.register("r0", "127.0.0.1:5001")
    assert reg.snapshot()[0].state is RunnerState.READY


def test_acquire_counts_outstanding_and_honours_exclusions() -> None:
    reg = RunnerRegistry(RouterConfig())
    reg.register("a", "127.0.0.1:5001")
    reg.register("b", "127.0.0.1:5002")

    def least(c):
        return min(c, key=lambda r: r.outstanding)

    picks = [reg.acquire(least).runner_id for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]
    assert reg.acquire(least, exclude=frozenset({"a", "b"})) is None
    assert reg.acquire(least, exclude=frozenset({"a"})).runner_id == "b"
    assert {r.runner_id: r.outstanding for r in reg.snapshot()} == {"a": 2, "b": 3}
    for rid in ("a", "a", "a"):
        reg.release(rid)
    assert {r.runner_id: r.outstanding for r in reg.snapshot()} == {"a": 0, "b": 3}
