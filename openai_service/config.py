"""What ``warmserve openai serve`` needs: the router to call, where to listen, the model's name,
and the door's guards (API key, TLS files, body limit, allowed hosts, docs).
See ``docs/architecture.md`` §13."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.address import format_address, parse_address
from services.errors import InvalidArgument
from services.ports import DEFAULT_PORTS, DEFAULT_ROUTER, OPENAI

if TYPE_CHECKING:  # services.channel imports grpc; the CLI imports this module at start-up
    from services.channel import ClientSecurity

#: ``--max-body-bytes``' default: 4 MiB, room for a 1 MiB prompt JSON-escaped several times over.
DEFAULT_MAX_BODY_BYTES = 4 << 20


def _readable(path: str | None, flag: str) -> None:
    if path is not None and not os.path.isfile(path):
        raise InvalidArgument(f"{flag} {path}: no such file")


@dataclass(frozen=True)
class OpenAIConfig:
    """Settings of one OpenAI door, validated at construction (``InvalidArgument``).

    ``router``: ``host:port`` of the ``Generation`` endpoint (the router; a runner works too).
    ``host``/``port``: the HTTP bind address (port 0: a free one). ``served_model_name``: the
    model id published by ``GET /v1/models``; ``None`` = the default of the router's model source
    (:func:`services.model_name.served_model_name`). ``model_info_ttl_s``: seconds the router's
    ``ModelInfo`` (the model's source and limits) is reused before it is asked again. A client
    that disconnects cancels its ``Generate`` call, which frees the sequence on the runner.

    Guards (:mod:`openai_service.guard`): ``api_key`` (``None``: every route is open; never in
    ``repr``), ``max_body_bytes`` (bytes of an HTTP body, at least 1), ``allowed_hosts`` (the
    ``Host`` names answered, ``*.example.com`` wildcards allowed; empty: any), ``enable_docs``
    (serve ``/docs``, ``/redoc`` and ``/openapi.json``). TLS: ``tls_cert``/``tls_key`` (PEM
    files, both or neither) make the door HTTPS; ``tls_ca`` (needs them) requires client
    certificates signed by that CA (mTLS). ``router_security``: what the door presents to the
    router (its bearer token, TLS files; ``None``: plaintext, no token; never in ``repr``).
    """

    router: str = DEFAULT_ROUTER
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORTS[OPENAI]
    served_model_name: str | None = None
    model_info_ttl_s: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_hosts: tuple[str, ...] = ()
    enable_docs: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    router_security: ClientSecurity | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parse_address(self.router, what="--router")
        if not self.host:
            raise InvalidArgument("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"--port must be in [0, 65535] (0: a free port), got {self.port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidArgument("--served-model-name must not be empty")
        if self.model_info_ttl_s < 0:
            raise InvalidArgument(f"the ModelInfo TTL must be >= 0 seconds, got {self.model_info_ttl_s}")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise InvalidArgument("the API key must not be empty nor start or end with whitespace")
        if self.max_body_bytes < 1:
            raise InvalidArgument(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        for pattern in self.allowed_hosts:
            if not pattern or "*" in pattern[1:] or (pattern.startswith("*") and not pattern.startswith("*.")):
                raise InvalidArgument(f"--allowed-hosts: {pattern!r} is not a host name nor '*.example.com'")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise InvalidArgument("--tls-ca needs --tls-cert and --tls-key (mTLS is on top of TLS)")
        _readable(self.tls_cert, "--tls-cert")
        _readable(self.tls_key, "--tls-key")
        _readable(self.tls_ca, "--tls-ca")

    @property
    def address(self) -> str:
        """``host:port`` to bind (as configured: port 0 before the server picked one)."""
        return format_address(self.host, self.port)

    @property
    def scheme(self) -> str:
        """``https`` with TLS files, else ``http``."""
        return "https" if self.tls_cert is not None else "http"
