"""Convert the router's runner table entries to and from the ``warmserve.v1`` router messages."""

from __future__ import annotations

from router_service.registry import Runner, RunnerLoad, RunnerState
from services.proto import router_pb2

_STATE_TO_PB = {
    RunnerState.READY: router_pb2.RunnerStatus.STATE_READY,
    RunnerState.UNHEALTHY: router_pb2.RunnerStatus.STATE_UNHEALTHY,
    RunnerState.DRAINING: router_pb2.RunnerStatus.STATE_DRAINING,
}


def load_from_proto(msg: router_pb2.RunnerLoad) -> RunnerLoad:
    """The :class:`RunnerLoad` a heartbeat reports."""
    return RunnerLoad(msg.running, msg.waiting, msg.kv_blocks_used, msg.kv_blocks_total)


def load_to_proto(load: RunnerLoad) -> router_pb2.RunnerLoad:
    """The inverse of :func:`load_from_proto`."""
    return router_pb2.RunnerLoad(running=load.running, waiting=load.waiting,
                                 kv_blocks_used=load.kv_blocks_used, kv_blocks_total=load.kv_blocks_total)


def runner_to_proto(runner: Runner, lease_expires_in_s: float) -> router_pb2.RunnerStatus:
    """``runner`` as a ``ListRunners`` entry; ``lease_expires_in_s`` is -1 for a static runner."""
    return router_pb2.RunnerStatus(
        runner_id=runner.runner_id, address=runner.address, model=runner.model, state=_STATE_TO_PB[runner.state],
        outstanding=runner.outstanding, lease_expires_in_s=lease_expires_in_s, static=runner.static,
        consecutive_failures=runner.consecutive_failures, load=load_to_proto(runner.load))
