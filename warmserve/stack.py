"""The local stack: kernel-cache, weights, N runners and the router as child processes.

:class:`LocalStack` is what ``warmserve up``, ``warmserve demo`` and the end-to-end tests share.
``start()`` launches ``python -m warmserve.cli ...`` children on loopback, in dependency order:

1. kernel-cache (``base_port + 1``), weights (``base_port + 2``) and the router (``base_port``),
   waiting until each answers SERVING on ``grpc.health.v1``;
2. every runner together (runner ``i`` at ``base_port + 11 + i``): the weight service prepares
   the sidecar once for all of them, and the kernel cache's single-flight builds let one runner
   compile each missing program while the others wait for its publish; meanwhile they all serve
   eager (``runner serve`` compiles in the background by default);

and finally waits until the router lists every runner READY (runners register with ``--router``).
With ``StackConfig.openai`` (``warmserve up`` sets it) the OpenAI-compatible HTTP door
(``warmserve openai serve``, ``base_port + 3`` unless ``openai_port`` says otherwise) starts with
the router: it is up once its ``GET /health`` answers from its own pid (503 until a runner is READY).
:meth:`LocalStack.wait_programs` waits for a runner's compiled programs to take over.
``base_port = 0`` picks free ports instead. Each child writes its JSON log to
``HOME/logs/NAME.log``; a child that exits while starting raises ``Unavailable`` quoting the tail
of its log. ``stop()`` sends SIGTERM to every child (router first), waits ``stop_grace_s``
seconds, then SIGKILLs stragglers. Children also get SIGTERM if this process dies
(``PR_SET_PDEATHSIG``; Linux), so a crashed parent leaves no orphans. While the stack runs,
:meth:`LocalStack.heal` relaunches a child that exited (same port, id and log) after a doubling
backoff, and gives up on one that keeps exiting (``warmserve up`` then stops the stack, exit 1).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from router_service.client import list_runners
from router_service.config import DEFAULT_POLICY
from runner_service.config import COMPILE_MODES, DTYPES, WEIGHTS_DTYPES
from services.address import format_address
from services.errors import InvalidArgument, Unavailable
from services.paths import warmserve_home
from services.procs import PARENT_PID_ENV
from services.table import format_table
from weight_service.sources import BUNDLED_SMOLLM2

ROUTER, KERNEL_CACHE, WEIGHTS, OPENAI = "router", "kernel-cache", "weights", "openai"
#: The router's port; the other services' ports follow it (see :data:`_SERVICE_PORT_OFFSETS`).
DEFAULT_BASE_PORT = 50050
RUNNER_PORT_OFFSET = 11
#: Each service's port is ``base_port`` + its offset; runner ``i`` is at ``RUNNER_PORT_OFFSET + i``.
_SERVICE_PORT_OFFSETS = {ROUTER: 0, KERNEL_CACHE: 1, WEIGHTS: 2, OPENAI: 3}
#: Seconds between two "still starting" / "still compiling" lines of a long wait.
NOTE_INTERVAL_S = 10.0


@dataclass(frozen=True)
class StackConfig:
    """What to launch; validated at construction (``InvalidArgument``). Times in seconds.

    ``compile``/``dtype``/``weights_dtype``/``max_num_seqs`` of ``None`` leave the runner's
    defaults; ``prefix_caching=False`` passes ``--no-prefix-caching`` to every runner. ``home`` of
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
    Restarts (:meth:`LocalStack.heal`): a child that exits unexpectedly is relaunched after
    ``restart_backoff_s`` doubled for each restart of it in the last minute (at most
    ``max_restart_backoff_s``); one that would need more than ``max_restarts_per_minute``
    restarts in a minute is given up.
    """

    runners: int = 2
    model: str = BUNDLED_SMOLLM2
    base_port: int = DEFAULT_BASE_PORT
    home: Path | None = None
    compile: str | None = None
    dtype: str | None = None
    weights_dtype: str | None = None
    max_num_seqs: int | None = None
    prefix_caching: bool = True
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

    def __post_init__(self) -> None:
        if self.runners < 0:
            raise InvalidArgument(f"--runners must be >= 0, got {self.runners}")
        if self.base_port != 0 and not 1024 <= self.base_port <= 65535 - RUNNER_PORT_OFFSET - max(self.runners, 1) - 16:
            raise InvalidArgument(f"--base-port must be 0 (free ports) or leave room for the stack, got {self.base_port}")
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise InvalidArgument(f"unknown compile mode {self.compile!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}")
        if self.weights_dtype is not None and self.weights_dtype not in WEIGHTS_DTYPES:
            raise InvalidArgument(f"unknown weights dtype {self.weights_dtype!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise InvalidArgument(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
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
                   compile=args.compile, dtype=args.dtype, weights_dtype=args.weights_dtype,
                   max_num_seqs=args.max_num_seqs, prefix_caching=args.prefix_caching, policy=args.policy,
                   openai=getattr(args, "openai", False), openai_port=getattr(args, "openai_port", None),
                   served_model_name=getattr(args, "served_model_name", None), store=getattr(args, "store", None))


@dataclass
class ChildProcess:
    """One launched service: its name, argv, ``host:port``, log file and process."""

    name: str
    argv: list[str]
    address: str
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_s: float | None = None  # seconds from launch to SERVING
    restarts: int = 0  # relaunches by LocalStack.heal
    restart_times: list[float] = field(default_factory=list)  # time.monotonic() of each
    restart_due: float | None = None  # when heal relaunches it (exited, waiting out its backoff)

    @property
    def running(self) -> bool:
        """Launched and not exited yet."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the child's log (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LocalStack:
    """Child-process stack (see the module docstring). Use ``with LocalStack(cfg) as s:`` or
    pair ``start()`` with ``stop()``. ``progress(message)`` receives start-up progress lines
    (default: stderr). Start it from the main thread (the children's parent-death signal follows
    the launching thread)."""

    def __init__(self, config: StackConfig, progress: Callable[[str], None] | None = _stderr_progress) -> None:
        self.config = config
        self.home = (config.home or warmserve_home()).resolve()
        self.log_dir = self.home / "logs"
        self._progress = progress or (lambda _m: None)
        self._lock = threading.Lock()
        self.services: dict[str, ChildProcess] = {}
        self.runners: list[ChildProcess] = []
        self._ports: dict[str, int] = {}

    # --- addresses ----------------------------------------------------------------------------

    def port(self, name: str) -> int:
        """The port of ``router``, ``kernel-cache``, ``weights``, ``openai`` or ``runner-I`` (a free
        one, chosen once, when ``base_port`` is 0; ``openai`` at ``openai_port`` when that is set)."""
        if name not in self._ports:
            offset = _SERVICE_PORT_OFFSETS.get(name)
            if offset is None:
                offset = RUNNER_PORT_OFFSET + int(name.removeprefix("runner-"))
            base = self.config.base_port
            if name == OPENAI and self.config.openai_port is not None:
                self._ports[name] = self.config.openai_port or self._unused_free_port()
            else:
                self._ports[name] = self._unused_free_port() if base == 0 else base + offset
        return self._ports[name]

    def _unused_free_port(self) -> int:
        """A free port no other service of this stack was given: the kernel hands a port it just
        freed out again, so two services could otherwise be told the same one."""
        port = _free_port(self.config.host)
        while port in self._ports.values():
            port = _free_port(self.config.host)
        return port

    def address(self, name: str) -> str:
        """``host:port`` of ``router``, ``kernel-cache``, ``weights`` or ``runner-I``."""
        return format_address(self.config.host, self.port(name))

    @property
    def router_address(self) -> str:
        """``host:port`` of the router (the stack's Generation endpoint)."""
        return self.address(ROUTER)

    def endpoints(self) -> dict[str, str]:
        """Every launched service's name -> address."""
        out = {name: c.address for name, c in self.services.items()}
        out.update({c.name: c.address for c in self.runners})
        return out

    # --- commands -----------------------------------------------------------------------------

    def _cli(self, *args: str) -> list[str]:
        return [self.config.python, "-m", "warmserve.cli", *args]

    def _service_argv(self, name: str) -> list[str]:
        cfg = self.config
        common = ["--host", cfg.host, "--port", str(self.port(name)), "--drain-grace", "5"]
        store = ["--store", cfg.store] if cfg.store else []
        if name == KERNEL_CACHE:
            return self._cli("cache", "serve", "--root", str(self.home / "kernel-cache"), *store, *common)
        if name == WEIGHTS:
            return self._cli("weights", "serve", "--root", str(self.home / "sidecars"), *store, *common)
        named = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
        if name == OPENAI:
            return self._cli("openai", "serve", "--router", self.router_address, "--host", cfg.host,
                             "--port", str(self.port(name)), *named)
        argv = self._cli("router", "serve", *common, "--policy", cfg.policy,
                         "--lease-seconds", str(cfg.lease_seconds), "--health-interval", str(cfg.health_interval_s),
                         *named)
        if cfg.first_token_timeout_s is not None:
            argv += ["--first-token-timeout", str(cfg.first_token_timeout_s)]
        return argv

    def runner_argv(self, index: int) -> list[str]:
        """The command line of runner ``index`` (registers with the router under ``runner-I``)."""
        cfg, name = self.config, f"runner-{index}"
        argv = self._cli(
            "runner", "serve", "--model", cfg.model, "--runner-id", name,
            "--host", cfg.host, "--port", str(self.port(name)), "--drain-grace", "5",
            "--weights", self.address(WEIGHTS), "--kernel-cache", self.address(KERNEL_CACHE),
            "--router", self.address(ROUTER), "--sidecar-dir", str(self.home / "sidecars"))
        if cfg.compile is not None:
            argv += ["--compile", cfg.compile]
        if cfg.dtype is not None:
            argv += ["--dtype", cfg.dtype]
        if cfg.weights_dtype is not None:
            argv += ["--weights-dtype", cfg.weights_dtype]
        if cfg.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(cfg.max_num_seqs)]
        if not cfg.prefix_caching:
            argv.append("--no-prefix-caching")
        threads = cfg.runner_threads or max(1, (os.cpu_count() or 1) // max(1, cfg.runners))
        argv += ["--threads", str(threads)]
        return argv + list(cfg.runner_args)

    # --- processes ----------------------------------------------------------------------------

    def _launch(self, child: ChildProcess) -> ChildProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, WARMSERVE_HOME=str(self.home), PYTHONUNBUFFERED="1",
                   **{PARENT_PID_ENV: str(os.getpid())})
        with open(child.log_path, "ab") as log:
            child.proc = subprocess.Popen(child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                          cwd=Path(__file__).resolve().parent.parent,
                                          start_new_session=True)  # no preexec_fn: see die_with_parent
        child.started_at = time.monotonic()
        child.ready_s = None
        return child

    def _wait_serving(self, children: list[ChildProcess]) -> None:
        from services.healthcheck import FOREIGN

        pending = list(children)
        end = time.monotonic() + self.config.startup_timeout_s
        next_note = time.monotonic() + NOTE_INTERVAL_S
        while pending:
            for child in list(pending):
                if not child.running:
                    code = child.proc.returncode if child.proc else None
                    raise Unavailable(f"{child.name} exited with status {code} while starting; "
                                      f"its log ({child.log_path}) ends:\n{child.log_tail()}")
                health = self._probe(child)
                if health.startswith(FOREIGN):
                    raise Unavailable(f"{child.name}'s address {child.address} is answered by another process "
                                      f"({health.split(': ', 1)[1]}), not by the {child.name} started here (pid "
                                      f"{child.proc.pid}); another stack holds the port? Stop it, or use "
                                      "--base-port 0")
                if health == "SERVING":
                    child.ready_s = time.monotonic() - child.started_at
                    self._progress(f"  {child.name} SERVING on {child.address} after {child.ready_s:.1f} s")
                    pending.remove(child)
            if not pending:
                return
            now = time.monotonic()
            if now > end:
                raise Unavailable(f"{', '.join(c.name for c in pending)} not SERVING after "
                                  f"{self.config.startup_timeout_s:g} s; see {self.log_dir}")
            if now > next_note:
                for c in pending:
                    last = _last_log_msg(c)
                    self._progress(f"  ... {c.name} still starting ({now - c.started_at:.0f} s)"
                                   + (f", now {last}" if last else ""))
                next_note = now + NOTE_INTERVAL_S
            time.sleep(0.2)

    @staticmethod
    def _probe(child: ChildProcess) -> str:
        """``SERVING`` once ``child`` answers from its own pid: a gRPC health check, or for the
        OpenAI door its HTTP ``/health`` (200, or 503 while no runner is READY: it is up either way)."""
        from services.healthcheck import check_health

        if child.name != OPENAI:
            return check_health(child.address, timeout_s=0.5, pid=child.proc.pid)
        from openai_service.healthcheck import check_http_health

        status = check_http_health(child.address, timeout_s=0.5, pid=child.proc.pid)
        return "SERVING" if status == "NOT_SERVING" else status

    def wait_registered(self, names: list[str], timeout_s: float = 30.0) -> None:
        """Block until the router lists each runner in ``names`` READY (``Unavailable`` after
        ``timeout_s`` seconds)."""
        end = time.monotonic() + timeout_s
        from services.proto import router_pb2

        while True:
            ready = {r.runner_id for r in list_runners(self.router_address)
                     if r.state == router_pb2.RunnerStatus.STATE_READY}
            if set(names) <= ready:
                return
            if time.monotonic() > end:
                raise Unavailable(f"the router has not admitted {sorted(set(names) - ready)} after {timeout_s:g} s")
            time.sleep(0.1)

    def preflight(self) -> None:
        """Check what would make the launch fail, before anything starts: the model source must
        resolve (``InvalidArgument``: no such file, not a checkpoint), the home must be a directory
        if it exists (``InvalidArgument``), and every fixed port must be free (``Unavailable``
        naming each busy port and its service; with ``base_port`` 0, free ones are picked and only
        the host is checked). With a ``store``, its bucket must answer and accept conditional
        writes (``InvalidArgument`` otherwise, see :meth:`services.s3.ObjectStore.check`). Creates
        nothing (but the store's probe object, removed at once)."""
        from services.address import bind_problem
        from weight_service.sources import resolve_source

        resolve_source(self.config.model)
        if self.home.exists() and not self.home.is_dir():
            raise InvalidArgument(f"the home {self.home} is not a directory (--home / $WARMSERVE_HOME)")
        if self.config.store:
            from services.s3 import ObjectStore

            ObjectStore.from_url(self.config.store).check()
        openai = [OPENAI] if self.config.openai else []
        if self.config.base_port == 0:
            problem = bind_problem(self.config.host, 0)
            if problem is not None:
                raise Unavailable(f"cannot start the stack on {self.config.host}: {problem}")
            if not (openai and self.config.openai_port):
                return
            names = openai  # a fixed port given for the door
        else:
            names = [KERNEL_CACHE, WEIGHTS, ROUTER, *openai, *(f"runner-{i}" for i in range(self.config.runners))]
        busy = [(n, self.port(n), problem) for n in names
                if (problem := bind_problem(self.config.host, self.port(n))) is not None]
        if busy:
            what = ", ".join(f"{port} ({name}: {problem})" for name, port, problem in busy)
            raise Unavailable(f"cannot start the stack on {self.config.host}: port {what}; another stack or "
                              "program holds it. Stop it, or start this one on free ports with --base-port 0")

    def start(self) -> LocalStack:
        """Launch everything and wait until it is ready (see the module docstring), after
        :meth:`preflight`. On failure every child is stopped and the error re-raised."""
        self.preflight()
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgument(f"cannot create the home {self.home} (--home / $WARMSERVE_HOME): "
                                  f"{e.strerror or e}") from e
        try:
            self._progress(f"warmserve stack: home {self.home}, logs in {self.log_dir}")
            first = (KERNEL_CACHE, WEIGHTS, ROUTER, *((OPENAI,) if self.config.openai else ()))
            for name in first:
                self.services[name] = self._launch(ChildProcess(
                    name, self._service_argv(name), self.address(name), self.log_dir / f"{name}.log"))
            self._progress(f"starting {', '.join(first[:-1])} and {first[-1]} ...")
            self._wait_serving(list(self.services.values()))
            n = self.config.runners
            if n:
                self._progress(f"starting {n} runner{'s' if n > 1 else ''} together (a missing program is "
                               "built once, by one of them) ...")
                for i in range(n):
                    self.start_runner(i, wait=False)
                self.wait_runners(range(n))
            self.write_state()
            return self
        except BaseException:
            self.stop()
            raise

    def start_runner(self, index: int, *, wait: bool = True) -> ChildProcess:
        """Launch runner ``index`` (again, after a kill: same id and port); with ``wait``, block
        until it is SERVING and the router lists it READY."""
        name = f"runner-{index}"
        child = ChildProcess(name, self.runner_argv(index), self.address(name), self.log_dir / f"{name}.log")
        with self._lock:
            while len(self.runners) <= index:
                self.runners.append(None)  # type: ignore[arg-type]
            old = self.runners[index]
            if old is not None and old.running:
                raise InvalidArgument(f"{name} is already running")
            self.runners[index] = self._launch(child)
        if wait:
            self.wait_runners([index])
        return child

    def add_runner(self) -> ChildProcess:
        """Launch one more runner (the next index) and wait until it serves."""
        return self.start_runner(len(self.runners))

    def wait_runners(self, indices) -> None:
        """Wait until the given runners are SERVING and admitted by the router."""
        children = [self.runners[i] for i in indices]
        self._wait_serving(children)
        self.wait_registered([c.name for c in children])

    def wait_programs(self, index: int, timeout_s: float | None = None) -> object:
        """Wait until runner ``index``'s compiled programs are no longer ``pending`` (installed,
        failed, or compile off), noting what it is doing every 10 s; returns its
        ``ModelInfoResponse``. ``Unavailable`` after ``timeout_s`` seconds (default the start-up
        timeout)."""
        start = time.monotonic()
        end = start + (self.config.startup_timeout_s if timeout_s is None else timeout_s)
        next_note = start + NOTE_INTERVAL_S
        while True:
            info = self.startup_report(index)
            if info.program_state != "pending":
                return info
            now = time.monotonic()
            if now > end:
                raise Unavailable(f"runner-{index}'s compiled programs are still pending: {info.program_detail}")
            if now > next_note:
                self._progress(f"  ... runner-{index} serves eager; {info.program_detail} "
                               f"({now - start:.0f} s waited)")
                next_note = now + NOTE_INTERVAL_S
            time.sleep(0.5)

    def kill_runner(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to runner ``index`` and reap it."""
        child = self.runners[index]
        if child.running:
            child.proc.send_signal(sig)
            child.proc.wait(timeout=self.config.stop_grace_s + 5)

    def startup_report(self, index: int):
        """Runner ``index``'s ``ModelInfoResponse`` (its ``startup`` field is the start-up report)."""
        from services.generation_client import GenerationClient

        with GenerationClient(self.runners[index].address) as client:
            return client.model_info()

    def stop(self) -> None:
        """SIGTERM every child (the OpenAI door and the router first), wait ``stop_grace_s`` s,
        then SIGKILL stragglers; the state file goes too."""
        self.remove_state()
        order = [self.services.get(OPENAI), self.services.get(ROUTER), *self.runners, self.services.get(WEIGHTS),
                 self.services.get(KERNEL_CACHE)]
        children = [c for c in order if c is not None and c.running]
        for c in children:
            try:
                c.proc.terminate()
            except ProcessLookupError:
                pass
        end = time.monotonic() + self.config.stop_grace_s
        for c in children:
            try:
                c.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
                self._progress(f"  {c.name} did not stop within {self.config.stop_grace_s:g} s; killed")

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def exited(self) -> list[ChildProcess]:
        """Children that were launched and are no longer running."""
        return [c for c in [*self.services.values(), *self.runners] if c is not None and c.proc and not c.running]

    def heal(self) -> list[ChildProcess]:
        """Relaunch children that exited (same argv, port and log; a runner re-registers with the
        router, which keeps serving through the others meanwhile), each after its backoff (see
        :class:`StackConfig`); one line of progress per exit and per relaunch. Call it
        periodically (``warmserve up`` does, every second). Returns the children given up on
        (more than ``max_restarts_per_minute`` restarts in the last minute), left exited."""
        cfg = self.config
        now = time.monotonic()
        given_up = []
        for child in self.exited():
            recent = [t for t in child.restart_times if now - t < 60.0]
            if child.restart_due is None:
                if len(recent) >= cfg.max_restarts_per_minute:
                    given_up.append(child)
                    continue
                delay = min(cfg.restart_backoff_s * 2 ** len(recent), cfg.max_restart_backoff_s)
                child.restart_due = now + delay
                self._progress(f"warmserve: {child.name} exited (status {child.proc.returncode}); restarting in "
                               f"{delay:.1f} s (restart {child.restarts + 1}); log: {child.log_path}")
            elif now >= child.restart_due:
                child.restart_due = None
                child.restarts += 1
                child.restart_times.append(now)
                self._launch(child)
                self._progress(f"warmserve: {child.name} restarted (pid {child.proc.pid})")
                self.write_state()
        return given_up

    def restarts(self) -> dict[str, int]:
        """Restarts so far per child name (every launched child, 0 included)."""
        return {c.name: c.restarts for c in [*self.services.values(), *self.runners] if c is not None}

    @property
    def state_path(self) -> Path:
        """``HOME/stack.json``: what ``warmserve status`` reads about this stack (see
        :meth:`write_state`)."""
        return self.home / STATE_FILE

    def write_state(self) -> None:
        """Record the stack for ``warmserve status``: the router address, and per child its
        address, pid and restarts (JSON, replaced atomically). Nothing without ``record_state``."""
        import json

        if not self.config.record_state:
            return
        doc = {"router": self.router_address, "pid": os.getpid(),
               "children": {c.name: {"address": c.address, "pid": c.proc.pid if c.proc else None,
                                     "restarts": c.restarts}
                            for c in [*self.services.values(), *self.runners] if c is not None}}
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.state_path)

    def remove_state(self) -> None:
        """Forget the state file (the stack stopped); one this stack did not write is left alone."""
        if self.config.record_state:
            self.state_path.unlink(missing_ok=True)


