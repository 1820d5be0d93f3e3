"""What a local stack launches (:class:`StackConfig`), where (:class:`PortPlan`) and with which
command lines (:class:`StackCommands`); see ``docs/architecture.md`` §1 for the port plan.

A runner's flags come from :mod:`runner_service.options`, the ports from :mod:`services.ports`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from router_service.config import DEFAULT_POLICY
from runner_service.options import FORWARDED_OPTIONS, check_options, runner_argv
from services import ports
from services.address import format_address
from services.errors import InvalidArgument
from services.ports import DEFAULT_BASE_PORT, KERNEL_CACHE, OPENAI, ROUTER, RUNNER_PORT_OFFSET, WEIGHTS
from warmserve import stack_auth
from warmserve.stack_tls import stack_pki
from weight_service.model_roots import root_for
from weight_service.sources import BUNDLED_SMOLLM2

#: The longest Unix socket path ``bind`` takes on Linux (``sun_path`` is 108 bytes, NUL included).
MAX_SOCKET_PATH = 107


def zygote_socket(home: Path) -> Path:
    """Where a stack's runner zygote listens: ``HOME/run/runner-zygote.sock``, or where that is
    longer than a socket path may be, ``$TMPDIR/warmserve-UID/<digest of HOME>.sock``
    (``InvalidArgument`` when even that is too long; the zygote checks that the directory is
    this user's and private when it binds)."""
    path = home / "run" / "runner-zygote.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    import hashlib
    import tempfile

    short = Path(tempfile.gettempdir()) / f"warmserve-{os.getuid()}" / \
        f"{hashlib.sha256(os.fsencode(home)).hexdigest()[:16]}.sock"
    if len(os.fsencode(short)) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"no socket path fits for the runner zygote of {home}: use a shorter --home or TMPDIR, "
                              "or --no-runner-zygote")
    return short


