"""One client channel per runner address, shared by the relay and the health checker."""

from __future__ import annotations

import threading

import grpc

from services.channel import ClientSecurity, open_channel


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
                ch = self._channels[address] = open_channel(address, security=self._security)
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
