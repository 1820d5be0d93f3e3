"""The engine's compiled programs: load them at start-up, or build them in a child process while
the engine serves eager and install them between two steps; their state for ``ModelInfo``
(``docs/architecture.md`` §9)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.errors import Cancelled, FailedPrecondition

if TYPE_CHECKING:
    from runner_service.model_runner import ModelRunner
    from runner_service.programs.build_child import BuildChild
    from runner_service.programs.load import ProgramsReport
    from runner_service.programs.spec import ProgramSpec

log = logging.getLogger(__name__)

#: :attr:`ProgramInstaller.state` values: ``off`` (``--compile off``), ``pending`` (serving eager
#: while the programs are fetched, waited for or compiled in the background), ``installed``,
#: ``eager`` (they failed: serving eager).
PROGRAM_STATES = ("off", "pending", "installed", "eager")
#: How a build child shares the CPU with serving (:func:`build_share`): ``cede`` (default) gives
#: it cores of its own at a fair share, the engine stepping on one thread fewer while it builds
#: when its threads would otherwise fill every core; ``nice`` (nice +10 beside the engine's
#: threads: starves under load) and ``fair`` (nice 0 beside them) are kept for ``bench/build_share.py``.
BUILD_SHARES = ("cede", "nice", "fair")
#: The nice increment of the ``nice`` share.
BUILD_NICE = 10


def available_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask where the OS has one), ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def build_share(threads: int, cpus: int, share: str = "cede") -> tuple[int, int, int]:
    """``(engine threads while a child builds, the child's nice increment, CPUs it is confined
    to or 0 for all)`` for an engine serving on ``threads`` torch threads with ``cpus`` CPUs,
    under ``share`` (:data:`BUILD_SHARES`). ``cede``: the child gets the CPUs the engine's
    threads leave, at nice 0 (a niced child starves beside any busy process: programs must come
    in bounded time); when the engine's threads fill every core, an engine on 2+ threads steps on
    one fewer meanwhile, so one core is left; a single thread on a single CPU shares it. Raises
    ``ValueError`` for another ``share``."""
    if share not in BUILD_SHARES:
        raise ValueError(f"build share must be one of {BUILD_SHARES}, got {share!r}")
    if share == "nice":
        return threads, BUILD_NICE, 0
    if share == "fair":
        return threads, 0, 0
    serving = threads - 1 if 2 <= threads and threads >= cpus else threads
    return serving, 0, max(1, cpus - serving)


class ProgramInstaller:
    """Owns ``runner``'s compiled programs for an engine.

    ``kernel_cache``: address or directory (:func:`runner_service.programs.load.load_programs`).
    ``sidecar``: the directory the engine's weights were mapped from (a build child maps it too;
    ``None``: the child makes random weights in ``weights_dtype``, see
    :mod:`runner_service.programs.build_child`). ``share``: :data:`BUILD_SHARES`.
    ``state`` is one of :data:`PROGRAM_STATES`; ``detail`` what was (or is being) done;
    ``layers`` the installed programs' form (:data:`~runner_service.programs.spec.PROGRAM_LAYERS`,
    ``""`` for none); ``installed_at_s`` the ``clock()`` when background-built programs took over
    (``None`` otherwise), ``unrolled_at_s`` when the unrolled ones replaced loop ones; ``thread`` the background build, if one was started; ``child`` its
    :class:`~runner_service.programs.build_child.BuildChild` (``pid`` once it runs).
    """

    def __init__(self, runner: ModelRunner, kernel_cache: str | None, *, sidecar: str | Path | None = None,
                 weights_dtype: str = "f32", share: str = "cede") -> None:
        build_share(1, 1, share)  # a bad share fails here, not in the background
        self.runner, self.kernel_cache = runner, kernel_cache
        self.sidecar, self.weights_dtype, self.share = sidecar, weights_dtype, share
        self.state = "off"
        self.detail = ""
        self.layers = ""
        self.installed_at_s: float | None = None
        self.unrolled_at_s: float | None = None
        self._ceded = False  # the background build has the engine step on fewer threads (until its child is gone)
        self.thread: threading.Thread | None = None
        self.child: BuildChild | None = None
        self._closed = False

    @property
    def pending(self) -> bool:
        """A background build is still running or its programs are not installed yet."""
        return self.state == "pending"

    @property
    def in_flight(self) -> bool:
        """Whether the background thread is still fetching, waiting for or building the programs."""
        return self.thread is not None and self.thread.is_alive()

    def start(self, between_steps: Callable[[Callable[[], None]], None], clock: Callable[[], float]) -> str:
        """The start-up ``programs`` phase (call it in the stepping thread): load the programs
        now (installed at once), or, with ``background_compile`` in ``aoti`` mode and not all of
        them in the kernel cache, fetch or build them in a background thread, each built in a
        child process and installed by ``between_steps(fn)`` (runs ``fn`` in the stepping thread
        before the next step: :meth:`LLMEngine.call_between_steps`); ``clock()`` gives
        ``installed_at_s`` (seconds since start-up began, on the start-up report's clock). Only
        the background thread holds the two (no cycle with the engine). Returns the phase's
        detail. Raises ``FailedPrecondition`` when a compile mode is asked for and the programs
        package cannot be imported."""
        config = self.runner.config
        if config.compile == "off":
            self.state, self.detail = "off", "compile off (eager)"
            return self.detail
        try:
            from runner_service.programs import load
        except ImportError as e:
            raise FailedPrecondition(f"compile mode {config.compile!r} needs runner_service.programs, "
                                     f"which is not available: {e}") from e
        spec = self.runner.program_spec()
        forms = spec.forms()
        final = spec  # unrolled: the faster step
        if not (config.background_compile and config.compile == "aoti") \
                or load.programs_cached(final, "aoti", self.kernel_cache):
            report = load.load_programs(final, self.runner.install_program, kernel_cache=self.kernel_cache,
                                        progress=self._progress)
            self._set(report, "unrolled")
            return self.detail
        todo = [self.runner.program_spec(layers=f) for f in forms]
        if len(todo) > 1 and load.programs_cached(todo[0], "aoti", self.kernel_cache):
            report = load.load_programs(todo[0], self.runner.install_program, kernel_cache=self.kernel_cache,
                                        progress=self._progress)
            if report.source != "eager":  # the loop programs serve now; the unrolled ones follow
                self._set(report, "loop")
                todo = todo[1:]
        if self.state != "installed":
            self.state = "pending"
            self.detail = "not all in the kernel cache: fetching them, or compiling them in a build child"
        self.thread = threading.Thread(target=self._build_in_background, args=(load, todo, between_steps, clock),
                                       name="background-compile", daemon=True)
        self.thread.start()
        return f"{config.compile}: " + (f"loop programs installed ({self.detail}); building the unrolled ones"
                                        if self.state == "installed" else f"serving eager; {self.detail}")

    def _set(self, report: ProgramsReport, layers: str) -> None:
        """Record ``report`` of the ``layers`` programs: ``installed`` (their form in
        :attr:`layers`) or ``eager`` when they failed and none are installed."""
        if report.source == "eager":
            if self.state != "installed":
                self.state = "eager"
                self.detail = str(report)
            return
        self.state, self.layers, self.detail = "installed", layers, str(report)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the background build (no-op without one)."""
        if self.thread is not None:
            self.thread.join(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop a build in progress (its child is killed; the lease is released by the build's
        failure) and wait up to ``timeout`` seconds for the background thread to end."""
        self._closed = True
        if self.in_flight:
            child = self.child
            log.warning("stopped with the background compile still running: %s",
                        f"killing its build child (pid {child.pid})" if child is not None and child.pid
                        else "no build child yet", extra={"runner_id": self.runner.config.runner_id})
            if child is not None:
                child.stop()
            self.join(timeout)

    def _progress(self, what: str) -> None:
        """What the programs phase is doing now (``ModelInfo.program_detail``; logged)."""
        self.detail = what
        log.info("programs: %s", what, extra={"runner_id": self.runner.config.runner_id})

    def _build_in_background(self, load, specs: list[ProgramSpec], between_steps, clock) -> None:
        """Fetch the programs of each of ``specs`` in turn (the loop form first, when there is
        one: it compiles in a fraction of the time), or build them in one child process
        (:meth:`_compile_in_child`); each is installed between two steps, so the unrolled
        programs replace loop ones there. ``state`` becomes ``installed`` with the first form
        that loads (or ``eager`` when all failed); ``installed_at_s`` / ``unrolled_at_s`` say when.
        A build :meth:`close` cancels logs one line, and nothing runs between steps once it began."""
        from runner_service.programs.build_child import BuildChild, ChildSetup

        between_steps = self._while_open(between_steps)
        spec = specs[0]
        cpus = available_cpus()
        serving, nice, own = build_share(spec.threads, len(cpus), self.share)
        self.child = BuildChild(ChildSetup.of(self.runner, spec, sidecar=self.sidecar, weights_dtype=self.weights_dtype,
                                              nice=nice, cpus=cpus[-own:] if own else None))
        if self._closed:
            self.child.stop()
        self._ceded = False
        compiler = self._child_compiler(self.child, between_steps, serving)
        try:
            for form in specs:
                if self._closed:
                    break
                report = load.load_programs(form, self.runner.install_program, kernel_cache=self.kernel_cache,
                                            defer=between_steps, progress=self._progress, compiler=compiler)
                between_steps(lambda report=report, form=form: self._record(report, form.layers, clock))
        except Cancelled:
            log.info("program build cancelled: shutting down", extra={"runner_id": self.runner.config.runner_id})
        finally:
            self.child.close()
            if self._ceded:  # the child is gone: its CPU serves again (not before, or two threads share one CPU)
                between_steps(lambda: self._step_on(spec.threads, None))

    def _while_open(self, between_steps: Callable[[Callable[[], None]], None]) -> Callable[[Callable[[], None]], None]:
        """``between_steps`` for functions skipped once :meth:`close` began: nothing is installed,
        recorded or re-threaded while (or after) the engine closes."""

        def call(fn: Callable[[], None]) -> None:
            between_steps(lambda: None if self._closed else fn())

        return call

    def _child_compiler(self, child: BuildChild, between_steps, serving: int):
        """The :data:`~runner_service.programs.aoti.Compiler` of the background build: ``child``
        compiles while the stepping thread steps on ``serving`` torch threads, from the first
        compile (between two steps; :attr:`_ceded` says so) until the caller has ended the
        child: between two compiles the child still packages and the runner publishes and loads,
        so restoring the threads there would put two OpenMP threads on one busy CPU."""

        def compile_in_child(spec: ProgramSpec, kind: str, package: Path) -> Path:
            name = f"{spec.family.name}.{kind}.{spec.mode}"
            cede = serving < spec.threads
            if cede and not self._ceded:
                between_steps(lambda: self._step_on(serving, spec.threads))
                self._ceded = True
            cpus = child.setup.cpus
            self._progress(f"compiling {name} here, in a build child (nice +{child.setup.nice}"
                           + (f", on {len(cpus)} CPU(s) of its own" if cpus else "")
                           + (f"; serving on {serving} of {spec.threads} threads meanwhile)" if cede else ")"))
            return child.compile(spec, kind, package)

        return compile_in_child

    def _step_on(self, threads: int, key_threads: int | None) -> None:
        """In the stepping thread: step on ``threads`` torch threads while the program key keeps
        naming ``key_threads`` (``None``: the stepping thread's, :attr:`ModelRunner.serving_threads`)."""
        torch.set_num_threads(threads)
        self.runner.serving_threads = key_threads

    def _record(self, report: ProgramsReport, layers: str, clock: Callable[[], float]) -> None:
        """In the stepping thread: the ``layers`` programs of ``report`` are installed (or failed)."""
        first = self.state != "installed"
        self._set(report, layers)
        now = clock()
        rid = {"runner_id": self.runner.config.runner_id}
        if report.source == "eager":
            log.warning("%s programs failed %.1f s after start-up began; %s: %s", layers, now,
                        "serving eager" if self.state == "eager" else f"keeping the {self.layers} ones", report,
                        extra=rid)
            return
        if first:
            self.installed_at_s = now
        if layers == "unrolled" and not first:
            self.unrolled_at_s = now
        log.info("compiled %s programs installed %.1f s after start-up began, between two steps: %s",
                 layers, now, report, extra=rid)
