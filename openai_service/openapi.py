"""The door's OpenAPI schema, as the door answers: every route's error statuses with the
:class:`~openai_service.protocol.ErrorResponse` body (not FastAPI's 422, which the door never
sends), a streamed 200 as ``text/event-stream``, and the bearer scheme when an API key is set.
Served at ``/openapi.json`` only with ``--enable-docs``; ``app.openapi()`` builds it in-process
either way. See ``docs/architecture.md`` §13.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from openai_service.guard import PROTECTED_PREFIX
from openai_service.protocol import ErrorResponse

#: Each error status the door answers, and when.
ERROR_STATUSES = {
    400: "the request is invalid (body, field, Host or Content-Length), or can never fit the model",
    401: "no valid API key (`Authorization: Bearer <key>`), or the router refused the door's credential",
    404: "unknown route or model",
    413: "the body is over `--max-body-bytes`",
    429: "every runner is at capacity (`rate_limit_error`): retry later",
    500: "the runner failed while generating",
    502: "the router's stream ended without a final message",
    503: "no runner is ready, or the one serving the request went away",
    504: "the router did not answer in time",
}
#: The statuses of a ``/v1`` route (the guard's, the router's).
V1_STATUSES = (400, 401, 404, 413, 429, 500, 502, 503, 504)
#: The statuses of ``GET /health`` (open: no 401; every router failure is a 503).
HEALTH_STATUSES = (400, 413, 503)

_STRING = {"schema": {"type": "string"}}


def error_responses(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for these statuses, each with the error body (a 401 may carry
    ``WWW-Authenticate``)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
        if status == 401:
            out[status]["headers"] = {"WWW-Authenticate": _STRING}
    return out


def ok_response(model: type, *, stream: bool = False, headers: dict[str, Any] | None = None) -> dict[int, dict]:
    """FastAPI ``responses=`` for a 200 of ``model``; ``stream``: or server-sent events of it."""
    out: dict[str, Any] = {"model": model, "description": "the answer" + (
        " (with `stream`: `text/event-stream`, one `data: {json}` per chunk, then `data: [DONE]`)" if stream else "")}
    if stream:
        out["content"] = {"text/event-stream": _STRING}
    if headers:
        out["headers"] = headers
    return {200: out}


def openapi_schema(app: FastAPI, *, api_key: bool) -> dict[str, Any]:
    """``app``'s schema (built once, then cached on ``app.openapi_schema``): FastAPI's, less its
    422 responses and validation-error models; with ``api_key``, a ``bearer`` HTTP scheme that
    every ``/v1`` operation requires."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            if api_key and path.startswith(PROTECTED_PREFIX):
                operation["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema
