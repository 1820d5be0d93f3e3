"""An HTTP probe of an OpenAI door's ``GET /health``:
``python -m openai_service.healthcheck HOST:PORT [--timeout S] [--tls-ca F [--tls-cert F --tls-key F]]``.

Exits 0 when the door answers 200 (the router has a READY runner), 1 otherwise, printing one
line. Used by ``compose.yaml``'s healthcheck of the ``openai`` service and by
:mod:`warmserve.stack` (which also checks the ``warmserve-pid`` header, as it does for its gRPC
children, so another program on the port is never taken for its own child). With ``--tls-ca``
it speaks HTTPS, verifying the door against that CA (and presenting a client certificate to a
door that requires one).
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import sys

from services.address import parse_address
from services.errors import InvalidArgument
from services.healthcheck import FOREIGN, PID_METADATA_KEY


def client_tls(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """An HTTPS client context that trusts the PEM CA ``ca`` (hostnames checked) and, given
    ``cert``/``key``, presents that client certificate. Raises ``OSError``/``ssl.SSLError`` for
    unreadable files."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def check_http_health(address: str, *, timeout_s: float = 2.0, pid: int | None = None,
                      tls: ssl.SSLContext | None = None) -> str:
    """``SERVING`` (HTTP 200), ``NOT_SERVING`` (503: the door is up, no runner is READY),
    ``HTTP <status>`` (anything else), or ``UNREACHABLE: <reason>`` when no answer came within
    ``timeout_s`` seconds. With ``pid``, an answer whose ``warmserve-pid`` header is not that pid
    is ``FOREIGN: pid N``. ``tls``: speak HTTPS with this context (:func:`client_tls`). Raises
    ``InvalidArgument`` for an address that is not ``host:port``."""
    host, port = parse_address(address)
    conn = (http.client.HTTPSConnection(host, port, timeout=timeout_s, context=tls) if tls is not None
            else http.client.HTTPConnection(host, port, timeout=timeout_s))
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
    except (OSError, http.client.HTTPException) as e:
        return f"UNREACHABLE: {e.__class__.__name__}: {e}"
    finally:
        conn.close()
    if pid is not None:
        theirs = resp.getheader(PID_METADATA_KEY)
        if theirs != str(pid):
            return f"{FOREIGN}: pid {theirs or 'unknown'}"
    return {200: "SERVING", 503: "NOT_SERVING"}.get(resp.status, f"HTTP {resp.status}")


def main(argv: list[str] | None = None) -> int:
    """The probe's command line; returns the exit code (0 when SERVING)."""
    parser = argparse.ArgumentParser(prog="python -m openai_service.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the OpenAI door")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--tls-ca", default=None, metavar="F", help="speak HTTPS, trusting this PEM CA")
    parser.add_argument("--tls-cert", default=None, metavar="F", help="client certificate (for an mTLS door)")
    parser.add_argument("--tls-key", default=None, metavar="F", help="the client certificate's key")
    args = parser.parse_args(argv)
    try:
        tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
        status = check_http_health(args.address, timeout_s=args.timeout, tls=tls)
    except (InvalidArgument, OSError) as e:
        parser.error(str(e))
    print(f"{'https' if tls else 'http'}://{args.address}/health: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
