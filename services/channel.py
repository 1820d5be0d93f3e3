"""Client channels: one place for dial options, readiness waits and auth metadata."""

from __future__ import annotations

import grpc

from services.errors import Unavailable

#: The largest gRPC message, in bytes, clients send and receive (and servers by default).
MAX_MESSAGE_BYTES = 16 << 20

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
)


def open_channel(address: str, *, ready_timeout_s: float | None = None) -> grpc.Channel:
    """An insecure channel to ``host:port``; with ``ready_timeout_s`` (seconds), wait until it
    connects or raise :class:`services.errors.Unavailable`."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if ready_timeout_s is not None:
        try:
            grpc.channel_ready_future(channel).result(timeout=ready_timeout_s)
        except grpc.FutureTimeoutError as e:
            channel.close()
            raise Unavailable(f"cannot reach {address} within {ready_timeout_s:g} s") from e
    return channel
