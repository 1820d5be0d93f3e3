"""``host:port`` addresses: the one parser and its inverse.

A host is a name, an IPv4 address, or an IPv6 address in brackets (``[::1]:50051``); the port is
1-65535. :func:`parse_address` returns the host without brackets; :func:`format_address` puts
them back.
"""

from __future__ import annotations

from services.errors import InvalidArgument


def parse_address(text: str, *, what: str = "address", allow_empty_host: bool = False) -> tuple[str, int]:
    """Split ``text`` into ``(host, port)``: ``"127.0.0.1:50051"`` -> ``("127.0.0.1", 50051)``,
    ``"[::1]:50051"`` -> ``("::1", 50051)``; with ``allow_empty_host``, ``":50051"`` ->
    ``("", 50051)``. Raises ``InvalidArgument`` naming ``what`` (e.g. ``"runner address"``)
    when ``text`` is not such an address."""
    host, sep, port = text.rpartition(":")
    problem = ""
    if not sep:
        problem = "there is no port"
    elif not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        problem = f"the port {port!r} is not a number in 1-65535"
    elif host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")) or len(host) < 3:
            problem = f"the bracketed host {host!r} is malformed"
        host = host[1:-1]
    elif ":" in host:
        problem = f"an IPv6 host goes in brackets, e.g. [{host}]:{port}"
    elif not host and not allow_empty_host:
        problem = "the host is empty"
    if problem:
        raise InvalidArgument(f"{what} must be host:port (e.g. 127.0.0.1:50051 or [::1]:50051), "
                              f"got {text!r}: {problem}")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 ``host`` in brackets: the inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
