"""Admission of a registering runner: before the router routes to it, the runner must answer
``grpc.health.v1`` SERVING for ``warmserve.v1.Generation`` and its ``ModelInfo`` must name the
model it registered with, and that model must be the one the router's other runners serve
(``docs/architecture.md`` §4, ``docs/security.md``).

:func:`verify_runner` says whether a runner is admitted now (``None``), not yet (a sentence: it
cannot be reached or is not SERVING; the health checker asks again each round), or never
(``FailedPrecondition``: another model).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.errors import FailedPrecondition
from services.generation_client import GENERATION_SERVICE
from services.proto import generation_pb2, generation_pb2_grpc


def verify_runner(channel: grpc.Channel, runner_id: str, *, model: str, fleet_models: set[str],
                  timeout_s: float) -> str | None:
    """Health-check and compare the model of the runner behind ``channel`` (each call at most
    ``timeout_s`` seconds). ``model``: what it registered with (``""``: not said);
    ``fleet_models``: the models of the router's other verified runners. Returns ``None`` when
    admitted, else why not yet; raises ``FailedPrecondition`` when its model differs from
    ``model`` or from the fleet's."""
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=timeout_s)
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
        info = generation_pb2_grpc.GenerationStub(channel).ModelInfo(generation_pb2.ModelInfoRequest(),
                                                                     timeout=timeout_s)
    except grpc.RpcError as e:
        return f"not yet verified: {e.code().name} {e.details() or ''}".strip()
    if model and info.model != model:
        raise FailedPrecondition(f"runner {runner_id!r} registered as serving {model!r} but its ModelInfo says "
                                 f"{info.model!r}")
    served = model or info.model
    if served and fleet_models and served not in fleet_models:
        raise FailedPrecondition(f"runner {runner_id!r} serves {served!r}; this router's runners serve "
                                 f"{', '.join(sorted(fleet_models))}")
    return None
