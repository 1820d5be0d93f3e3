"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status vLLM's OpenAI server gives for the same failure.

:class:`OpenAIError` is raised anywhere in the door and answered by the app's handler.
:func:`from_rpc_error` maps the router's gRPC status (its runner's, passed through):

=======================  =====  ========================================================
gRPC status              HTTP   why
=======================  =====  ========================================================
INVALID_ARGUMENT         400    bad input, e.g. a prompt over the context length (vLLM: 400);
                                ``param`` names the field the runner's sentence is about
                                (:data:`RUNNER_PARAMS`)
RESOURCE_EXHAUSTED       400    a request that can never fit the KV cache: retrying cannot
                                help, so not 429 (which clients retry); vLLM refuses what it
                                could never hold with a 400 validation error
NOT_FOUND                404
UNAUTHENTICATED          401
UNAVAILABLE, overloaded  429    every runner is at capacity (trailing metadata
                                ``warmserve-overloaded: 1``, ``services.errors.Overloaded``):
                                ``rate_limit_error``, the one status clients retry later
UNAVAILABLE              503    no runner is ready, or the runner serving the request went
                                away or became unreachable, before or after the first token
                                (not vLLM's 500: the fault is not in the request nor in the
                                model, and another try may land on a healthy runner)
FAILED_PRECONDITION      503    the runner is shutting down: another try may land elsewhere
DEADLINE_EXCEEDED        504
anything else            500    e.g. INTERNAL; UNKNOWN (an exception in a server) keeps its
                                details to the server's log: the door never echoes
                                exception text
=======================  =====  ========================================================

A runner that fails while generating ends the stream with finish reason ABORTED, which
:func:`openai_service.convert.finish_reason` answers with a 500, as vLLM answers its
``GenerationError``. A streamed request that fails after its first chunk carries the same
status in the ``code`` of its in-band ``data: {"error": ...}`` event.

:func:`from_validation_error` makes a request body pydantic refused an HTTP 400 (vLLM's
handler does the same instead of FastAPI's 422), with one sentence for a body that is not a
JSON object at all (invalid JSON, another ``Content-Type``, no body).
"""

from __future__ import annotations

import grpc

from openai_service.protocol import ErrorInfo, ErrorResponse
from services.errors import is_overloaded

#: vLLM's ``type`` for each HTTP status the door answers.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "rate_limit_error",  # OpenAI's type: the contract's name for "busy, retry later"
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

#: HTTP status of each gRPC status that is not a 500.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: ``status`` (HTTP), ``message`` (one sentence),
    ``type`` (default: :data:`ERROR_TYPES` of the status), ``param`` (the request field at
    fault), ``code`` (default: the status, as vLLM sends it), ``headers`` (HTTP headers the
    answer carries, e.g. ``Allow`` for a 405) and ``reason`` (set on a limit's refusal: the
    door counts it in ``warmserve_refused_total{reason}``, :mod:`services.refusals`)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: int | str | None = None, headers: dict[str, str] | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
        self.param = param
        self.code = status if code is None else code
        self.headers = headers
        self.reason = reason

    def response(self) -> ErrorResponse:
        """The body model."""
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> dict:
        """The JSON body, ``{"error": {"message", "type", "param", "code"}}``."""
        return self.response().model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """An HTTP 400 ``BadRequestError`` about ``param``."""
    return OpenAIError(400, message, param=param)


def model_not_found(name: str) -> OpenAIError:
    """The 404 for a request naming a model this door does not serve (vLLM's sentence, OpenAI's
    ``model_not_found`` code)."""
    return OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


#: Openings of the runner's INVALID_ARGUMENT sentences, and the request field each is about
#: (a key of ``from_rpc_error``'s ``fields``: ``prompt`` is ``messages`` for a chat request).
RUNNER_PARAMS = (
    ("max_tokens ", "max_tokens"),            # "max_tokens 40 is more than the context leaves: ..."
    ("stop token id ", "stop_token_ids"),     # "stop token id 99 is outside the vocabulary ..."
    ("logit_bias ", "logit_bias"),            # "logit_bias token id 99 is outside the vocabulary ..."
    ("min_tokens ", "min_tokens"),            # "min_tokens 9 is more than max_tokens 8"
    ("token id ", "prompt"),                  # "token id 99 is outside the vocabulary ..."
    ("the prompt ", "prompt"),                # "the prompt has 2000 tokens but the context holds ..."
    ("the chat ", "prompt"),                  # "the chat template rejected the messages: ..."
    ("message ", "prompt"),                   # "message 0 has unknown role ..."
    ("the structured output", "structured"),  # "the structured output's regex is not valid ..."
)


def from_rpc_error(err: grpc.RpcError, fields: dict[str, str] | None = None) -> OpenAIError:
    """The :class:`OpenAIError` for a failed ``Generate``/``ModelInfo`` call (see the module
    table), keeping the server's sentence as the message (not for UNKNOWN, whose details are an
    exception's text). ``fields`` maps :data:`RUNNER_PARAMS`' names to this request's field
    names (``{"prompt": "messages"}``); given, an INVALID_ARGUMENT whose sentence is about a
    field sets ``param`` to it."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    if is_overloaded(err):
        return OpenAIError(429, (err.details() if hasattr(err, "details") else None)
                           or "every runner is at capacity: retry later", reason="overloaded")
    if code == grpc.StatusCode.UNKNOWN:
        return OpenAIError(500, "the router failed with an unexpected error (UNKNOWN; see its and the runner's logs)")
    details = (err.details() if hasattr(err, "details") else None) or code.name
    status = GRPC_TO_HTTP.get(code, 500)
    param = None
    if fields is not None and code == grpc.StatusCode.INVALID_ARGUMENT:
        about = next((name for opening, name in RUNNER_PARAMS if details.startswith(opening)), None)
        param = fields.get(about, about) if about is not None else None
    return OpenAIError(status, details if status != 500 else f"{code.name}: {details}", param=param)


#: What a JSON value that is not an object is, by its Python type once parsed.
_JSON_VALUES = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean", int: "a JSON number",
                float: "a JSON number", type(None): "JSON null"}


