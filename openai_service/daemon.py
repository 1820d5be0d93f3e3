"""``warmserve openai serve``: the OpenAI door (:func:`openai_service.app.create_app`) on uvicorn,
with httptools' HTTP/1.1 parser (h11's, pure Python, costs more CPU per streamed event).

:class:`OpenAIServer` serves either in the foreground (:meth:`~OpenAIServer.serve_forever`:
uvicorn handles SIGINT/SIGTERM, finishing requests for up to 5 s) or in a background thread with
its own event loop (:meth:`~OpenAIServer.start` / :meth:`~OpenAIServer.stop`, for tests and
embedding). A busy port is one sentence before anything starts (``Unavailable``: ``cannot bind
127.0.0.1:50053: address already in use``), as the gRPC daemons say it. Once listening it logs
``ready`` with its address, the router's, and whether the API key and TLS are on (a door
without a key logs ``api key off``). With ``tls_cert``/``tls_key`` uvicorn serves HTTPS; with
``tls_ca`` too it requires a client certificate signed by that CA (``ssl.CERT_REQUIRED``).
The API key comes from ``--api-key-file`` or the environment (:data:`API_KEY_ENV`), never argv.
Calls to the router carry the door's own token (``--token-file``/``$WARMSERVE_TOKEN``) and, with
``--tls-ca``, go over TLS with the same files (``--tls-server-name`` for a router dialled by IP).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping

import uvicorn

from openai_service.app import create_app
from openai_service.config import OpenAIConfig
from services.address import bind_problem, format_address
from services.auth import read_token
from services.channel import ClientSecurity
from services.errors import InvalidArgument, Unavailable
from services.log import configure_logging
from services.tls import TLSFiles

log = logging.getLogger(__name__)

#: Seconds in-flight requests get to finish once the server is asked to stop.
GRACEFUL_SHUTDOWN_S = 5
#: The environment variable holding the door's API key when no ``--api-key-file`` is given.
API_KEY_ENV = "WARMSERVE_API_KEY"


def api_key_from(path: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key: the first line of ``path`` (stripped) when given, else ``environ``'s
    :data:`API_KEY_ENV`, else ``None`` (the door is open). Raises ``InvalidArgument`` for a
    file that cannot be read or holds no key (the message never contains the key)."""
    if path is None:
        return environ.get(API_KEY_ENV) or None
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"--api-key-file {path}: cannot read it ({e.__class__.__name__})") from None
    if not key:
        raise InvalidArgument(f"--api-key-file {path}: the first line is empty")
    return key


def _tls_options(config: OpenAIConfig) -> dict:
    """uvicorn's TLS settings for ``config`` (none without a certificate)."""
    if config.tls_cert is None:
        return {}
    return {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key, "ssl_ca_certs": config.tls_ca,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if config.tls_ca is not None else ssl.CERT_NONE}


class OpenAIServer:
    """One OpenAI door for ``config``; ``log_level`` is uvicorn's (``INFO``, ``DEBUG``, ...)."""

    def __init__(self, config: OpenAIConfig, *, log_level: str = "INFO") -> None:
        self.config = config
        self.app = create_app(config)
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host=config.host, port=config.port, loop="asyncio", http="httptools", lifespan="on",
            log_config=None, log_level=log_level.lower(), access_log=log_level.upper() == "DEBUG",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **_tls_options(config)))
        self._thread: threading.Thread | None = None
        #: The bound port (valid once started; differs from ``config.port`` when that is 0).
        self.port: int | None = None

    @property
    def address(self) -> str:
        """``host:port`` served (valid once started)."""
        return format_address(self.config.host, self.port if self.port is not None else self.config.port)

    @property
    def url(self) -> str:
        """The API's base URL, ``http(s)://host:port/v1`` (valid once started)."""
        return f"{self.config.scheme}://{self.address}/v1"

    def _preflight(self) -> None:
        problem = bind_problem(self.config.host, self.config.port)
        if problem is not None:
            raise Unavailable(f"cannot bind {self.config.address}: {problem}")

    def _on_started(self) -> None:
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        if self.config.api_key is None:
            log.warning("api key off", extra={"address": self.address})
        log.info("ready", extra={"address": self.address, "url": self.url, "router": self.config.router,
                                 "api_key": self.config.api_key is not None,
                                 "tls": "mtls" if self.config.tls_ca else "tls" if self.config.tls_cert else "off"})

    def start(self, timeout_s: float = 30.0) -> int:
        """Serve in a background thread; returns the bound port once listening. Raises
        ``Unavailable`` when the port is busy or the server does not start within ``timeout_s``
        seconds."""
        self._preflight()
        self._thread = threading.Thread(target=self._server.run, name="openai-http", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise Unavailable(f"the OpenAI door did not start on {self.config.address} (see its log)")
            time.sleep(0.01)
        self._on_started()
        return self.port

    def stop(self, timeout_s: float = GRACEFUL_SHUTDOWN_S + 5.0) -> None:
        """Stop a :meth:`start`-ed server (in-flight requests get :data:`GRACEFUL_SHUTDOWN_S`)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM. Raises ``Unavailable`` for a busy port."""
        self._preflight()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        task = asyncio.ensure_future(self._server.serve())
        while not self._server.started and not task.done():
            await asyncio.sleep(0.01)
        if self._server.started:
            self._on_started()
        await task


def serve_from_args(args) -> int:
    """Entry point of ``warmserve openai serve``: serve until SIGINT/SIGTERM. Raises
    ``InvalidArgument`` for bad flags (exit 2) and ``Unavailable`` for a busy port (exit 1)."""
    hosts = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    # Outbound: a CA (--router-tls-ca, else --tls-ca) means the router is dialled over TLS, verified
    # against it, the door's certificate presented; the token from --token-file or $WARMSERVE_TOKEN.
    router_ca = args.router_tls_ca or args.tls_ca
    outbound = TLSFiles(cert=args.tls_cert, key=args.tls_key, ca=router_ca,
                        server_name=args.tls_server_name) if router_ca else None
    security = ClientSecurity(token=read_token(args.token_file), tls=outbound)
    config = OpenAIConfig(router=args.router, host=args.host, port=args.port, served_model_name=args.served_model_name,
                          api_key=api_key_from(args.api_key_file), max_body_bytes=args.max_body_bytes,
                          allowed_hosts=hosts, enable_docs=args.enable_docs, tls_cert=args.tls_cert,
                          tls_key=args.tls_key, tls_ca=args.tls_ca, router_security=security)
    configure_logging("openai", args.log_level)
    OpenAIServer(config, log_level=args.log_level).serve_forever()
    return 0
