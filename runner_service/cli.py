"""``warmserve runner serve``: the runner daemon's command line.

It prepares (or fetches) the weight sidecar, builds the engine and only then starts the
``Generation`` service, so health says ``SERVING`` once the runner can generate. Its flags are
declared in :mod:`runner_service.options`; heavy imports happen inside the handler.
"""

from __future__ import annotations

from runner_service.options import add_serve_options
from services.ports import DEFAULT_PORTS, RUNNER


def register(subparsers) -> None:
    """Add ``runner serve`` to the ``warmserve`` parser."""
    from services.bootstrap import add_server_args

    runner = subparsers.add_parser("runner", help="the data-plane runner (Generation service)")
    sub = runner.add_subparsers(dest="runner_command", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser("serve", help="serve a model over gRPC (Generation)")
    add_serve_options(serve)
    add_server_args(serve, default_port=DEFAULT_PORTS[RUNNER])
    serve.set_defaults(func=_serve)


def _serve(args) -> int:
    from runner_service.daemon import serve_from_args

    return serve_from_args(args)
