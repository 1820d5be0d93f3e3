"""``warmserve router serve``: a :class:`~router_service.servicer.RouterServer` built from the
command-line flags, run until SIGTERM/SIGINT drains it. The front doors it serves beside
``warmserve.v1`` come from the layer above (``args.doors``, set by :mod:`kserve_service.cli`)."""

from __future__ import annotations

from collections.abc import Sequence

from router_service.config import RouterConfig
from router_service.servicer import Door, RouterServer
from services.bootstrap import config_from_args
from services.channel import client_security_from_args
from services.log import configure_logging


def serve_from_args(args, doors: Sequence[Door] = ()) -> None:
    """Entry point of ``warmserve router serve``: run until SIGTERM/SIGINT, then drain; ``doors``
    are served on the router's port (:data:`router_service.servicer.Door`)."""
    configure_logging("router", args.log_level)
    config = RouterConfig(
        static_runners=tuple(args.runner),
        policy=args.policy,
        default_lease_s=args.lease_seconds,
        health_interval_s=args.health_interval,
        eject_after=args.eject_after,
        first_token_timeout_s=args.first_token_timeout,
        served_model_name=args.served_model_name,
        max_runners=args.max_runners,
        max_stream_requests=args.max_stream_requests,
    )
    # What the router presents to the runners it dials (by the address each registered: an IP in
    # a pod network, hence --tls-server-name for their certificates' DNS name).
    server = RouterServer(config, config_from_args(args, "router"), doors, security=client_security_from_args(args))
    server.start()
    server.serve_forever()
