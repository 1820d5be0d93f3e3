"""Child-process helpers shared by the local stack, benchmarks and tests that run daemons as
subprocesses.

Daemons log JSON lines (:mod:`services.log`); :func:`wait_for_log_record` waits for the one that
says they are ready, and :func:`stop_process` is the SIGTERM → grace → SIGKILL shutdown.
:func:`die_with_parent` lets a child ask for SIGTERM when its launcher dies.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from pathlib import Path

#: Set by a launcher (:mod:`warmserve.stack`) to its pid in a child's environment.
PARENT_PID_ENV = "WARMSERVE_PARENT_PID"
#: Set by a runner zygote (:mod:`runner_service.zygote`) in a runner it forks: the pid of the
#: process that asked for it, the one its launcher knows (see :func:`serving_pid`).
SERVING_PID_ENV = "WARMSERVE_SERVING_PID"
_PR_SET_PDEATHSIG = 1


def serving_pid() -> int:
    """The pid a server reports as its own to health checks: its launcher's child. That is this
    process, or for a runner forked by a zygote the process that asked for it
    (:data:`SERVING_PID_ENV`)."""
    value = os.environ.get(SERVING_PID_ENV, "")
    return int(value) if value.isdigit() else os.getpid()


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Have the kernel send this process ``sig`` when its launcher dies (``prctl(PR_SET_PDEATHSIG)``,
    Linux; a no-op where unavailable), and send it now if the launcher is already gone. The
    launcher is ``parent``, else the pid its environment names (:data:`PARENT_PID_ENV`; neither:
    nothing to do).

    The child does this itself at start-up instead of the launcher doing it in a ``preexec_fn``:
    a ``preexec_fn`` forces ``fork()``, and a forked copy of a process running gRPC's pollers can
    abort in gRPC's fork handler before it reaches ``exec`` (``Check failed:
    wakeup_fd_->Wakeup().ok()``); without one, ``subprocess`` uses ``vfork``, which runs no fork
    handlers."""
    if parent is None:
        named = os.environ.get(PARENT_PID_ENV)
        if not named:
            return
        parent = int(named)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def wait_for_log_record(proc: subprocess.Popen, log_path: Path, msg: str, timeout_s: float = 60.0) -> dict:
    """Poll ``log_path`` (the child's stderr) until a JSON record with ``"msg": msg`` appears and
    return it. Raises ``RuntimeError`` (with the log) if the child exits first or ``timeout_s``
    seconds pass; non-JSON lines are skipped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}: {Path(log_path).read_text()}")
        for line in Path(log_path).read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("msg") == msg:
                return rec
        time.sleep(0.05)
    raise RuntimeError(f"no {msg!r} log record within {timeout_s:g} s: {Path(log_path).read_text()}")


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> bool:
    """SIGTERM ``proc`` (a graceful drain for warmserve daemons), wait up to ``grace_s`` seconds,
    then SIGKILL. Returns ``True`` if it exited within the grace period (or had already exited)."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False
