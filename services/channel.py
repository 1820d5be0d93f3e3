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


def open_channel(address: str, *, ready_timeout_s: float | None = None, fail_fast: bool = False) -> grpc.Channel:
    """An insecure channel to ``host:port``; with ``ready_timeout_s`` (seconds), wait until it
    connects or raise :class:`services.errors.Unavailable`. With ``fail_fast`` the first failed
    connection attempt (refused, unreachable) raises at once instead of being retried until the
    timeout (for a person at a command line; servers starting up want the retries)."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
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
