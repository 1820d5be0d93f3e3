"""The KServe door as the router process serves it: :func:`kserve_door`, a
:data:`router_service.servicer.Door`, and :func:`router_server`, the router with this door, as
``warmserve router serve`` builds it (``docs/architecture.md`` §10)."""

from __future__ import annotations

from kserve_service.servicer import SERVICE_NAME, KServeServicer
from router_service.config import RouterConfig
from router_service.router import Router
from router_service.servicer import Door, RouterServer
from services.bootstrap import Registration, ServerConfig
from services.channel import ClientSecurity
from services.proto.triton import grpc_service_pb2_grpc as kserve_pb2_grpc
from services.stream_slots import StreamSlots


def kserve_door(router: Router, slots: StreamSlots) -> Registration:
    """``inference.GRPCInferenceService`` over ``router``, its calls counted in ``slots``."""
    return kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, KServeServicer(router, slots), SERVICE_NAME


#: The doors the router process serves beside ``warmserve.v1`` (the OpenAI door is its own process).
ROUTER_DOORS: tuple[Door, ...] = (kserve_door,)


def router_server(config: RouterConfig, server_config: ServerConfig,
                  security: ClientSecurity | None = None) -> RouterServer:
    """The router process's server: a :class:`RouterServer` with :data:`ROUTER_DOORS`, dialling
    runners with ``security``."""
    return RouterServer(config, server_config, ROUTER_DOORS, security=security)
