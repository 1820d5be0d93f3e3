"""Clients of the router's ``RouterControl`` service for operators and tools: list the runners,
drain one. (The runners' own registration and heartbeats are :mod:`runner_service.registration`.)
RPC errors come out as :class:`services.errors.WarmserveError` subclasses."""

from __future__ import annotations

import grpc

from services.channel import ClientSecurity, open_channel
from services.errors import from_rpc_error
from services.proto import router_pb2, router_pb2_grpc


def _call(address: str, method: str, request, *, timeout_s: float, ready_timeout_s: float | None = None,
          wait_for_ready: bool | None = None, security: ClientSecurity | None = None):
    with open_channel(address, security=security, ready_timeout_s=ready_timeout_s) as channel:
        rpc = getattr(router_pb2_grpc.RouterControlStub(channel), method)
        try:
            return rpc(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e


def list_runners(router_address: str, timeout_s: float = 5.0,
                 security: ClientSecurity | None = None) -> list[router_pb2.RunnerStatus]:
    """The router's ``ListRunners`` runners (``RunnerStatus`` messages); waits up to ``timeout_s``
    seconds for the router to come up."""
    return list(_call(router_address, "ListRunners", router_pb2.ListRunnersRequest(), timeout_s=timeout_s, security=security,
                      wait_for_ready=True).runners)


def drain_runner(router_address: str, runner_id: str, timeout_s: float = 5.0,
                 security: ClientSecurity | None = None) -> bool:
    """Ask the router to stop routing new requests to ``runner_id``; ``False`` when it knows no such
    runner. Raises ``Unavailable`` when the router cannot be reached within ``timeout_s`` seconds."""
    return _call(router_address, "Drain", router_pb2.DrainRequest(runner_id=runner_id), timeout_s=timeout_s, security=security,
                 ready_timeout_s=timeout_s).found
