"""The router core: runner table + policies + health checks + relay, without any server.

``Router(config).start()`` begins health checking (and lease expiry); :meth:`Router.generate`
returns a :class:`router_service.relay.RelayStream` for one request; :meth:`Router.model_info`
asks a READY runner; :attr:`Router.registry` takes registrations, heartbeats and drains;
:attr:`Router.refusals` counts what the router and its doors refuse at a limit.
``stop()`` ends health checks and closes every runner channel (cancelling calls in flight).
"""

from __future__ import annotations

import logging
import time

import grpc

from router_service.admission import verify_runner
from router_service.channels import ChannelPool
from router_service.config import RouterConfig
from router_service.health_checker import HealthChecker
from router_service.policy import PolicySet
from router_service.registry import Runner, RunnerRegistry, RunnerState
from router_service.relay import InFlight, RelayStream, upstream_error
from services.channel import ClientSecurity
from services.errors import Unavailable
from services.proto import generation_pb2, generation_pb2_grpc
from services.refusals import Refusals

log = logging.getLogger(__name__)


class Router:
    """Routes ``Generate`` calls to runners (see the package modules for each part); every call
    to a runner presents ``security`` (the router's token and TLS files: ``--tls-server-name``
    names the certificate runners dialled by IP must carry)."""

    def __init__(self, config: RouterConfig, security: ClientSecurity | None = None) -> None:
        self.config = config
        self.registry = RunnerRegistry(config)
        self.channels = ChannelPool(security)
        self.policies = PolicySet(config)
        self.health = HealthChecker(config, self.registry, self.channels)
        #: Relays calling each runner now: an ejected runner's calls without output are retried.
        self.in_flight = InFlight()
        #: Requests refused at a limit by this router and its doors (``warmserve_refused_total``).
        self.refusals = Refusals()
        self.registry.on_removed(self._on_runner_removed)
        self.registry.on_ejected(self._on_runner_ejected)

    def start(self) -> None:
        """Start health checks and lease expiry (the first round runs at once)."""
        self.health.start()

    def stop(self) -> None:
        """Stop health checks and close all runner channels."""
        self.health.stop()
        self.channels.close_all()

    def _on_runner_ejected(self, runner: Runner) -> None:
        moved = self.in_flight.abandon(runner.runner_id, f"the router ejected {runner.runner_id} ({runner.last_error})")
        log.info("runner ejected", extra={"runner_id": runner.runner_id, "address": runner.address,
                                          "reason": runner.last_error, "calls_retried": moved})

    def _on_runner_removed(self, runner: Runner) -> None:
        moved = self.in_flight.abandon(runner.runner_id, f"{runner.runner_id} left the router's table")
        log.info("runner removed", extra={"runner_id": runner.runner_id, "address": runner.address,
                                          "reason": "lease expired", "calls_retried": moved})
        if all(r.address != runner.address for r in self.registry.snapshot()):
            self.channels.close(runner.address)

    def generate(self, request: generation_pb2.GenerateRequest, *, timeout_s: float | None) -> RelayStream:
        """A relay for ``request`` with ``timeout_s`` seconds left (``None``: no deadline).

        Raises ``InvalidArgument`` at once for an unknown ``routing`` value; the stream itself
        raises the errors listed in :mod:`router_service.relay`.
        """
        chooser = self.policies.for_request(request)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return RelayStream(request, chooser, registry=self.registry, channels=self.channels,
                           max_attempts=self.config.max_attempts, deadline=deadline,
                           first_token_timeout_s=self.config.first_token_timeout_s, in_flight=self.in_flight)

    def model_info(self, *, timeout_s: float = 5.0) -> generation_pb2.ModelInfoResponse:
        """``ModelInfo`` of a READY runner (the default policy picks it; an unreachable runner is
        ejected and the next one asked). Raises ``Unavailable`` naming the runners when none answers."""
        tried: set[str] = set()
        failures: list[str] = []
        chooser = self.policies.default_chooser()
        while True:
            runner = self.registry.acquire(chooser, exclude=frozenset(tried))
            if runner is None:
                detail = "; ".join(failures) if failures else self.registry.describe()
                raise Unavailable(f"no runner is ready ({detail})")
            tried.add(runner.runner_id)
            try:
                stub = generation_pb2_grpc.GenerationStub(self.channels.get(runner.address))
                return stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=timeout_s)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise upstream_error(e, runner) from e
                self.registry.eject(runner.runner_id, f"UNAVAILABLE: {e.details()}")
                failures.append(f"{runner.runner_id} ({runner.address}): {e.details()}")
            finally:
                self.registry.release(runner.runner_id)

    def verify(self, runner_id: str, address: str, model: str) -> str | None:
        """Admission check of a registering runner (:func:`router_service.admission.verify_runner`
        against the other runners' models): ``None`` when admitted, else why not yet; raises
        ``FailedPrecondition`` for another model."""
        return verify_runner(self.channels.get(address), runner_id, model=model,
                             fleet_models=self.registry.models(exclude=runner_id),
                             timeout_s=self.config.admission_timeout_s)

    def ready_count(self) -> int:
        """How many runners are READY now."""
        return sum(r.state is RunnerState.READY for r in self.registry.snapshot())

    def wait_ready(self, count: int, timeout_s: float) -> bool:
        """Block until at least ``count`` runners are READY; ``False`` after ``timeout_s`` seconds."""
        end = time.monotonic() + timeout_s
        while self.ready_count() < count:
            if time.monotonic() >= end:
                return False
            time.sleep(0.02)
        return True
