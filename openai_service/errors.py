"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status vLLM's OpenAI server gives for the same failure.

:class:`OpenAIError` is raised anywhere in the door and answered by the app's handler.
:func:`from_rpc_error` maps the router's gRPC status (its runner's, passed through):

=======================  =====  ========================================================
gRPC status              HTTP   why
=======================  =====  ========================================================
INVALID_ARGUMENT         400    bad input, e.g. a prompt over the context length (vLLM: 400)
RESOURCE_EXHAUSTED       400    a request that can never fit the KV cache: retrying cannot
                                help, so not 429 (which clients retry); vLLM refuses what it
                                could never hold with a 400 validation error
NOT_FOUND                404
UNAUTHENTICATED          401
UNAVAILABLE              503    no runner is ready, or the runner died mid-stream
FAILED_PRECONDITION      503    the runner is shutting down: another try may land elsewhere
DEADLINE_EXCEEDED        504
anything else            500
=======================  =====  ========================================================

:func:`from_validation_error` makes a request body pydantic refused an HTTP 400 (vLLM's
handler does the same instead of FastAPI's 422).
"""

from __future__ import annotations

import grpc

from openai_service.protocol import ErrorInfo, ErrorResponse

#: vLLM's ``type`` for each HTTP status the door answers.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
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
    fault) and ``code`` (default: the status, as vLLM sends it)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
        self.param = param
        self.code = status if code is None else code

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


def from_rpc_error(err: grpc.RpcError) -> OpenAIError:
    """The :class:`OpenAIError` for a failed ``Generate``/``ModelInfo`` call (see the module
    table), keeping the server's sentence as the message."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or code.name
    status = GRPC_TO_HTTP.get(code, 500)
    return OpenAIError(status, details if status != 500 else f"{code.name}: {details}")


def from_validation_error(errors: list[dict]) -> OpenAIError:
    """An HTTP 400 for a body that failed validation (pydantic/FastAPI ``errors()``): one
    ``field: problem`` clause per error, ``param`` the first field's dotted path (``body``
    and union branch names left out)."""
    clauses, params = [], []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        # pydantic names union branches in the path ("str", "list[int]", "function-after[...]")
        field = ".".join(p for p in loc if not (p[:1].isalpha() and ("[" in p or p in ("str", "int", "float", "bool"))))
        if field:
            params.append(field)
        clauses.append(f"{field}: {e.get('msg', 'invalid')}" if field else str(e.get("msg", "invalid")))
    unique = list(dict.fromkeys(clauses))
    return bad_request("invalid request: " + "; ".join(unique), param=params[0] if params else None)
