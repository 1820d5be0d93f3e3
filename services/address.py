"""``host:port`` addresses: the one parser and its inverse.

A host is a name, an IPv4 address, or an IPv6 address in brackets (``[::1]:50051``); the port is
1-65535. :func:`parse_address` returns the host without brackets; :func:`format_address` puts
them back.
"""

from __future__ import annotations

import errno
import socket

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


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (``"address already in use"``, or the
    OS's reason), or ``None`` when it could. A trial bind with ``SO_REUSEADDR``, as gRPC binds:
    a port left in TIME_WAIT by a stopped server counts as free, one with a listener does not.
    With port 0 (any free port) only the host is checked (``"cannot assign requested address"``
    for an address this machine does not have). Racy by nature (the port may be taken right
    after); callers use it to say a clear sentence before they start anything, not as a lock."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
    except socket.gaierror as e:
        return f"unknown host ({e.strerror})"
    except OSError as e:
        return os_reason(e)
    return None


def os_reason(error: OSError) -> str:
    """A failed bind's reason as words for a sentence: ``"address already in use"`` for
    EADDRINUSE, else the OS's message, lower-cased."""
    return "address already in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error)).lower()
