"""Rebuilding a ``grpc.RpcMethodHandler`` around a wrapped behaviour: what server interceptors
(auth, metrics) share."""

from __future__ import annotations

from collections.abc import Callable

import grpc


def non_blocking(behaviour: Callable | None) -> bool:
    """Whether ``behaviour`` is grpcio's callback style (``experimental_non_blocking``: it takes
    a ``send_response_callback`` and returns at once, e.g. ``grpc_health``'s ``Watch``): such a
    stream holds no pool thread, and a plain wrapper around it would make it hold one for its
    whole life (the blocking fallback)."""
    return bool(getattr(behaviour, "experimental_non_blocking", False))


def behaviour_of(handler: grpc.RpcMethodHandler) -> Callable:
    """The one behaviour ``handler`` carries (whichever of its four arities is set)."""
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def wrap_behaviour(handler: grpc.RpcMethodHandler, bind: Callable[[Callable, bool], Callable]) -> grpc.RpcMethodHandler:
    """A handler like ``handler`` whose behaviour is ``bind(behaviour, response_streaming)``;
    ``handler`` itself when its behaviour is :func:`non_blocking` (it is left unwrapped so it
    keeps holding no thread)."""
    if non_blocking(behaviour_of(handler)):
        return handler
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(bind(handler.unary_unary, False), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(bind(handler.unary_stream, True), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(bind(handler.stream_unary, False), **kw)
    return grpc.stream_stream_rpc_method_handler(bind(handler.stream_stream, True), **kw)


def deny_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that aborts every call with ``code`` and ``message``
    without parsing the request (it arrives as raw bytes)."""

    def deny(request, context):
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)
