"""The local stack's supervisor: :class:`LocalStack` runs kernel-cache, weights, the router, the
OpenAI door and N runners as child processes on loopback (``docs/architecture.md`` §1).

``start()`` launches them in dependency order and waits for each to answer SERVING from its own
pid, the runners together, then for the router to list every runner READY; a child that exits
while starting raises ``Unavailable`` quoting its log (``HOME/logs/NAME.log``). ``heal()``
relaunches a child that exited after a doubling backoff; ``stop()`` sends SIGTERM (the door and
the router first), then SIGKILL after ``stop_grace_s``. Children also die with this process
(``PR_SET_PDEATHSIG``). What and where: :mod:`warmserve.stack_config`; the state file:
:mod:`warmserve.stack_state`; the reports: :mod:`warmserve.stack_report`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from router_service.client import list_runners
from runner_service.options import SPECULATIVE, check_model_method
from services.errors import InvalidArgument, Unavailable
from services.paths import warmserve_home
from services.ports import KERNEL_CACHE, OPENAI, ROUTER, WEIGHTS
from services.procs import PARENT_PID_ENV
from warmserve import stack_state
from warmserve.stack_config import PortPlan, StackCommands, StackConfig, zygote_socket
from warmserve.stack_tls import client_security, http_context, make_stack_pki

#: Seconds between two "still starting" / "still compiling" lines of a long wait.
NOTE_INTERVAL_S = 10.0


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
        #: The runner zygote (``config.runner_zygote``): launched with the services, not health-checked
        #: (a runner's launch waits for its socket), relaunched by :meth:`heal` like them.
        self.zygote: ChildProcess | None = None
        self.plan = PortPlan(config)
        self.commands = StackCommands(config, self.home, self.plan)
        #: What the launcher's own clients present (the stack's certificate with ``tls``).
        self.security = client_security(self.commands.pki)

    # --- addresses ----------------------------------------------------------------------------

    def port(self, name: str) -> int:
        """The port of ``router``, ``kernel-cache``, ``weights``, ``openai`` or ``runner-I``
        (:class:`~warmserve.stack_config.PortPlan`)."""
        return self.plan.port(name)

    def address(self, name: str) -> str:
        """``host:port`` of ``router``, ``kernel-cache``, ``weights`` or ``runner-I``."""
        return self.plan.address(name)


    @property
    def router_address(self) -> str:
        """``host:port`` of the router (the stack's Generation endpoint)."""
        return self.address(ROUTER)

    def credentials(self, identity: str = "client"):
        """What ``identity`` of this stack (:mod:`warmserve.stack_auth`) presents: its token (none
        without ``auth``) and the stack's TLS files (:attr:`security`; none without ``tls``)."""
        from services.channel import ClientSecurity
        from warmserve.stack_auth import stack_security

        token = stack_security(self.home, identity).token if self.config.auth else None
        return ClientSecurity(token=token, tls=self.security.tls if self.security is not None else None)

    def endpoints(self) -> dict[str, str]:
        """Every launched service's name -> address."""
        out = {name: c.address for name, c in self.services.items()}
        out.update({c.name: c.address for c in self.runners})
        return out

    # --- commands -----------------------------------------------------------------------------

    def runner_argv(self, index: int) -> list[str]:
        """The command line of runner ``index`` (registers with the router under ``runner-I``)."""
        return self.commands.runner(index)

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
                    # exit 2: the child refused what it was given (a flag, the model): bad input to the stack too
                    error = InvalidArgument if code == 2 else Unavailable
                    raise error(f"{child.name} exited with status {code} while starting; "
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

    def _probe(self, child: ChildProcess) -> str:
        """``SERVING`` once ``child`` answers from its own pid: a gRPC health check, or for the
        OpenAI door its HTTP ``/health`` (200, or 503 while no runner is READY: it is up either way)."""
        from services.healthcheck import check_health

        if child.name != OPENAI:
            return check_health(child.address, timeout_s=0.5, pid=child.proc.pid, security=self.security)
        from openai_service.healthcheck import check_http_health

        status = check_http_health(child.address, timeout_s=0.5, pid=child.proc.pid,
                                   tls=http_context(self.commands.pki))
        return "SERVING" if status == "NOT_SERVING" else status

    def wait_registered(self, names: list[str], timeout_s: float = 30.0) -> None:
        """Block until the router lists each runner in ``names`` READY (``Unavailable`` after
        ``timeout_s`` seconds)."""
        end = time.monotonic() + timeout_s
        from services.proto import router_pb2

        while True:
            ready = {r.runner_id for r in list_runners(self.router_address, security=self.credentials("admin"))
                     if r.state == router_pb2.RunnerStatus.STATE_READY}
            if set(names) <= ready:
                return
            if time.monotonic() > end:
                raise Unavailable(f"the router has not admitted {sorted(set(names) - ready)} after {timeout_s:g} s")
            time.sleep(0.1)

    def preflight(self) -> None:
        """Check what would make the launch fail, before anything starts: the model source must
        resolve (``InvalidArgument``: no such file, not a checkpoint) and, when its family can be read
        here, take ``--speculative``'s method (:func:`runner_service.options.check_model_method`),
        the home must be a directory
        if it exists (``InvalidArgument``), and every fixed port must be free (``Unavailable``
        naming each busy port and its service; with ``base_port`` 0, free ones are picked and only
        the host is checked). With a ``store``, its bucket must answer and accept conditional
        writes (``InvalidArgument`` otherwise, see :meth:`services.s3.ObjectStore.check`). Creates
        nothing (but the store's probe object, removed at once)."""
        from services.address import bind_problem
        from weight_service.sources import resolve_source

        resolve_source(self.config.model)
        check_model_method(self.config.model, self.config.speculative or SPECULATIVE.serve_default)
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
            if not self.home.exists():  # a new home holds secrets: 0700 whatever the umask
                self.home.mkdir(parents=True, mode=0o700)
                os.chmod(self.home, 0o700)
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgument(f"cannot create the home {self.home} (--home / $WARMSERVE_HOME): "
                                  f"{e.strerror or e}") from e
        try:
            self._progress(f"warmserve stack: home {self.home}, logs in {self.log_dir}")
            if self.config.tls:
                make_stack_pki(self.home, self.config.host)
                self._progress(f"  mTLS: a throw-away CA and certificate in {self.commands.pki.ca.parent}")
            if self.config.auth:
                from warmserve.stack_auth import ensure_stack_credentials

                self._progress(f"tokens in {ensure_stack_credentials(self.home, self.config.runners)}")
            if self.config.runners:
                self._ensure_zygote()  # it imports torch while the services start
            first = (KERNEL_CACHE, WEIGHTS, ROUTER, *((OPENAI,) if self.config.openai else ()))
            for name in first:
                self.services[name] = self._launch(ChildProcess(
                    name, self.commands.service(name), self.address(name), self.log_dir / f"{name}.log"))
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
            self._ensure_zygote()
            while len(self.runners) <= index:
                self.runners.append(None)  # type: ignore[arg-type]
            old = self.runners[index]
            if old is not None and old.running:
                raise InvalidArgument(f"{name} is already running")
            self.runners[index] = self._launch(child)
        if wait:
            self.wait_runners([index])
        return child

    def _ensure_zygote(self) -> None:
        """Launch the runner zygote (``config.runner_zygote``) unless it is launched already (a
        zygote that exited is :meth:`heal`'s to relaunch; a runner's launch waits for its socket)."""
        if self.config.runner_zygote and self.zygote is None:
            self.zygote = self._launch(ChildProcess("runner-zygote", self.commands.zygote(),
                                                    str(zygote_socket(self.home)), self.log_dir / "runner-zygote.log"))

    def add_runner(self) -> ChildProcess:
        """Launch one more runner (the next index) and wait until it serves."""
        return self.start_runner(len(self.runners))

    def wait_runners(self, indices) -> None:
        """Wait until the given runners are SERVING and admitted by the router."""
        children = [self.runners[i] for i in indices]
        self._wait_serving(children)
        self.wait_registered([c.name for c in children])

    def wait_programs(self, index: int, timeout_s: float | None = None, *, final: bool = False) -> object:
        """Wait until runner ``index``'s compiled programs are no longer ``pending`` (installed,
        failed, or compile off) — with ``final``, until its background build has ended too (the
        unrolled programs after the loop ones) — noting what it is doing every 10 s; returns its
        ``ModelInfoResponse``. ``Unavailable`` after ``timeout_s`` seconds (default the start-up
        timeout)."""
        start = time.monotonic()
        end = start + (self.config.startup_timeout_s if timeout_s is None else timeout_s)
        next_note = start + NOTE_INTERVAL_S
        while True:
            info = self.startup_report(index)
            if info.program_state != "pending" and not (final and info.programs_building):
                return info
            now = time.monotonic()
            if now > end:
                raise Unavailable(f"runner-{index}'s compiled programs are still pending: {info.program_detail}")
            if now > next_note:
                serves = "eager" if info.program_state == "pending" else f"its {info.program_layers} programs"
                self._progress(f"  ... runner-{index} serves {serves}; {info.program_detail} "
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

        with GenerationClient(self.runners[index].address, security=self.credentials("admin")) as client:
            return client.model_info()

    def stop(self) -> None:
        """SIGTERM every child (the OpenAI door and the router first), wait ``stop_grace_s`` s,
        then SIGKILL stragglers; the state file goes too."""
        self.remove_state()
        order = [self.services.get(OPENAI), self.services.get(ROUTER), *self.runners, self.zygote,
                 self.services.get(WEIGHTS), self.services.get(KERNEL_CACHE)]
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
        return [c for c in self._children() if c.proc and not c.running]

    def _children(self) -> list[ChildProcess]:
        return [c for c in [*self.services.values(), self.zygote, *self.runners] if c is not None]

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
        return {c.name: c.restarts for c in self._children()}

    @property
    def state_path(self) -> Path:
        """``HOME/stack.json``: what ``warmserve status`` reads about this stack (see
        :meth:`write_state`)."""
        return self.home / stack_state.STATE_FILE

    def write_state(self) -> None:
        """Record the stack for ``warmserve status`` (:func:`warmserve.stack_state.write_state`).
        Nothing without ``record_state``."""
        if self.config.record_state:
            stack_state.write_state(self.home, self.router_address,
                                    [c for c in [*self.services.values(), *self.runners] if c is not None])

    def remove_state(self) -> None:
        """Forget the state file (the stack stopped); one this stack did not write is left alone."""
        if self.config.record_state:
            self.state_path.unlink(missing_ok=True)



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