#: The stack's state file under its home (:meth:`LocalStack.write_state`).
STATE_FILE = "stack.json"


def _state_doc(home: Path, router_address: str) -> dict | None:
    """The state file of the ``warmserve up`` whose home is ``home``, when it runs the router at
    ``router_address`` and is still alive; ``None`` otherwise."""
    import json

    try:
        doc = json.loads((home / STATE_FILE).read_text())
        os.kill(int(doc["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return doc if doc.get("router") == router_address else None


def read_state(home: Path, router_address: str) -> dict[str, int]:
    """The restarts per child of the ``warmserve up`` whose home is ``home`` (see
    :func:`_state_doc`); ``{}`` when there is no such stack."""
    doc = _state_doc(home, router_address) or {}
    return {name: int(c.get("restarts", 0)) for name, c in doc.get("children", {}).items()}


def stack_services(home: Path, router_address: str) -> dict[str, str]:
    """The other services (kernel-cache, weights, and the OpenAI door when it runs) of that
    stack: name -> address."""
    doc = _state_doc(home, router_address) or {}
    return {name: c["address"] for name, c in doc.get("children", {}).items()
            if name in (KERNEL_CACHE, WEIGHTS, OPENAI) and c.get("address")}


def _last_log_msg(child: ChildProcess) -> str:
    """The ``msg`` of the child's latest JSON log record ("" if none yet; other lines skipped)."""
    import json

    for line in reversed(child.log_tail(20).splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("msg"):
            return str(record["msg"])[:120]
    return ""


# --- reports and status ---------------------------------------------------------------------------


def programs_took_over(info) -> str:
    """How a ``ModelInfoResponse``'s background-built programs ended: ``compiled programs
    installed at 131.0 s (DETAIL)``, or ``failed (staying eager)`` in place of ``installed``."""
    took = "installed" if info.program_state == "installed" else "failed (staying eager)"
    return f"compiled programs {took} at {info.programs_installed_at_s:.1f} s ({info.program_detail})"


def layer_kinds_summary(kinds) -> str:
    """``kinds`` (one per layer) as runs: ``"0 sliding_attention, 1-3 compressed_sparse_attention"``."""
    runs: list[list] = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][2] == kind:
            runs[-1][1] = i
        else:
            runs.append([i, i, kind])
    return ", ".join(f"{a}{'' if a == b else f'-{b}'} {k}" for a, b, k in runs)


def format_startup_report(info, title: str = "") -> str:
    """A ``ModelInfoResponse``'s start-up report as an aligned text block (seconds per phase)."""
    head = title or f"start-up report of {info.runner_id}"
    lines = [f"{head}: {info.startup.total_seconds:.2f} s total",
             f"  model {info.model} ({info.family}, {info.weights_dtype or '?'} weights, {info.dtype} compute, "
             f"{info.device}, compile {info.compile_mode}, "
             f"{info.num_kv_blocks} KV blocks x {info.block_size} tokens)"]
    if info.layer_types:
        lines.append(f"  layers {layer_kinds_summary(info.layer_types)}")
    width = max((len(p.name) for p in info.startup.phases), default=0)
    for p in info.startup.phases:
        lines.append(f"  {p.name:<{width}}  {p.seconds:7.2f} s  {p.detail}")
    if info.program_state == "pending":
        lines.append(f"  serving eager at {info.startup.total_seconds:.1f} s; compiled programs pending: "
                     f"{info.program_detail}")
    elif info.programs_installed_at_s:
        lines.append(f"  serving eager at {info.startup.total_seconds:.1f} s; {programs_took_over(info)}")
    return "\n".join(lines)


def _runner_info(address: str):
    """A runner's ``ModelInfoResponse`` (its programs and its load as of now), ``None`` when it
    does not answer within 2 s."""
    from services.generation_client import GenerationClient

    try:
        with GenerationClient(address) as client:
            return client.model_info(timeout_s=2.0)
    except Exception:  # noqa: BLE001 - a status line, not an error
        return None


def print_status(router_address: str, services: dict[str, str], *, out: TextIO,
                 restarts: dict[str, int] | None = None) -> int:
    """Print the health of the router and of each ``name -> address`` in ``services``, then the
    router's runners (state, compiled programs, outstanding, lease, load, KV use, failures). The
    programs and the load come from each runner's ``ModelInfo``, so they are as of now, not as of
    its last heartbeat to the router; a runner that does not answer shows the heartbeat's, marked
    ``(hb)``. ``restarts`` (name -> count, from :func:`read_state`) adds
    a restarts column. The ``openai`` service (the stack's OpenAI door) is probed over HTTP
    (``GET /health``: SERVING, or NOT_SERVING while no runner is READY) and shown by its URL.
    Returns 0, or 1 when the router cannot be reached."""
    from openai_service.healthcheck import check_http_health
    from services.healthcheck import check_health
    from services.proto import router_pb2

    restarts = restarts or {}
    extra = ("restarts",) if restarts else ()
    rows = [("service", "address", "health", *extra)]
    for name, addr in {"router": router_address, **services}.items():
        shown, health = (f"http://{addr}/v1", check_http_health(addr, timeout_s=2.0)) if name == OPENAI else (
            addr, check_health(addr, timeout_s=2.0))
        rows.append((name, shown, health, *((str(restarts.get(name, 0)),) if restarts else ())))
    out.write(format_table(rows) + "\n")
    if rows[1][2] != "SERVING":
        return 1
    runners = list_runners(router_address)
    out.write("\n")
    table = [("runner", "address", "state", "programs", "outstanding", "lease", "running/waiting", "KV blocks",
              "failures", *extra)]
    for r in runners:
        lease = "static" if r.static else f"{r.lease_expires_in_s:.1f} s"
        info = _runner_info(r.address)
        if info is not None:
            programs = info.program_state or info.compile_mode or "?"
            running, waiting, used, usable, mark = (info.running, info.waiting, info.kv_blocks_used,
                                                    info.kv_blocks_usable, "")
        else:
            programs = "?"
            running, waiting, used, usable, mark = (r.load.running, r.load.waiting, r.load.kv_blocks_used,
                                                    r.load.kv_blocks_total, " (hb)")
        kv = f"{used}/{usable}{mark}" if usable else "-"
        state = router_pb2.RunnerStatus.State.Name(r.state).removeprefix("STATE_")
        table.append((r.runner_id, r.address, state, programs,
                      str(r.outstanding), lease, f"{running}/{waiting}{mark}", kv, str(r.consecutive_failures),
                      *((str(restarts.get(r.runner_id, 0)),) if restarts else ())))
    if len(table) == 1:
        out.write("no runners\n")
    else:
        out.write(format_table(table) + "\n")
    return 0


def _announce_programs(stack: LocalStack, pending: set[int], out: TextIO) -> None:
    """One line per runner in ``pending`` whose compiled programs took over (or failed) since the
    last look; those leave ``pending``."""
    for i in sorted(pending):
        try:
            info = stack.startup_report(i)
        except Exception:  # noqa: BLE001 - restarting, or busy: look again later
            continue
        if info.program_state != "pending":
            pending.discard(i)
            out.write(f"runner-{i}: {programs_took_over(info)}\n")
            out.flush()


def _announce_back(stack: LocalStack, back: set[int], pending: set[int], out: TextIO) -> None:
    """One line per restarted runner in ``back`` once it answers again: its start-up time and
    programs (a restarted runner usually finds them in the kernel cache); a runner whose programs
    are still pending joins ``pending``."""
    for i in sorted(back):
        try:
            info = stack.startup_report(i)
        except Exception:  # noqa: BLE001 - still starting
            continue
        back.discard(i)
        if info.program_state == "pending":
            pending.add(i)
        out.write(f"runner-{i} is back: serving after {info.startup.total_seconds:.1f} s; programs "
                  f"{info.program_state or info.compile_mode}: {info.program_detail}\n")
        out.flush()


def ready_hint(stack: LocalStack) -> str:
    """What ``up`` prints once started: a ``generate`` command that works now, or, for a stack
    without runners, how to add one (its router answers UNAVAILABLE until one registers); then,
    when the stack runs its OpenAI door, the door's base URL."""
    door = ""
    if OPENAI in stack.services:
        url = f"http://{stack.address(OPENAI)}/v1"
        door = f"\nOpenAI-compatible API: {url}   (e.g. curl {url}/models)"
    if stack.runners:
        return f"ready: warmserve generate --addr {stack.router_address} \"Hello!\"   (Ctrl-C stops)" + door
    return (f"ready, with no runners: the router at {stack.router_address} answers UNAVAILABLE until one "
            f"registers; add one that shares this stack's weights and kernel cache with\n"
            f"  warmserve runner serve --model {stack.config.model} --router {stack.router_address} --weights "
            f"{stack.address(WEIGHTS)} --kernel-cache {stack.address(KERNEL_CACHE)} --sidecar-dir "
            f"{stack.home / 'sidecars'} --port 0{door}\n(Ctrl-C stops the stack)")


def run_up(config: StackConfig, *, out: TextIO = sys.stdout) -> int:
    """``warmserve up``: start the stack, print endpoints and start-up reports, then run until
    SIGINT/SIGTERM (exit 0), relaunching children that exit (:meth:`LocalStack.heal`), or until
    one keeps exiting past the restart cap (exit 1); stops every child either way."""
    stop = threading.Event()
    started = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        if not started.is_set():
            raise KeyboardInterrupt  # abandon start-up; start() stops what it launched

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(config)
    try:
        stack.start()
        started.set()
        out.write("\nendpoints:\n")
        for name, addr in stack.endpoints().items():
            out.write(f"  {name:<13} {f'http://{addr}/v1' if name == OPENAI else addr}\n")
        pending = set()
        for i in range(len(stack.runners)):
            info = stack.startup_report(i)
            out.write("\n" + format_startup_report(info) + "\n")
            if info.program_state == "pending":
                pending.add(i)
        out.write("\n" + ready_hint(stack) + "\n")
        out.flush()
        ticks, restarts, back = 0, stack.restarts(), set()
        while not stop.wait(1.0):
            ticks += 1
            if pending and ticks % 5 == 0:
                _announce_programs(stack, pending, out)
            if back:
                _announce_back(stack, back, pending, out)
            given_up = stack.heal()
            now = stack.restarts()
            back |= {int(n.removeprefix("runner-")) for n, c in now.items()
                     if n.startswith("runner-") and c > restarts.get(n, 0)}
            restarts = now
            if given_up:
                for c in given_up:
                    print(f"warmserve: {c.name} keeps exiting (status {c.proc.returncode}, "
                          f"{config.max_restarts_per_minute} restarts in a minute); giving up. Its log "
                          f"({c.log_path}) ends:\n{c.log_tail(10)}", file=sys.stderr)
                return 1
        print("stopping ...", file=sys.stderr)
        return 0
    finally:
        stack.stop()
        for s, h in previous.items():
            signal.signal(s, h)
