"""One client channel per runner address, shared by the relay and the health checker.

The channels read a ``Generate`` stream on the relaying thread itself
(``grpc.experimental.ChannelOptions.SingleThreadedUnaryStream``): each message is taken from the
call's own completion queue by the thread that relays it, instead of being handed over by the
channel's polling thread, a thread wake-up less per relayed token. Such a call's ``code()`` and
``details()`` are read only once it has ended (the relay reads them from the error it raised).
"""

from __future__ import annotations

import threading

import grpc
import grpc.experimental

from services.channel import ClientSecurity, open_channel

#: Channel arguments of the runner channels (see the module docstring).
RELAY_CHANNEL_OPTIONS = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)


class ChannelPool:
    """Lazily opened ``grpc.Channel`` per ``host:port``; :meth:`close` / :meth:`close_all` end
    them (closing a channel cancels the calls still running on it). Every channel presents
    ``security`` (the router's token and TLS files)."""

    def __init__(self, security: ClientSecurity | None = None) -> None:
        self._security = security
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._closed = False

    def get(self, address: str) -> grpc.Channel:
        """The channel for ``address`` (opened on first use; does not wait for a connection)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("channel pool is closed")
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = open_channel(address, security=self._security,
                                                            options=RELAY_CHANNEL_OPTIONS)
            return ch

    def close(self, address: str) -> None:
        """Close the channel for ``address`` if one is open."""
        with self._lock:
            ch = self._channels.pop(address, None)
        if ch is not None:
            ch.close()

    def close_all(self) -> None:
        """Close every channel; later :meth:`get` calls raise."""
        with self._lock:
            channels, self._channels, self._closed = list(self._channels.values()), {}, True
        for ch in channels:
            ch.close()
