"""A gRPC health probe: ``python -m services.healthcheck HOST:PORT [--service NAME] [--timeout S]
[--tls-ca F [--tls-cert F --tls-key F] [--tls-server-name N]]`` (TLS: against a server's main
port; a ``--health-port`` is plaintext).

Exits 0 when ``grpc.health.v1.Health/Check`` answers SERVING, 1 otherwise (NOT_SERVING, an
error, or no answer within the timeout), printing one line. Used by ``compose.yaml``
healthchecks (``grpc_health_probe`` is not installable here) and by :mod:`warmserve.stack`.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.channel import ClientSecurity, open_channel
from services.tls import add_tls_args, tls_from_args

#: Initial-metadata key of every health ``Check`` answer of a warmserve server
#: (``services.bootstrap``): the serving process's pid, so a launcher can tell its own child from
#: another server that answers on the same port.
PID_METADATA_KEY = "warmserve-pid"
#: The status :func:`check_health` gives when the answer came from a process other than ``pid``.
FOREIGN = "FOREIGN"


def check_health(address: str, *, service: str = "", timeout_s: float = 2.0, pid: int | None = None,
                 security: ClientSecurity | None = None) -> str:
    """The serving status name of ``service`` at ``address`` (``SERVING``, ``NOT_SERVING``, ...),
    or ``UNREACHABLE: <code>`` when the RPC fails within ``timeout_s`` seconds. With ``pid``, an
    answer from any other process (by the pid a warmserve server sends with it, see
    :data:`PID_METADATA_KEY`; none counts as another) is ``FOREIGN: pid N``: a
    launcher's own child is not up just because something else answers on its port. ``security``:
    the TLS files (and token) to dial with."""
    channel = open_channel(address, security=security)
    try:
        resp, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=True)
        if pid is not None:
            theirs = dict(call.initial_metadata() or ()).get(PID_METADATA_KEY)
            if theirs != str(pid):
                return f"{FOREIGN}: pid {theirs or 'unknown'}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as e:
        return f"UNREACHABLE: {e.code().name}"
    finally:
        channel.close()


def main(argv: list[str] | None = None) -> int:
    """The probe's command line; returns the exit code (0 when SERVING)."""
    parser = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port")
    parser.add_argument("--service", default="", help="service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    add_tls_args(parser, server=False)
    args = parser.parse_args(argv)
    tls = tls_from_args(args)
    status = check_health(args.address, service=args.service, timeout_s=args.timeout,
                          security=ClientSecurity(tls=tls) if tls is not None else None)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
