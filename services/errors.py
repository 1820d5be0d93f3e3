"""Errors shared by every core object, each tied to the gRPC status code a servicer returns.

Core objects (stores, engines, packers) raise these; servicers translate them with
:func:`abort_with` and the CLI maps them to exit codes with :attr:`WarmserveError.exit_code`
(2 for bad input, 1 for a failed operation). The message is one human sentence. An error that
is a limit's refusal carries the ``reason`` it is counted under (:mod:`services.refusals`).
"""

from __future__ import annotations

import sys

import grpc


class WarmserveError(Exception):
    """Base class. ``code`` is the gRPC status, ``exit_code`` the CLI exit status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    exit_code: int = 1
    #: The ``reason`` label of ``warmserve_refused_total`` when this error refuses a request at a
    #: limit (``prompt_bytes``, ``overloaded``, ...; :mod:`services.refusals`); ``""`` otherwise.
    reason: str = ""
    #: Trailing metadata :func:`abort_with` sends with the status.
    trailing_metadata: tuple[tuple[str, str], ...] = ()

    def __init__(self, message: str = "", *, reason: str = "") -> None:
        super().__init__(message)
        if reason:
            self.reason = reason


class InvalidArgument(WarmserveError, ValueError):
    """Bad input from the caller (gRPC ``INVALID_ARGUMENT``, CLI exit 2)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    exit_code = 2


class NotFound(WarmserveError, LookupError):
    """The named thing does not exist (gRPC ``NOT_FOUND``)."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(WarmserveError):
    """Over a budget that retrying will not fix now (gRPC ``RESOURCE_EXHAUSTED``)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(WarmserveError):
    """A dependency or peer is not ready (gRPC ``UNAVAILABLE``)."""

    code = grpc.StatusCode.UNAVAILABLE


#: The trailing metadata that marks an ``UNAVAILABLE`` as :class:`Overloaded`.
OVERLOADED_METADATA = ("warmserve-overloaded", "1")


class Overloaded(Unavailable):
    """A server at capacity (all its stream slots held, or a stream's in-flight requests at their
    cap): busy now, not broken. gRPC ``UNAVAILABLE`` with trailing metadata
    ``warmserve-overloaded: 1`` (:data:`OVERLOADED_METADATA`). The router tries another runner
    and never ejects or counts a failure for it; the OpenAI door answers HTTP 429. Distinct from
    :class:`ResourceExhausted`, which means the request can never fit (HTTP 400)."""

    reason = "overloaded"
    trailing_metadata = (OVERLOADED_METADATA,)


class FailedPrecondition(WarmserveError):
    """The system is not in a state that allows the operation (gRPC ``FAILED_PRECONDITION``)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(WarmserveError):
    """A required bearer token is missing or wrong (gRPC ``UNAUTHENTICATED``)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(WarmserveError):
    """The caller is known but its credential lacks the scope, or the thing belongs to another
    caller (gRPC ``PERMISSION_DENIED``)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Untrusted(PermissionDenied):
    """An artifact's signature is missing, malformed, by an untrusted key or does not match its
    bytes (gRPC ``PERMISSION_DENIED``); the artifact must not be loaded."""


class DeadlineExceeded(WarmserveError):
    """The request's deadline passed (gRPC ``DEADLINE_EXCEEDED``)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(WarmserveError):
    """The client cancelled the request (gRPC ``CANCELLED``)."""

    code = grpc.StatusCode.CANCELLED


class Internal(WarmserveError):
    """A server failed doing the request, e.g. a generation failed inside the runner (gRPC ``INTERNAL``)."""

    code = grpc.StatusCode.INTERNAL


def abort_with(context: grpc.ServicerContext, err: WarmserveError) -> None:
    """Abort the RPC with ``err``'s status code, message and trailing metadata. Never returns (raises)."""
    if err.trailing_metadata:
        context.set_trailing_metadata(err.trailing_metadata)
    context.abort(err.code, str(err))


def is_overloaded(err: grpc.RpcError) -> bool:
    """Whether a client-side ``grpc.RpcError`` is an :class:`Overloaded` refusal (``UNAVAILABLE``
    carrying :data:`OVERLOADED_METADATA`): the server is busy, try another or later (HTTP 429)."""
    if not hasattr(err, "code") or err.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return any(tuple(kv) == OVERLOADED_METADATA for kv in trailing or ())


def from_rpc_error(err: grpc.RpcError) -> WarmserveError:
    """Turn a client-side ``grpc.RpcError`` back into the matching :class:`WarmserveError`
    (:class:`Overloaded` for an ``UNAVAILABLE`` marked so)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    if is_overloaded(err):
        return Overloaded(detail)
    for cls in (InvalidArgument, NotFound, ResourceExhausted, Unavailable, FailedPrecondition, Unauthenticated,
                PermissionDenied):
        if cls.code == code:
            return cls(detail)
    e = WarmserveError(f"{code.name}: {detail}")
    return e


def run_command(args) -> int:
    """Run a parsed ``warmserve`` command (``args.func(args)``) and map its outcome to the exit
    code: its own (``None``: 0); a :class:`WarmserveError`'s :attr:`~WarmserveError.exit_code`
    and an ``OSError`` (a busy port, an unwritable directory: 1) as one ``warmserve: error:``
    line on stderr, not a traceback; 130 on Ctrl-C."""
    try:
        return int(args.func(args) or 0)
    except WarmserveError as e:
        print(f"warmserve: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"warmserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