def _body_error(e: dict, content_type: str | None) -> OpenAIError | None:
    """The sentence for an error about the body as a whole (not JSON, not an object, absent,
    a string that is not valid Unicode), ``None`` for an error about a field."""
    loc = tuple(e.get("loc", ()))
    kind = e.get("type")
    if kind == "invalid_unicode":  # openai_service.protocol: a lone surrogate somewhere in the body
        err = bad_request(str(e.get("msg")), param=e.get("ctx", {}).get("param"))
        err.reason = "unicode"
        return err
    if kind == "json_invalid":  # FastAPI's; loc ("body", character offset)
        pos = f"at character {loc[1]}: " if len(loc) > 1 and isinstance(loc[1], int) else ""
        return bad_request(f"the body is not valid JSON ({pos}{e.get('ctx', {}).get('error', 'JSON decode error')})")
    if loc != ("body",):
        return None
    if kind == "missing":
        return bad_request("the request has no body: send a JSON object (Content-Type: application/json)")
    value = e.get("input")
    if isinstance(value, bytes | bytearray):  # FastAPI leaves a body that is not declared JSON unparsed
        got = f"Content-Type: {content_type}" if content_type else "no Content-Type"
        return bad_request(f"the body must be a JSON object (Content-Type: application/json); the request has {got}")
    return bad_request(f"the body must be a JSON object, not {_JSON_VALUES.get(type(value), 'another JSON value')}")


def from_validation_error(errors: list[dict], content_type: str | None = None) -> OpenAIError:
    """An HTTP 400 for a body that failed validation (pydantic/FastAPI ``errors()``): a body
    that is not a JSON object (invalid JSON, a ``Content-Type`` other than JSON, which FastAPI
    leaves unparsed, another JSON value, no body) gets one sentence with ``param`` null; else one
    ``field: problem`` clause per error, ``param`` the first field's dotted path (``body`` and
    union branch names left out). ``content_type``: the request's header, for the sentence."""
    for e in errors:
        whole = _body_error(e, content_type)
        if whole is not None:
            return whole
    clauses, params = [], []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        # pydantic names union branches in the path ("str", "list[int]", "function-after[...]")
        field = ".".join(p for p in loc if not (p[:1].isalpha() and ("[" in p or p in ("str", "int", "float", "bool")))
                         and p != "[key]")  # pydantic's mark of a dict key's error
        if field:
            params.append(field)
        clauses.append(f"{field}: {e.get('msg', 'invalid')}" if field else str(e.get("msg", "invalid")))
    unique = list(dict.fromkeys(clauses))
    return bad_request("invalid request: " + "; ".join(unique), param=params[0] if params else None)
