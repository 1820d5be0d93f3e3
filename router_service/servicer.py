"""gRPC adapters over :class:`router_service.router.Router`, and :class:`RouterServer`, the router
behind the server bootstrap.

The servicers only translate: protobuf in, core call, protobuf out (:mod:`router_service.convert`),
and :class:`services.errors.WarmserveError` to a gRPC status. :class:`RouterServer` puts the router
behind the shared :class:`services.bootstrap.ServiceServer` bootstrap (health, reflection, metrics,
drain) and exports per-runner gauges and the refusals (:attr:`Router.refusals
<router_service.router.Router.refusals>`); on the same port it serves the doors a layer above passes
in (:data:`Door`: ``warmserve router serve`` adds the KServe v2 / Triton door, :mod:`kserve_service`).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable, Sequence

from prometheus_client.core import GaugeMetricFamily

from router_service.config import RouterConfig
from router_service.convert import load_from_proto, runner_to_proto
from router_service.deadline import time_left
from router_service.registry import RunnerState
from router_service.router import Router
from services.address import format_address, parse_address
from services.auth import caller
from services.bootstrap import Registration, ServerConfig, ServiceServer
from services.channel import ClientSecurity
from services.errors import InvalidArgument, WarmserveError, abort_with
from services.generation_client import GENERATION_SERVICE
from services.proto import generation_pb2_grpc, router_pb2, router_pb2_grpc
from services.stream_slots import StreamSlots

log = logging.getLogger(__name__)

#: A front door served on the router's port beside ``warmserve.v1``: given the router's core and
#: the stream cap every door shares, the servicer to register (``(add_fn, servicer, service name)``).
Door = Callable[[Router, StreamSlots], Registration]

#: Hosts that mean "every interface": a runner bound there is dialled at the host it called from.
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_address(address: str, peer: str) -> str:
    """The address to dial a registering runner at: ``address`` as given, except that an empty or
    wildcard host (``:50061``, ``0.0.0.0:50061``, ``[::]:50061``) is replaced by the host the
    registration came from (gRPC ``peer`` such as ``ipv4:10.0.0.7:41234`` or ``ipv6:[::1]:5``)."""
    try:
        host, port = parse_address(address, allow_empty_host=True)
    except InvalidArgument:
        return address  # the registry refuses it, saying why
    if host not in _WILDCARD_HOSTS:
        return address
    kind, _, rest = peer.partition(":")
    try:
        if kind not in ("ipv4", "ipv6"):
            raise InvalidArgument(f"a {kind or 'peer'} address has no host")
        peer_host, _ = parse_address(urllib.parse.unquote(rest), what="peer address")
    except InvalidArgument as e:
        raise InvalidArgument(f"runner address {address!r} has no host and the caller's ({peer}) is unknown") from e
    return format_address(peer_host, port)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """``Generate`` relays to a runner; ``ModelInfo`` forwards to a READY runner."""

    def __init__(self, router: Router, slots: StreamSlots | None = None) -> None:
        """``slots`` caps the streams served at once (:mod:`services.stream_slots`)."""
        self._router = router
        self._slots = slots or StreamSlots(ServerConfig.max_streams, "the router")

    def Generate(self, request, context):
        """Relay the request to a runner and stream its answer back."""
        refusals = self._router.refusals
        try:
            self._slots.take(context)
            stream = self._router.generate(request, timeout_s=time_left(context))
        except WarmserveError as e:
            refusals.abort(context, e)
        context.add_callback(stream.cancel)  # client cancel / deadline -> cancel the runner's call
        try:
            yield from stream
        except WarmserveError as e:
            refusals.abort(context, e)

    def ModelInfo(self, request, context):
        """A READY runner's ``ModelInfo``."""
        try:
            left = time_left(context)
            return self._router.model_info(timeout_s=5.0 if left is None else left)
        except WarmserveError as e:
            abort_with(context, e)


