"""A server interceptor that answers a request which does not parse -- a corrupt wire format, or
invalid UTF-8 in a string field -- with ``INVALID_ARGUMENT`` and a sentence, where grpcio itself
answers ``INTERNAL`` ("Exception deserializing request!") and logs a traceback at ERROR.

:class:`DecodeGuard` swaps each method's request deserializer for one that returns a marker
instead of failing; the method's behaviour aborts on a marker before the servicer sees it (a
unary request), or when the servicer reaches it in its request iterator (a client stream: the
messages before it were served; the abort propagates through the servicer, so its clean-up runs).
Every :class:`services.bootstrap.ServiceServer` installs it (``docs/architecture.md`` §3).
"""

from __future__ import annotations

import grpc


class _Undecodable:
    """What the guarded deserializer returns for bytes that do not parse: the refusal's sentence."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(deserialize, method: str):
    def inner(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError, or a custom deserializer's own error
            return _Undecodable(f"the request to {method} is not a valid message ({e})")

    return inner


def _abort_if_undecodable(request, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


def _checked(request_iterator, context: grpc.ServicerContext):
    for request in request_iterator:
        _abort_if_undecodable(request, context)
        yield request


class DecodeGuard(grpc.ServerInterceptor):
    """Undecodable requests become ``INVALID_ARGUMENT`` (see the module docstring)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kw = dict(request_deserializer=_deserializer(handler.request_deserializer, handler_call_details.method),
                  response_serializer=handler.response_serializer)
        if handler.unary_unary or handler.unary_stream:
            behavior = handler.unary_unary or handler.unary_stream

            def unary(request, context):
                _abort_if_undecodable(request, context)
                return behavior(request, context)

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
            return make(unary, **kw)
        behavior = handler.stream_unary or handler.stream_stream

        def streaming(request_iterator, context):
            return behavior(_checked(request_iterator, context), context)

        make = grpc.stream_unary_rpc_method_handler if handler.stream_unary else grpc.stream_stream_rpc_method_handler
        return make(streaming, **kw)
