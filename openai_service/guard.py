"""The checks a request passes before any route or body parser sees it (one ASGI middleware,
:class:`RequestGuard`): the ``Host`` header, the API key, the body's size. Each refusal is one
sentence in OpenAI's error shape (:mod:`openai_service.errors`). See ``docs/architecture.md`` §13.
"""

from __future__ import annotations

import hmac
from collections import deque
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_service.errors import OpenAIError
from services.refusals import Refusals

#: The paths open without the API key (probes, scrapes); with a key set every other path,
#: unknown ones included, needs it before any byte of the body is read. They take no body.
OPEN_PATHS: tuple[str, ...] = ("/health", "/metrics")
#: The documentation's paths, open too when ``--enable-docs`` serves them (a browser sends no key).
DOCS_PATHS: tuple[str, ...] = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def host_allowed(host_header: str | None, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header names one of ``allowed`` (lower-case names or ``*.domain``
    wildcards, starlette's ``TrustedHostMiddleware`` rule; empty: any). The port is ignored."""
    if not allowed:
        return True
    if not host_header:
        return False
    host = host_header.lower()
    host = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    return any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in allowed)


def bearer_matches(authorization: bytes | None, key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (scheme case-insensitive),
    compared in constant time (``hmac.compare_digest``) so timing tells nothing of the key."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class RequestGuard:
    """ASGI middleware in front of the app: a ``Host`` not in ``allowed_hosts`` is a 400; a
    request to any path but ``open_paths`` without ``Authorization: Bearer <api_key>`` a 401
    (with ``WWW-Authenticate: Bearer``; no key: open); a request to an open path that carries a
    body (``Content-Length`` > 0, or a ``Transfer-Encoding``) a 413; a body over
    ``max_body_bytes`` a 413, refused on its ``Content-Length`` before any byte is read, or,
    chunked, as soon as the bytes received pass the limit. So a client without the key makes
    the door hold no body at all. The body is read here (at most ``max_body_bytes`` of it held)
    and replayed to the app, so nothing downstream parses an oversize body. Each refusal is
    counted in ``refusals`` (by its :attr:`OpenAIError.reason <openai_service.errors.OpenAIError>`)
    when given."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 allowed_hosts: Sequence[str] = (), refusals: Refusals | None = None,
                 open_paths: Sequence[str] = OPEN_PATHS) -> None:
        self.app = app
        self.refusals = refusals
        self.open_paths = frozenset(open_paths)
        self.key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is None:
            body = await self._read_body(receive)
            if body is None:
                refusal = self._too_large()
            else:
                await self.app(scope, _replay(body, receive), send)
                return
        if self.refusals is not None:
            self.refusals.count(refusal)
        await JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> OpenAIError | None:
        if not host_allowed(headers.get("host"), self.allowed_hosts):
            return OpenAIError(400, "this server does not answer for that Host header", code="invalid_host",
                               reason="host")
        is_open = scope["path"] in self.open_paths
        if self.key is not None and not is_open:
            raw = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not bearer_matches(raw, self.key):
                return OpenAIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}, reason="api_key")
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            return OpenAIError(400, "the Content-Length header is not a number of bytes")
        if is_open and ((length is not None and int(length) > 0) or "transfer-encoding" in headers):
            return OpenAIError(413, f"{scope['path']} takes no request body", code="request_too_large",
                               reason="body_bytes")
        if length is not None and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is over the door's limit of {self.max_body_bytes} bytes "
                                "(--max-body-bytes)", code="request_too_large", reason="body_bytes")

    async def _read_body(self, receive: Receive) -> deque[Message] | None:
        """The request's body messages up to the last (or a disconnect), ``None`` once their
        bytes pass the limit (the rest is never read)."""
        messages: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: deque[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out ``messages`` first, then waits on the server's (the app
    listens there for the client's disconnect)."""

    async def replay() -> Message:
        return messages.popleft() if messages else await receive()

    return replay
