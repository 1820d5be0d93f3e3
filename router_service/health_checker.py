"""Periodic grpc.health.v1 checks of every runner, plus lease expiry.

Each round (every ``health_interval_s`` seconds) first drops runners whose lease ran out, then
asks every remaining runner ``Health.Check(service="warmserve.v1.Generation")`` concurrently with
a ``health_timeout_s`` deadline. SERVING counts as a success; NOT_SERVING, an RPC error or a
timeout as a failure; :meth:`router_service.registry.RunnerRegistry.record_result` turns the
counts into ejection and re-admission. A registered runner not yet verified is also asked its
``ModelInfo`` (:mod:`router_service.admission`) and becomes READY only when that passes.
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_service.admission import verify_runner
from router_service.channels import ChannelPool
from router_service.config import RouterConfig
from router_service.registry import Runner, RunnerRegistry
from services.errors import FailedPrecondition
from services.generation_client import GENERATION_SERVICE

log = logging.getLogger(__name__)


class HealthChecker:
    """Runs check rounds on a daemon thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, config: RouterConfig, registry: RunnerRegistry, channels: ChannelPool) -> None:
        self._config = config
        self._registry = registry
        self._channels = channels
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0  # completed rounds (for tests and status)

    def check_once(self) -> None:
        """One round: expire leases, then check every runner (blocks up to the check timeout)."""
        self._registry.expire()
        pending = []
        request = health_pb2.HealthCheckRequest(service=GENERATION_SERVICE)
        for runner in self._registry.snapshot():
            try:
                stub = health_pb2_grpc.HealthStub(self._channels.get(runner.address))
                pending.append((runner, stub.Check.future(request, timeout=self._config.health_timeout_s)))
            except RuntimeError:  # pool closed: the router is stopping
                return
        for runner, future in pending:
            try:
                status = future.result().status
                ok = status == health_pb2.HealthCheckResponse.SERVING
                error = "" if ok else f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            except grpc.RpcError as e:
                ok, error = False, f"health check failed: {e.code().name} {e.details() or ''}".strip()
            if ok and not runner.verified:
                ok, error = self._verify(runner)
            before = runner.state
            self._registry.record_result(runner.runner_id, ok, error)
            after = next((r.state for r in self._registry.snapshot() if r.runner_id == runner.runner_id), None)
            if after is not None and after is not before:
                log.info("runner state", extra={"runner_id": runner.runner_id, "address": runner.address,
                                                "from": before.value, "to": after.value, "error": error})
        self.rounds += 1

    def _verify(self, runner: Runner) -> tuple[bool, str]:
        """Admit a registered runner not yet verified (:mod:`router_service.admission`) once it
        answers; ``(ok, error)`` for :meth:`RunnerRegistry.record_result`."""
        try:
            pending = verify_runner(self._channels.get(runner.address), runner.runner_id, model=runner.model,
                                    fleet_models=self._registry.models(exclude=runner.runner_id),
                                    timeout_s=self._config.health_timeout_s)
        except FailedPrecondition as e:
            return False, str(e)
        except RuntimeError:  # pool closed: the router is stopping
            return False, "the router is stopping"
        if pending is not None:
            return False, pending
        self._registry.mark_verified(runner.runner_id, runner.lease_id)
        return True, ""

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:
                log.exception("health check round failed")
            self._stop.wait(self._config.health_interval_s)

    def start(self) -> None:
        """Start checking on a daemon thread (the first round runs at once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="router-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for the round in progress to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
