"""Client channels: one place for dial options, TLS, the bearer token and readiness waits."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from services.auth import read_token
from services.errors import Unavailable
from services.tls import TLSFiles, add_tls_args, tls_from_args

#: The largest gRPC message, in bytes, clients send and receive (and servers by default).
MAX_MESSAGE_BYTES = 16 << 20
#: Channel options for a client that polls a server while it starts (benchmarks timing a launch):
#: reconnect 50-100 ms after a refused connection instead of after gRPC's default backoff (1 s,
#: growing to 120 s), which would add seconds between the server listening and the poll noticing.
PROBE_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                         ("grpc.max_reconnect_backoff_ms", 100))

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
)


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: its own bearer ``token`` (sent on every call) and its TLS files
    (``None``: plaintext)."""

    token: str | None = None
    tls: TLSFiles | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the token (empty without one)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


#: A client with no token and no TLS.
PLAINTEXT = ClientSecurity()


def add_client_security_args(parser, *, server: bool = False) -> None:
    """Add ``--token-file`` and the TLS flags (:func:`services.tls.add_tls_args`) to a parser."""
    parser.add_argument("--token-file", default=None, metavar="F",
                        help="file holding this process's own bearer token (else $WARMSERVE_TOKEN)")
    add_tls_args(parser, server=server)


def client_security_from_args(args, env: Mapping[str, str] | None = None) -> ClientSecurity:
    """:class:`ClientSecurity` from :func:`add_client_security_args` flags (the token from
    ``--token-file``, else ``$WARMSERVE_TOKEN``). Raises ``InvalidArgument`` for a bad file."""
    return ClientSecurity(token=read_token(getattr(args, "token_file", None), os.environ if env is None else env),
                          tls=tls_from_args(args))


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call's metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d):
        return d._replace(metadata=(*(d.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def open_channel(address: str, *, security: ClientSecurity | None = None, ready_timeout_s: float | None = None,
                 fail_fast: bool = False) -> grpc.Channel:
    """A channel to ``host:port``: TLS when ``security.tls`` is set, the token on every call when
    ``security.token`` is. With ``ready_timeout_s`` (seconds), wait until it connects or raise
    :class:`services.errors.Unavailable`. With ``fail_fast`` the first failed connection attempt
    (refused, unreachable) raises at once instead of being retried until the timeout (for a
    person at a command line; servers starting up want the retries)."""
    security = security or PLAINTEXT
    if security.tls is not None:
        channel = grpc.secure_channel(address, security.tls.channel_credentials(),
                                      options=(*CHANNEL_OPTIONS, *security.tls.channel_options()))
    else:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if security.token:
        channel = _SecuredChannel(channel, security.metadata())
    if ready_timeout_s is not None and fail_fast:
        _wait_connected(channel, address, ready_timeout_s)
    elif ready_timeout_s is not None:
        try:
            grpc.channel_ready_future(channel).result(timeout=ready_timeout_s)
        except grpc.FutureTimeoutError as e:
            channel.close()
            raise Unavailable(f"cannot reach {address} within {ready_timeout_s:g} s") from e
    return channel


def _wait_connected(channel: grpc.Channel, address: str, timeout_s: float) -> None:
    """Wait for ``channel`` to be READY; ``Unavailable`` (channel closed) at its first transient
    failure or after ``timeout_s`` seconds."""
    import threading

    settled = threading.Event()
    seen: list[grpc.ChannelConnectivity] = []

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     grpc.ChannelConnectivity.SHUTDOWN):
            seen.append(state)
            settled.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        ok = settled.wait(timeout_s)
    finally:
        channel.unsubscribe(watch)
    if ok and seen[0] is grpc.ChannelConnectivity.READY:
        return
    channel.close()
    if not ok:
        raise Unavailable(f"cannot reach {address} within {timeout_s:g} s")
    raise Unavailable(f"cannot reach {address}: the connection was refused or the host is unreachable "
                      "(is the server running?)")


class _SecuredChannel(grpc.Channel):
    """``grpc.intercept_channel`` with the token interceptor, keeping ``close()`` and the
    context-manager protocol of the channel underneath."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._inner = channel
        self._channel = grpc.intercept_channel(channel, _TokenInterceptor(metadata))

    def subscribe(self, callback, try_to_connect=False):
        self._inner.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._inner.unsubscribe(callback)

    def unary_unary(self, *a, **kw):
        return self._channel.unary_unary(*a, **kw)

    def unary_stream(self, *a, **kw):
        return self._channel.unary_stream(*a, **kw)

    def stream_unary(self, *a, **kw):
        return self._channel.stream_unary(*a, **kw)

    def stream_stream(self, *a, **kw):
        return self._channel.stream_stream(*a, **kw)

    def close(self):
        self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()
        return False
