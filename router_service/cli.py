"""``warmserve router ...``: the router daemon and its control commands.

``warmserve router serve [--port 50050] [--runner ADDR ...] [--policy P] [--lease-seconds S]
[--health-interval S] [--eject-after K] [--served-model-name NAME] [--max-stream-requests N] [--max-runners N]`` runs the router (``warmserve.v1``
and the KServe v2 / Triton ``inference.GRPCInferenceService`` on one port); ``warmserve router
drain RUNNER_ID`` stops routing new requests to one runner. Heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse

from router_service.config import DEFAULT_POLICY, POLICY_NAMES, RouterConfig
from services.ports import DEFAULT_PORTS, DEFAULT_ROUTER, ROUTER


def register(subparsers) -> None:
    """Add ``router`` and its subcommands to the ``warmserve`` parser."""
    router = subparsers.add_parser("router", help="the request router (one endpoint for many runners)")
    router.set_defaults(doors=())  # the front doors `serve` adds: a layer above sets them (kserve_service.cli)
    sub = router.add_subparsers(dest="router_command", metavar="ACTION", required=True)

    serve = sub.add_parser("serve", help="run the router daemon")
    from services.bootstrap import add_server_args, int_at_least
    from services.channel import add_client_security_args

    add_server_args(serve, default_port=DEFAULT_PORTS[ROUTER])
    serve.add_argument("--runner", action="append", default=[], metavar="ADDR",
                       help="a static runner host:port (repeatable); runners may also register themselves")
    serve.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY,
                       help=f"default routing policy (default {DEFAULT_POLICY})")
    serve.add_argument("--lease-seconds", type=float, default=10.0,
                       help="lease granted to registering runners when they ask for none (default 10)")
    serve.add_argument("--health-interval", type=float, default=1.0,
                       help="seconds between health checks of each runner (default 1)")
    serve.add_argument("--eject-after", type=int, default=3,
                       help="consecutive failed health checks before a runner is ejected (default 3)")
    serve.add_argument("--first-token-timeout", type=float, default=30.0,
                       help="seconds to a request's first token before it is retried elsewhere (default 30; 0: off)")
    serve.add_argument("--served-model-name", default="", metavar="NAME",
                       help="the model name KServe v2 / Triton clients use (default: derived from the runners' "
                            "model source, e.g. smollm2-135m-instruct)")
    serve.add_argument("--max-runners", type=int_at_least(1), default=64,
                       help="registered runners the router holds at most; one more is RESOURCE_EXHAUSTED (default 64)")
    serve.add_argument("--max-stream-requests", type=int_at_least(1), default=RouterConfig.max_stream_requests,
                       metavar="N", help="requests in flight at once on one KServe ModelStreamInfer stream; one more "
                                         f"is refused in the stream (default {RouterConfig.max_stream_requests})")
    serve.set_defaults(func=_serve)

    drain = sub.add_parser("drain", help="stop routing new requests to a runner")
    drain.add_argument("runner_id")
    drain.add_argument("--addr", default=DEFAULT_ROUTER, help=f"router address (default {DEFAULT_ROUTER})")
    add_client_security_args(drain)  # Drain needs the 'admin' scope when the router checks tokens
    drain.set_defaults(func=_drain)


def _serve(args: argparse.Namespace) -> int:
    from router_service.daemon import serve_from_args

    serve_from_args(args, args.doors)
    return 0


def _drain(args: argparse.Namespace) -> int:
    from router_service.client import drain_runner
    from services.channel import client_security_from_args
    from services.errors import NotFound

    if not drain_runner(args.addr, args.runner_id, security=client_security_from_args(args)):
        raise NotFound(f"the router at {args.addr} knows no runner {args.runner_id!r}")
    print(f"draining {args.runner_id}")
    return 0
