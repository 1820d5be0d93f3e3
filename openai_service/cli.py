"""``warmserve openai serve``: the OpenAI-compatible HTTP door over a router.

``warmserve openai serve [--router 127.0.0.1:50050] [--host 127.0.0.1] [--port 50053]
[--served-model-name NAME] [--log-level INFO]`` serves ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` and ``/health`` (see :mod:`openai_service.app`). Bad flags exit 2 with
a message. Heavy imports (FastAPI, uvicorn, gRPC) happen inside the handler.
"""

from __future__ import annotations

import argparse

from services.ports import DEFAULT_PORTS, DEFAULT_ROUTER, OPENAI

#: uvicorn's and the JSON log's levels.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def register(subparsers) -> None:
    """Add ``openai`` and its ``serve`` subcommand to the ``warmserve`` parser."""
    openai = subparsers.add_parser("openai", help="the OpenAI-compatible HTTP API (over the router)")
    sub = openai.add_subparsers(dest="openai_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve /v1/models, /v1/completions and /v1/chat/completions over HTTP")
    serve.add_argument("--router", default=DEFAULT_ROUTER,
                       help=f"the router's (or a runner's) Generation address, host:port (default {DEFAULT_ROUTER})")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORTS[OPENAI],
                       help=f"HTTP port, 0 = a free one (default {DEFAULT_PORTS[OPENAI]})")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id clients use (default: derived from the router's model source)")
    serve.add_argument("--token-file", default=None, metavar="F",
                       help="file holding the door's own token for the router (else $WARMSERVE_TOKEN)")
    serve.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                       help="log level (default INFO; DEBUG adds an access log)")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from openai_service.daemon import serve_from_args

    return serve_from_args(args)
