"""Invalid Unicode is ``INVALID_ARGUMENT`` with a sentence, never ``INTERNAL``.

Two ways it arrives: a Python ``str`` holding a lone surrogate (JSON's ``"\\ud800"`` parses
into one; it cannot be encoded, so a protobuf message refuses it), checked by
:func:`utf8_size`; and a gRPC request whose string field is not UTF-8 on the wire, which
protobuf cannot parse and grpcio would answer ``INTERNAL "Exception deserializing request!"``:
:class:`UndecodableRequests`, a server interceptor every :class:`services.bootstrap.ServiceServer`
installs, answers it ``INVALID_ARGUMENT`` instead. Both are counted under ``unicode``
(:mod:`services.refusals`). See ``docs/architecture.md`` §1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from services.errors import InvalidArgument
from services.handlers import non_blocking
from services.refusals import Refusals


def utf8_size(text: str, what: str) -> int:
    """The size of ``text`` in UTF-8, in bytes. Raises ``InvalidArgument`` (reason ``unicode``)
    naming ``what`` and the position when ``text`` holds a lone surrogate (U+D800..U+DFFF)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
                              f"character {e.start}", reason="unicode") from None


class _Undecodable:
    """What the guarded deserializer returns for bytes protobuf could not parse."""

    __slots__ = ("message", "reason")

    def __init__(self, message: str, reason: str) -> None:
        self.message = message
        self.reason = reason


def _guard(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError; grpcio would answer INTERNAL
            if "UTF-8" in str(e):
                return _Undecodable("a string field of the request is not valid UTF-8 (for example a lone "
                                    "surrogate); send valid Unicode text", "unicode")
            return _Undecodable("the request is not a well-formed protobuf message of this method's type",
                                "malformed")

    return parse


class UndecodableRequests(grpc.ServerInterceptor):
    """Answers a request message protobuf cannot parse with ``INVALID_ARGUMENT`` and one
    sentence (a streamed request: the whole call), counted in ``refusals``."""

    def __init__(self, refusals: Refusals) -> None:
        self._refusals = refusals

    def _refuse(self, bad: _Undecodable, context: grpc.ServicerContext) -> None:
        self._refusals.count(InvalidArgument(bad.message, reason=bad.reason))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)

    def _unary(self, behaviour):
        def inner(request, context, *callback):  # a non-blocking behaviour's send_response_callback
            if isinstance(request, _Undecodable):
                self._refuse(request, context)
            return behaviour(request, context, *callback)

        if non_blocking(behaviour):
            inner.experimental_non_blocking = True  # type: ignore[attr-defined]
        return inner

    def _streaming(self, behaviour):
        def checked(requests, context) -> Iterator:
            for request in requests:
                if isinstance(request, _Undecodable):
                    self._refuse(request, context)
                yield request

        def inner(requests, context):
            return behaviour(checked(requests, context), context)

        return inner

    def intercept_service(self, continuation, handler_call_details):
        """gRPC interceptor protocol: the handler with a guarded request deserializer."""
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kw = dict(request_deserializer=_guard(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._unary(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._streaming(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(self._streaming(handler.stream_stream), **kw)
