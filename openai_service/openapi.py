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
from pydantic import BaseModel

from openai_service.guard import OPEN_PATHS
from openai_service.protocol import ChatCompletionChunk, Completion, ErrorResponse

#: Each error status the door answers, and when.
ERROR_STATUSES = {
    400: "the request is invalid (body, field, Host or Content-Length), or can never fit the model",
    401: "no valid API key (`Authorization: Bearer <key>`), or the router refused the door's credential",
    404: "unknown route or model",
    413: "the body is over `--max-body-bytes`, or the open `/health` and `/metrics` were sent one",
    429: "every runner is at capacity (`rate_limit_error`): retry later",
    500: "the runner failed while generating",
    502: "the router's stream ended without a final message",
    503: "no runner is ready, or the one serving the request went away",
    504: "the router did not answer in time",
}
#: The statuses of a ``/v1`` route (the guard's, the router's).
V1_STATUSES = (400, 401, 404, 413, 429, 500, 502, 503, 504)
#: The statuses of ``GET /health`` (open: no 401; a body is a 413; every router failure is a 503).
HEALTH_STATUSES = (400, 413, 503)

_STRING = {"schema": {"type": "string"}}
#: Schema keywords FastAPI's OpenAPI model stores as floats: ``2**64`` as ``1.8446744073709552e19``
#: would let a validator take ``2**64 + 382`` for an integer below it.
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_bounds(node: Any) -> None:
    """Turn the float bounds of integer schemas back into the integers pydantic wrote (in place)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            integer = item.get("type") == "integer"
            for key, value in item.items():
                if integer and key in _BOUNDS and isinstance(value, float) and value.is_integer():
                    item[key] = int(value)
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def error_responses(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for these statuses, each with the error body (a 401 may carry
    ``WWW-Authenticate``)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
        if status == 401:
            out[status]["headers"] = {"WWW-Authenticate": _STRING}
    return out


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream of ``chunk`` (OpenAPI before 3.2: ``schema`` describes
    each event): its ``data`` is a chunk, an in-band error, or ``[DONE]``."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}}}


def ok_response(model: type[BaseModel], *, chunk: type[BaseModel] | None = None,
                headers: dict[str, Any] | None = None) -> dict[int, dict]:
    """FastAPI ``responses=`` for a 200 of ``model``; with ``chunk``, a ``stream`` request's
    answer is ``text/event-stream``, one ``data: {chunk}`` per chunk, then ``data: [DONE]``
    (``chunk`` must be one of :data:`EVENT_MODELS`)."""
    out: dict[str, Any] = {"model": model, "description": "the answer"}
    if chunk is not None:
        out["description"] += " (with `stream`: server-sent chunks, then `data: [DONE]`)"
        out["content"] = {"text/event-stream": {"schema": _event(chunk)}}
    if headers:
        out["headers"] = headers
    return {200: out}


#: The models that streamed answers' events refer to, added to the components by
#: :func:`openapi_schema` (FastAPI adds only the routes' own models).
EVENT_MODELS: tuple[type[BaseModel], ...] = (Completion, ChatCompletionChunk, ErrorResponse)


def _add_components(schemas: dict[str, Any]) -> None:
    for model in EVENT_MODELS:
        if model.__name__ in schemas:
            continue
        js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for name, definition in js.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas[model.__name__] = js


def openapi_schema(app: FastAPI, *, api_key: bool) -> dict[str, Any]:
    """``app``'s schema (built once, then cached on ``app.openapi_schema``): FastAPI's, less its
    422 responses and validation-error models, integer bounds exact; with ``api_key``, a ``bearer`` HTTP scheme that
    every operation but those of :data:`~openai_service.guard.OPEN_PATHS` requires."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            if api_key and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    _add_components(components.setdefault("schemas", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    _exact_bounds(schema)
    app.openapi_schema = schema
    return schema