def split_threads(runners: int) -> int:
    """Torch threads per runner when ``runners`` runners share the host's cores:
    ``max(1, cpu_count // runners)`` (``up`` with ``runner_threads`` unset, and the demo for its
    runners plus the warm one; the same count for the same share keeps their programs' keys equal)."""
    return max(1, (os.cpu_count() or 1) // max(1, runners))


@dataclass(frozen=True)
class StackConfig:
    """What to launch; validated at construction (``InvalidArgument``). Times in seconds.

    ``compile``/``dtype``/``weights_dtype``/``quantized_activations``/``max_num_seqs``/``max_num_batched_tokens``/``prefix_caching``/``batch_invariant``/``speculative``/
    ``num_speculative_tokens``/``prompt_lookup_max``/``prompt_lookup_min`` are the forwarded runner options (:data:`runner_service.options.FORWARDED_OPTIONS`, one field each);
    ``None`` leaves the runner's default, ``prefix_caching=False`` passes ``--no-prefix-caching``. ``home`` of
    ``None`` means ``$WARMSERVE_HOME``. ``runner_args`` are extra flags for every runner.
    ``runner_threads``: torch CPU threads per runner; ``None`` splits the host's cores evenly
    between the runners (``max(1, cpu_count // runners)``), since runners that each take every
    core oversubscribe the CPU and OpenMP barriers then stall decode (see ``docs/benchmarks.md``).
    ``first_token_timeout_s``: the router's ``--first-token-timeout`` (``None``: its default).
    ``record_state``: write ``HOME/stack.json`` for ``warmserve status`` (the demo does not).
    ``openai``: also start the OpenAI-compatible HTTP door over the router, on ``openai_port``
    (``None``: ``base_port + 3``, or a free port when ``base_port`` is 0; 0: a free port).
    ``served_model_name``: the model name the router's KServe v2 door and the OpenAI door
    publish (``--served-model-name`` of both; ``None``: derived from the model source).
    ``store``: an ``s3://BUCKET/PREFIX`` the kernel cache and the weight service share their
    artifacts through (``--store`` of both; ``None``: the home only).
    ``tls``: every daemon and door serves mTLS with the throw-away PKI of
    :mod:`warmserve.stack_tls` (``HOME/tls/``).
    Restarts (:meth:`LocalStack.heal`): a child that exits unexpectedly is relaunched after
    ``restart_backoff_s`` doubled for each restart of it in the last minute (at most
    ``max_restart_backoff_s``); one that would need more than ``max_restarts_per_minute``
    restarts in a minute is given up.
    ``auth``: every daemon checks tokens (``HOME/auth``, :mod:`warmserve.stack_auth`) and presents
    its own; ``False`` runs them unauthenticated (as before issue 23).
    ``runner_zygote``: runners are launched through a runner zygote the stack starts first
    (:mod:`runner_service.zygote`, on :func:`zygote_socket`), so a runner's launch, relaunch or
    addition pays no interpreter start or torch import; ``False``: each runner is a fresh
    interpreter.
    """

    runners: int = 2
    model: str = BUNDLED_SMOLLM2
    base_port: int = DEFAULT_BASE_PORT
    home: Path | None = None
    compile: str | None = None
    dtype: str | None = None
    weights_dtype: str | None = None
    quantized_activations: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    batch_invariant: bool | None = None
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    policy: str = DEFAULT_POLICY
    host: str = "127.0.0.1"
    lease_seconds: float = 3.0
    health_interval_s: float = 0.5
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 10.0
    python: str = sys.executable
    runner_args: tuple[str, ...] = ()
    runner_threads: int | None = None
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    max_restarts_per_minute: int = 5
    first_token_timeout_s: float | None = None
    record_state: bool = True
    openai: bool = False
    openai_port: int | None = None
    served_model_name: str | None = None
    store: str | None = None
    tls: bool = False
    auth: bool = True
    runner_zygote: bool = True

    def __post_init__(self) -> None:
        if self.runners < 0:
            raise InvalidArgument(f"--runners must be >= 0, got {self.runners}")
        if self.base_port != 0 and not 1024 <= self.base_port <= 65535 - RUNNER_PORT_OFFSET - max(self.runners, 1) - 16:
            raise InvalidArgument(f"--base-port must be 0 (free ports) or leave room for the stack, got {self.base_port}")
        values = {option.dest: getattr(self, option.dest) for option in FORWARDED_OPTIONS}
        for option in FORWARDED_OPTIONS:
            option.validate(values[option.dest])
        check_options(values, {dest for dest, value in values.items() if value is not None})
        if self.openai_port is not None and not 0 <= self.openai_port <= 65535:
            raise InvalidArgument(f"--openai-port must be in [0, 65535] (0: a free port), got {self.openai_port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidArgument("--served-model-name must not be empty")
        if self.store is not None:
            from services.s3_location import parse_s3_url

            parse_s3_url(self.store)  # a malformed --store: InvalidArgument naming what is wrong
        if self.runner_threads is not None and self.runner_threads < 1:
            raise InvalidArgument(f"runner threads must be >= 1, got {self.runner_threads}")
        if self.lease_seconds <= 0 or self.health_interval_s <= 0 or self.startup_timeout_s <= 0:
            raise InvalidArgument("lease, health interval and start-up timeout must be > 0 seconds")
        if self.restart_backoff_s <= 0 or self.max_restart_backoff_s < self.restart_backoff_s \
                or self.max_restarts_per_minute < 1:
            raise InvalidArgument("restart backoff must be > 0 s (at most the maximum) and at least 1 restart "
                                  "per minute must be allowed")

    @classmethod
    def from_args(cls, args) -> StackConfig:
        """From the ``up``/``demo`` flags of :mod:`warmserve.stack_cli`."""
        return cls(runners=args.runners, model=args.model, base_port=args.base_port,
                   home=Path(args.home).expanduser().resolve() if args.home else None,
                   **{option.dest: getattr(args, option.dest) for option in FORWARDED_OPTIONS}, policy=args.policy,
                   openai=getattr(args, "openai", False), openai_port=getattr(args, "openai_port", None),
                   served_model_name=getattr(args, "served_model_name", None), store=getattr(args, "store", None),
                   tls=getattr(args, "tls", False), runner_zygote=args.runner_zygote)




class PortPlan:
    """The ports of one stack's services, each chosen once: ``base_port`` + the service's
    distance from the router in :data:`services.ports.DEFAULT_PORTS` (runner ``i`` at
    ``RUNNER_PORT_OFFSET + i``), or free ones when ``base_port`` is 0; the OpenAI door at
    ``openai_port`` when that is set (0: a free one)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._ports: dict[str, int] = {}

    def port(self, name: str) -> int:
        """The port of ``router``, ``kernel-cache``, ``weights``, ``openai`` or ``runner-I``."""
        if name not in self._ports:
            base = self.config.base_port
            if name == OPENAI and self.config.openai_port is not None:
                self._ports[name] = self.config.openai_port or self._unused_free_port()
            else:
                self._ports[name] = self._unused_free_port() if base == 0 else ports.stack_port(base, name)
        return self._ports[name]

    def _unused_free_port(self) -> int:
        """A free port no other service of this stack was given: the kernel hands a port it just
        freed out again, so two services could otherwise be told the same one."""
        port = ports.free_port(self.config.host)
        while port in self._ports.values():
            port = ports.free_port(self.config.host)
        return port

    def address(self, name: str) -> str:
        """``host:port`` of ``name`` (see :meth:`port`)."""
        return format_address(self.config.host, self.port(name))


class StackCommands:
    """The command line of each child of a stack with this ``config``, ``home`` and ports."""

    def __init__(self, config: StackConfig, home: Path, plan: PortPlan) -> None:
        self.config, self.home, self.plan = config, home, plan
        #: The stack's PKI with ``tls`` (:mod:`warmserve.stack_tls`), else ``None``.
        self.pki = stack_pki(home) if config.tls else None
        self._tls = self.pki.server_flags() if self.pki is not None else []

    def _cli(self, *args: str) -> list[str]:
        return [self.config.python, "-m", "warmserve.cli", *args]

    def _server(self, name: str, identity: str | None = None) -> list[str]:
        """Bind and TLS flags, plus with auth the stack's auth file and ``identity``'s own token."""
        argv = ["--host", self.config.host, "--port", str(self.plan.port(name)), "--drain-grace", "5", *self._tls]
        return argv + self._auth(identity, server=True)

    def _auth(self, identity: str | None, *, server: bool) -> list[str]:
        if not self.config.auth:
            return []
        d = stack_auth.auth_dir(self.home)
        return [*(["--auth-file", str(d / stack_auth.AUTH_FILE)] if server else []),
                *(["--token-file", str(stack_auth.token_file(self.home, identity))] if identity else [])]

    def service(self, name: str) -> list[str]:
        """The command line of ``kernel-cache``, ``weights``, ``router`` or ``openai``."""
        cfg = self.config
        store = ["--store", cfg.store] if cfg.store else []
        if name == KERNEL_CACHE:
            return self._cli("cache", "serve", "--root", str(self.home / "kernel-cache"), *store, *self._server(name))
        if name == WEIGHTS:
            root = root_for(cfg.model)  # the weight service serves only the bundled model and its --model-root
            roots = ["--model-root", root] if root is not None else []
            return self._cli("weights", "serve", "--root", str(self.home / "sidecars"), *roots, *store,
                             *self._server(name))
        named = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
        if name == OPENAI:
            key = (["--api-key-file", str(stack_auth.auth_dir(self.home) / stack_auth.OPENAI_KEY_FILE)]
                   if cfg.auth and stack_auth.DOOR_TAKES_API_KEY else [])
            return self._cli("openai", "serve", "--router", self.plan.address(ROUTER), "--host", cfg.host,
                             "--port", str(self.plan.port(name)), *named, *self._tls,
                             *self._auth(stack_auth.DOORS, server=False), *key)
        argv = self._cli("router", "serve", *self._server(name, stack_auth.ROUTER), "--policy", cfg.policy,
                         "--lease-seconds", str(cfg.lease_seconds), "--health-interval", str(cfg.health_interval_s),
                         *named)
        if cfg.first_token_timeout_s is not None:
            argv += ["--first-token-timeout", str(cfg.first_token_timeout_s)]
        return argv

    def zygote(self) -> list[str]:
        """The command line of the runner zygote (``runner_zygote``)."""
        return self._cli("runner", "zygote", "--socket", str(zygote_socket(self.home)))

    def runner(self, index: int) -> list[str]:
        """The command line of runner ``index`` (``runner-I``): its flags from
        :func:`runner_service.options.runner_argv`, the forwarded options included; torch
        threads split the host's cores when ``runner_threads`` is ``None``."""
        cfg, name = self.config, f"runner-{index}"
        threads = cfg.runner_threads or split_threads(cfg.runners)
        values = {"model": cfg.model, "runner_id": name, "weights": self.plan.address(WEIGHTS),
                  "kernel_cache": self.plan.address(KERNEL_CACHE), "router": self.plan.address(ROUTER),
                  "sidecar_dir": str(self.home / "sidecars"), "threads": threads,
                  "zygote": str(zygote_socket(self.home)) if cfg.runner_zygote else None,
                  **{option.dest: getattr(cfg, option.dest) for option in FORWARDED_OPTIONS}}
        return [*self._cli("runner", "serve"), *runner_argv(values), *self._server(name, name), *cfg.runner_args]
