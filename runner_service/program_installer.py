"""The engine's compiled programs: load them at start-up, or build them in the background while the
engine serves eager and install them between two steps; their state for ``ModelInfo``
(``docs/architecture.md`` §9)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.errors import FailedPrecondition

if TYPE_CHECKING:
    from runner_service.model_runner import ModelRunner
    from runner_service.programs.load import ProgramsReport

log = logging.getLogger(__name__)

#: :attr:`ProgramInstaller.state` values: ``off`` (``--compile off``), ``pending`` (serving eager
#: while the programs are fetched, waited for or compiled in the background), ``installed``,
#: ``eager`` (they failed: serving eager).
PROGRAM_STATES = ("off", "pending", "installed", "eager")
#: The interpreter's GIL switch interval (seconds) while programs compile beside eager serving.
COMPILE_SWITCH_INTERVAL_S = 0.0002


def _lower_thread_priority(step: int = 10) -> None:
    """Raise the calling thread's nice value by ``step`` (Linux: a thread's own priority, which
    the processes it starts, e.g. the C++ compiler, inherit). Elsewhere nothing: ``PRIO_PROCESS``
    would renice the whole process."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except OSError:
        pass


class ProgramInstaller:
    """Owns ``runner``'s compiled programs for an engine.

    ``kernel_cache``: address or directory (:func:`runner_service.programs.load.load_programs`).
    ``state`` is one of :data:`PROGRAM_STATES`; ``detail`` what was (or
    is being) done; ``installed_at_s`` the ``clock()`` when background-built programs took over
    (``None`` otherwise); ``thread`` the background compile, if one was started.
    """

    def __init__(self, runner: ModelRunner, kernel_cache: str | None) -> None:
        self.runner, self.kernel_cache = runner, kernel_cache
        self.state = "off"
        self.detail = ""
        self.installed_at_s: float | None = None
        self.thread: threading.Thread | None = None

    @property
    def pending(self) -> bool:
        """A background compile is still running or its programs are not installed yet."""
        return self.state == "pending"

    @property
    def in_flight(self) -> bool:
        """Whether the background compile thread is still fetching or compiling the programs."""
        return self.thread is not None and self.thread.is_alive()

    def start(self, between_steps: Callable[[Callable[[], None]], None], clock: Callable[[], float]) -> str:
        """The start-up ``programs`` phase: load the programs now (installed at once), or, with
        ``background_compile`` in ``aoti`` mode and not all of them in the kernel cache, start
        building them in the background, each installed by ``between_steps(fn)`` (runs ``fn`` in
        the stepping thread before the next step: :meth:`LLMEngine.call_between_steps`);
        ``clock()`` gives ``installed_at_s`` (seconds since start-up began, on the start-up
        report's clock). Only the background thread holds the two (no cycle with the engine). Returns the phase's detail. Raises
        ``FailedPrecondition`` when a compile mode is asked for and the programs package cannot
        be imported."""
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
        if config.background_compile and config.compile == "aoti" \
                and not load.programs_cached(spec, "aoti", self.kernel_cache):
            self.state = "pending"
            self.detail = "not all in the kernel cache: fetching or compiling them in the background"
            self.thread = threading.Thread(target=self._compile_in_background, args=(load, spec, between_steps, clock),
                                           name="background-compile", daemon=True)
            self.thread.start()
            return f"{config.compile}: serving eager; {self.detail}"
        report = load.load_programs(spec, self.runner.install_program, kernel_cache=self.kernel_cache,
                                    progress=self._progress)
        self.state = "eager" if report.source == "eager" else "installed"
        self.detail = str(report)
        return self.detail

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the background compile (no-op without one)."""
        if self.thread is not None:
            self.thread.join(timeout)

    def _progress(self, what: str) -> None:
        """What the programs phase is doing now (``ModelInfo.program_detail``; logged)."""
        self.detail = what
        log.info("programs: %s", what, extra={"runner_id": self.runner.config.runner_id})

    def _compile_in_background(self, load, spec, between_steps, clock) -> None:
        """Fetch or compile the programs in this thread at lower CPU priority; each is installed
        between two steps; then ``state`` becomes ``installed`` (or ``eager`` when they failed)
        and ``installed_at_s`` says when."""
        _lower_thread_priority()
        torch.set_num_threads(spec.threads)  # the engine's: OpenMP's thread count is per thread, and the key has it
        # Tracing and Inductor's code generation are Python that holds the GIL; an eager step takes
        # the GIL back after every torch op, waiting up to the switch interval each time (5 ms by
        # default). A short interval while compiling bounds that wait.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
        try:
            report = load.load_programs(spec, self.runner.install_program, kernel_cache=self.kernel_cache,
                                        defer=between_steps, progress=self._progress)
        finally:
            sys.setswitchinterval(interval)
        between_steps(lambda: self._record(report, clock))

    def _record(self, report: ProgramsReport, clock: Callable[[], float]) -> None:
        self.installed_at_s = clock()
        self.state = "eager" if report.source == "eager" else "installed"
        self.detail = str(report)
        log.info("compiled programs installed %.1f s after start-up began, between two steps: %s",
                 self.installed_at_s, report, extra={"runner_id": self.runner.config.runner_id})
