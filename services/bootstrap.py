"""The one server bootstrap every warmserve daemon uses.

:class:`ServiceServer` wraps a ``grpc.Server`` with what every service needs:

- bind address (default ``127.0.0.1``; port 0 picks a free port, see :attr:`ServiceServer.port`);
- ``grpc.health.v1.Health`` (overall ``""`` plus each registered service name); a ``Check``
  answer carries the server's pid as initial metadata (:data:`PID_METADATA_KEY`);
- server reflection, so ``grpcurl -plaintext 127.0.0.1:PORT list`` works;
- an optional scoped bearer-token check (:mod:`services.auth`, :mod:`services.scopes`);
- optional TLS or mTLS (:mod:`services.tls`), and a plaintext health-only port for probes
  (``--health-port``);
- per-method Prometheus metrics (``warmserve_rpc_total``, ``warmserve_rpc_seconds``) in a
  per-server registry, exported on ``--metrics-port`` when one is given, with the requests
  refused at a limit (``warmserve_refused_total``, :mod:`services.refusals`);
- a request whose bytes protobuf cannot parse (bad UTF-8 in a string field) is
  ``INVALID_ARGUMENT``, not grpcio's ``INTERNAL`` (:class:`services.utf8.UndecodableRequests`);
- graceful drain on SIGTERM/SIGINT: health goes ``NOT_SERVING``, new RPCs are refused, in-flight
  RPCs get ``drain_grace_s`` seconds to finish, then :meth:`ServiceServer.wait` returns.

Servicers stay thin: they validate, call a core object, and translate
:class:`services.errors.WarmserveError` with :func:`services.errors.abort_with`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from services.address import bind_problem, format_address, os_reason
from services.auth import ENV_AUTH_FILE, AuthInterceptor, AuthTable, load_auth_table
from services.channel import MAX_MESSAGE_BYTES, add_client_security_args
from services.errors import InvalidArgument
from services.handlers import wrap_behaviour
from services.healthcheck import PID_METADATA_KEY
from services.procs import serving_pid
from services.refusals import Refusals
from services.stream_slots import OPEN_STREAMS, OpenStreamLimit
from services.tls import TLSFiles, tls_from_args
from services.utf8 import UndecodableRequests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Settings shared by every daemon; validated at construction (raises ``InvalidArgument``).

    ``auth`` is the credential table every RPC is checked against (``None``: no check);
    ``tls`` the server's certificate (``None``: plaintext); ``health_port`` an extra plaintext
    port serving only ``grpc.health.v1`` (for probes that cannot present a client certificate).
    Sizes are bytes, times seconds.

    Threads (:mod:`services.stream_slots`): a server's streaming RPCs that take a slot hold at
    most ``max_streams`` threads at once; the pool has ``max_streams + control_threads`` threads,
    so short control calls (heartbeats, health checks, ``ModelInfo``) always find one; the open
    methods' streams (reflection, which needs no token) hold at most
    :data:`~services.stream_slots.OPEN_STREAMS` more, and a health ``Watch`` none. ``max_workers`` overrides the pool size outright (``None``: that sum).
    """

    service: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    auth: AuthTable | None = None
    tls: TLSFiles | None = None
    health_port: int | None = None
    max_workers: int | None = None
    max_streams: int = 256
    control_threads: int = 16
    drain_grace_s: float = 30.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    options: tuple[tuple[str, object], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"metrics port must be in [0, 65535], got {self.metrics_port}")
        if self.max_workers is not None and self.max_workers < 1:
            raise InvalidArgument(f"max_workers must be >= 1, got {self.max_workers}")
        if self.max_streams < 1 or self.control_threads < 1:
            raise InvalidArgument(f"--max-streams and the control threads must be >= 1, got {self.max_streams} "
                                  f"and {self.control_threads}")
        if self.drain_grace_s < 0:
            raise InvalidArgument(f"drain grace must be >= 0 seconds, got {self.drain_grace_s}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise InvalidArgument(f"health port must be in [0, 65535], got {self.health_port}")
        if self.tls is not None and not self.tls.cert:
            raise InvalidArgument("a TLS server needs --tls-cert and --tls-key")

    @property
    def pool_threads(self) -> int:
        """Threads of the server's pool: ``max_workers``, else ``max_streams + control_threads``
        plus the open methods' streams (:data:`services.stream_slots.OPEN_STREAMS`)."""
        if self.max_workers is not None:
            return self.max_workers
        return self.max_streams + self.control_threads + OPEN_STREAMS


class _MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC by method and final status code, and times it (seconds)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter("warmserve_rpc", "RPCs handled", ["method", "code"], registry=registry)
        self.seconds = Histogram(
            "warmserve_rpc_seconds", "RPC wall time in seconds", ["method"], registry=registry
        )

    def _observe(self, method: str, start: float, code: str) -> None:
        self.total.labels(method, code).inc()
        self.seconds.labels(method).observe(time.perf_counter() - start)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def code_of(context, exc: BaseException | None) -> str:
            code = context.code() if hasattr(context, "code") else None
            if code is None:
                code = grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
            return code.name if hasattr(code, "name") else str(code)

        def bind(fn, streaming: bool):
            if streaming:
                def inner_stream(request, context):
                    start, exc = time.perf_counter(), None
                    try:
                        yield from fn(request, context)
                    except BaseException as e:
                        exc = e
                        raise
                    finally:
                        self._observe(method, start, code_of(context, exc))
                return inner_stream

            def inner(request, context):
                start, exc = time.perf_counter(), None
                try:
                    return fn(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    self._observe(method, start, code_of(context, exc))
            return inner

        return wrap_behaviour(handler, bind)


#: ``add_XServicer_to_server``-style function, the servicer, and the service's full name.
Registration = tuple[Callable[[object, grpc.Server], None], object, str]


def ensure_bindable(config: ServerConfig) -> None:
    """Raise ``OSError("cannot bind HOST:PORT: address already in use")`` (or the OS's other
    reason) when ``config``'s address cannot be listened on now. :meth:`ServiceServer.start` asks
    the OS this way first because gRPC's own failed bind logs its reason only natively (an
    ``E... add_port`` line on stderr, ahead of any message of ours) and then raises without it; a
    daemon with a slow start-up (a runner loading its model) calls it before that work."""
    problem = bind_problem(config.host, config.port)
    if problem is not None:
        raise OSError(f"cannot bind {format_address(config.host, config.port)}: {problem}")


def _bind(server: grpc.Server, address: str, tls: TLSFiles | None) -> int:
    """Add a (TLS when ``tls``) port to ``server``; returns the bound port, raises ``OSError``."""
    try:
        port = (server.add_secure_port(address, tls.server_credentials()) if tls is not None
                else server.add_insecure_port(address))
    except RuntimeError:  # grpcio >= 1.5x raises on a failed bind instead of returning 0
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return port


class _HealthServicer(health.HealthServicer):
    """``grpc.health.v1.Health`` whose ``Check`` answers also carry :data:`PID_METADATA_KEY`."""

    def Check(self, request, context):  # noqa: N802 (the RPC's name)
        context.send_initial_metadata(((PID_METADATA_KEY, str(serving_pid())),))
        return super().Check(request, context)


class ServiceServer:
    """A started-on-demand gRPC server with health, reflection, auth, metrics and drain.

    Usage::

        srv = ServiceServer(cfg, [(pb2_grpc.add_KernelCacheServicer_to_server, servicer,
                                   "warmserve.v1.KernelCache")])
        srv.start()          # binds; srv.port is the bound port
        srv.serve_forever()  # until SIGTERM/SIGINT, then drains

    ``registry`` is this server's Prometheus registry; services add their own gauges to it.
    ``refusals`` counts the requests refused at a limit (the servicers' own, when they share
    theirs: pass it in; else a new one), and is registered on ``registry``.
    ``on_drain`` callbacks run when a drain starts (before in-flight RPCs are awaited).
    """

    def __init__(self, config: ServerConfig, registrations: Iterable[Registration],
                 refusals: Refusals | None = None) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.refusals = refusals or Refusals()
        self.registry.register(self.refusals)
        self.health = _HealthServicer(experimental_non_blocking=True)
        self._registrations = list(registrations)
        self._server: grpc.Server | None = None
        self._stopped = threading.Event()
        self._drain_lock = threading.Lock()
        self._draining = False
        self.on_drain: list[Callable[[], None]] = []
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self._health_server: grpc.Server | None = None
        self._metrics_httpd = None

    @property
    def address(self) -> str:
        """``host:port`` clients should dial (valid after :meth:`start`)."""
        return format_address(self.config.host, self.port)

    @property
    def service_names(self) -> list[str]:
        """Full names of the registered services (health and reflection list them)."""
        return [name for _, _, name in self._registrations]

    def start(self) -> int:
        """Bind and start serving; returns the bound port. Raises ``OSError`` if the bind fails."""
        cfg = self.config
        interceptors: list[grpc.ServerInterceptor] = [OpenStreamLimit(cfg.service, refusals=self.refusals),
                                                      _MetricsInterceptor(self.registry),
                                                      UndecodableRequests(self.refusals)]
        if cfg.auth is not None:
            refused = Counter("warmserve_auth_refused", "RPCs refused by the token check", ["reason"],
                              registry=self.registry)
            interceptors.insert(0, AuthInterceptor(cfg.auth, lambda reason: refused.labels(reason).inc()))
        options = [
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *cfg.options,
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.pool_threads, thread_name_prefix=cfg.service),
            interceptors=interceptors,
            options=options,
        )
        for add, servicer, _name in self._registrations:
            add(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
        address = format_address(cfg.host, cfg.port)
        ensure_bindable(cfg)
        port = _bind(server, address, cfg.tls)
        server.start()
        self._server, self.port = server, port
        if cfg.health_port is not None:
            self._start_health_server(cfg)
        if cfg.metrics_port is not None:
            try:
                self._metrics_httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.host, registry=self.registry)
            except OSError as e:
                server.stop(None)
                self._server = None
                raise OSError(f"cannot serve metrics on {format_address(cfg.host, cfg.metrics_port)}: "
                              f"{os_reason(e)}") from e
            self.metrics_port = self._metrics_httpd.server_port
        self.set_serving(True)
        log.info("serving", extra={"address": self.address, "services": self.service_names,
                                   "metrics_port": self.metrics_port, "health_port": self.health_port,
                                   "auth": "on" if cfg.auth is not None else "off",
                                   "tls": "off" if cfg.tls is None else ("mtls" if cfg.tls.mutual else "tls")})
        return port

    def _start_health_server(self, cfg: ServerConfig) -> None:
        """Serve ``grpc.health.v1`` alone, plaintext, on ``cfg.health_port`` (the same statuses)."""
        hs = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{cfg.service}-health"),
                         options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
        address = format_address(cfg.host, cfg.health_port)
        try:
            self.health_port = _bind(hs, address, None)
        except OSError:
            self._server.stop(None)
            self._server = None
            raise
        hs.start()
        self._health_server = hs

    def set_serving(self, serving: bool) -> None:
        """Set health of the overall server and of every registered service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def drain(self, grace_s: float | None = None) -> None:
        """Go NOT_SERVING, refuse new RPCs, let in-flight ones finish (``grace_s`` seconds at most).

        Safe to call more than once and from a signal handler's thread; returns after the stop.
        """
        with self._drain_lock:
            if self._draining:
                self._stopped.wait()
                return
            self._draining = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        log.info("draining", extra={"grace_s": grace})
        self.set_serving(False)
        for cb in self.on_drain:
            try:
                cb()
            except Exception:
                log.exception("drain callback failed")
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._health_server is not None:
            self._health_server.stop(None)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        log.info("stopped")
        self._stopped.set()

    def stop(self) -> None:
        """Stop at once (no grace): for tests and fatal errors."""
        self.drain(0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped; ``False`` on timeout."""
        return self._stopped.wait(timeout)

    def install_signal_handlers(self) -> None:
        """Drain on SIGTERM and SIGINT (main thread only)."""

        def handler(signum, _frame):
            log.info("signal", extra={"signal": signal.Signals(signum).name})
            threading.Thread(target=self.drain, name="drain", daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def serve_forever(self) -> None:
        """Start if needed, install signal handlers, and block until drained."""
        if self._server is None:
            self.start()
        self.install_signal_handlers()
        while not self._stopped.wait(0.5):
            pass


#: The ``--log-level`` choices (``logging``'s level names; case-insensitive on the command line).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_server_args(parser, *, default_port: int) -> None:
    """Add the bootstrap's common daemon flags to an ``argparse`` parser."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default_port, help=f"gRPC port (default {default_port})")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off by default)")
    parser.add_argument("--auth-file", default=None, metavar="F",
                        help=f"credential table callers are checked against (else ${ENV_AUTH_FILE}; none: no check)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="extra plaintext port serving only grpc.health.v1, for probes (off by default)")
    add_client_security_args(parser, server=True)
    parser.add_argument("--drain-grace", type=float, default=30.0, help="seconds in-flight RPCs get on SIGTERM")
    parser.add_argument("--max-streams", type=int_at_least(1), default=ServerConfig.max_streams,
                        help=f"streams (Generate, ModelStreamInfer) served at once; one more is UNAVAILABLE "
                             f"(default {ServerConfig.max_streams})")
    add_log_level_arg(parser)


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` (one of :data:`LOG_LEVELS`, any case; default INFO)."""
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="log threshold (default INFO)")


def positive_seconds(text: str) -> float:
    """An ``argparse`` ``type=`` for a duration in seconds: a finite number > 0 (anything else,
    ``0`` included, is a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An ``argparse`` ``type=`` accepting integers >= ``minimum`` (and <= ``maximum`` when
    given; anything else is a usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if maximum is not None and not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"expected an integer in [{minimum}, {maximum}], got {value}")
        if value < minimum:
            wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


def config_from_args(args, service: str) -> ServerConfig:
    """Build a :class:`ServerConfig` from :func:`add_server_args` flags (the daemon's own
    outbound credentials come from :func:`services.channel.client_security_from_args`)."""
    return ServerConfig(
        service=service,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        auth=load_auth_table(getattr(args, "auth_file", None)),
        tls=tls_from_args(args),
        health_port=getattr(args, "health_port", None),
        drain_grace_s=args.drain_grace,
        max_streams=getattr(args, "max_streams", ServerConfig.max_streams),
    )