class RouterControlServicer(router_pb2_grpc.RouterControlServicer):
    """Registration, heartbeats, listing and draining of runners."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def RegisterRunner(self, request, context):
        """Admit (or re-admit) a runner under a new lease, bound to the caller's credential: READY
        once health-checked and its model compared (:mod:`router_service.admission`), else
        UNHEALTHY until the health checker verifies it."""
        identity = _identity()
        try:
            address = advertised_address(request.address, context.peer())
            registry = self._router.registry
            registry.check_claim(request.runner_id, address, identity)  # refused before any dial
            pending = self._router.verify(request.runner_id, address, request.model)
            lease = registry.register(
                request.runner_id, address, model=request.model, max_num_seqs=request.max_num_seqs,
                lease_s=request.lease_seconds, identity=identity, verified=pending is None)
        except WarmserveError as e:
            abort_with(context, e)
        log.info("runner registered", extra={"runner_id": request.runner_id, "address": address,
                                             "identity": identity, "verified": pending is None,
                                             "pending": pending or ""})
        return router_pb2.RegisterRunnerResponse(lease_id=lease.lease_id, lease_seconds=lease.lease_s,
                                                 heartbeat_interval_seconds=lease.heartbeat_interval_s)

    def Heartbeat(self, request, context):
        """Renew a runner's lease and record its load (``leaving``: drain it, it is shutting
        down); ``known=false`` asks it to register again. Only its registrant may."""
        load = load_from_proto(request.load) if request.HasField("load") else None
        try:
            granted = self._router.registry.heartbeat(request.runner_id, request.lease_id, load,
                                                      identity=_identity(), leaving=request.leaving)
        except WarmserveError as e:
            abort_with(context, e)
        if granted is None:
            return router_pb2.HeartbeatResponse(known=False)
        return router_pb2.HeartbeatResponse(known=True, lease_seconds=granted)

    def ListRunners(self, request, context):
        """Every runner with its state, lease, load and counters."""
        registry = self._router.registry
        return router_pb2.ListRunnersResponse(
            runners=[runner_to_proto(r, registry.lease_remaining_s(r)) for r in registry.snapshot()])

    def Drain(self, request, context):
        """Stop routing new requests to a runner."""
        return router_pb2.DrainResponse(found=self._router.registry.drain(request.runner_id))


def _identity() -> str | None:
    """The name of the credential the current RPC carries (``None``: auth off)."""
    cred = caller()
    return cred.name if cred is not None else None


class _RunnerGauges:
    """Prometheus collector: per-runner outstanding requests and READY flag, read at scrape time."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self):
        outstanding = GaugeMetricFamily("warmserve_router_outstanding", "requests in flight per runner",
                                        labels=["runner_id"])
        ready = GaugeMetricFamily("warmserve_router_runner_ready", "1 when the runner is READY",
                                  labels=["runner_id"])
        for r in self._router.registry.snapshot():
            outstanding.add_metric([r.runner_id], r.outstanding)
            ready.add_metric([r.runner_id], 1.0 if r.state is RunnerState.READY else 0.0)
        yield outstanding
        yield ready


class RouterServer:
    """The router daemon: a :class:`Router` served by a :class:`ServiceServer`.

    ``start()`` returns the bound port; ``serve_forever()`` blocks until SIGTERM/SIGINT drained
    the server, then stops the router; ``stop()`` stops both at once (tests).
    """

    def __init__(self, config: RouterConfig, server_config: ServerConfig, doors: Sequence[Door] = (),
                 security: ClientSecurity | None = None) -> None:
        """``doors``: the front doors to serve beside ``Generation`` and ``RouterControl``;
        ``security``: what the router presents to runners (:class:`Router`)."""
        self.router = Router(config, security)
        #: One cap for every door's streams (:mod:`services.stream_slots`).
        self.slots = StreamSlots(server_config.max_streams, "the router")
        self.server = ServiceServer(server_config, [
            (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(self.router, self.slots),
             GENERATION_SERVICE),
            (router_pb2_grpc.add_RouterControlServicer_to_server, RouterControlServicer(self.router),
             "warmserve.v1.RouterControl"),
            *(door(self.router, self.slots) for door in doors),
        ], self.router.refusals)
        self.server.registry.register(_RunnerGauges(self.router))

    @property
    def address(self) -> str:
        """``host:port`` the router serves on (valid after :meth:`start`)."""
        return self.server.address

    def start(self) -> int:
        """Start health checks and the gRPC server; returns the bound port."""
        self.router.start()
        try:
            return self.server.start()
        except BaseException:
            self.router.stop()
            raise

    def serve_forever(self) -> None:
        """Serve until a signal drains the server, then stop the router."""
        try:
            self.server.serve_forever()
        finally:
            self.router.stop()

    def stop(self) -> None:
        """Stop serving and the router at once."""
        self.server.stop()
        self.router.stop()
