"""``warmserve openai serve``: the OpenAI-compatible HTTP door over a router.

``warmserve openai serve [--router 127.0.0.1:50050] [--host 127.0.0.1] [--port 50053]
[--served-model-name NAME] [--api-key-file F] [--tls-cert F --tls-key F [--tls-ca F]] [--router-tls-ca F]
[--max-body-bytes N] [--allowed-hosts H,...] [--enable-docs] [--log-level INFO]`` serves
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and ``/health`` (see
:mod:`openai_service.app`). The API key is read from a file or ``WARMSERVE_API_KEY``, never
from argv (which every local user can read). Bad flags exit 2 with a message. Heavy imports
(FastAPI, uvicorn, gRPC) happen inside the handler.
"""

from __future__ import annotations

import argparse

from openai_service.config import DEFAULT_MAX_BODY_BYTES
from services.ports import DEFAULT_PORTS, DEFAULT_ROUTER, OPENAI

#: uvicorn's and the JSON log's levels.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def register(subparsers) -> None:
    """Add ``openai`` and its ``serve`` subcommand to the ``warmserve`` parser."""
    openai = subparsers.add_parser("openai", help="the OpenAI-compatible HTTP API (over the router)")
    sub = openai.add_subparsers(dest="openai_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve /v1/models, /v1/completions and /v1/chat/completions over HTTP",
                           allow_abbrev=False)  # "--api-key K" must not pass for "--api-key-file K"
    serve.add_argument("--router", default=DEFAULT_ROUTER,
                       help=f"the router's (or a runner's) Generation address, host:port (default {DEFAULT_ROUTER})")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORTS[OPENAI],
                       help=f"HTTP port, 0 = a free one (default {DEFAULT_PORTS[OPENAI]})")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id clients use (default: derived from the router's model source)")
    serve.add_argument("--api-key-file", default=None, metavar="F",
                       help="require 'Authorization: Bearer <key>' on /v1, the key being F's first line "
                            "(default: the env WARMSERVE_API_KEY; neither: no key, every route is open)")
    serve.add_argument("--tls-cert", default=None, metavar="F", help="serve HTTPS with this PEM certificate (chain)")
    serve.add_argument("--tls-key", default=None, metavar="F", help="the certificate's PEM private key")
    serve.add_argument("--tls-ca", default=None, metavar="F",
                       help="require client certificates signed by this PEM CA (mTLS)")
    serve.add_argument("--router-tls-ca", default=None, metavar="F",
                       help="dial the router over TLS, verifying it against this PEM CA and presenting --tls-cert "
                            "(default: --tls-ca; neither: plaintext); HTTP clients need no certificate for it")
    serve.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="the name the router's certificate carries (when it is dialled over TLS)")
    serve.add_argument("--token-file", default=None, metavar="F",
                       help="the door's own token for the router (else $WARMSERVE_TOKEN)")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                       help=f"refuse request bodies over N bytes with 413 (default {DEFAULT_MAX_BODY_BYTES})")
    serve.add_argument("--allowed-hosts", default=None, metavar="H,...",
                       help="answer only these Host names ('*.example.com' allowed; default: any)")
    serve.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    serve.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                       help="log level (default INFO; DEBUG adds an access log)")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from openai_service.daemon import serve_from_args

    return serve_from_args(args)
