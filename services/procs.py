"""Child-process helpers shared by benchmarks and tests that run daemons as subprocesses.

Daemons log JSON lines (:mod:`services.log`); :func:`wait_for_log_record` waits for the one that
says they are ready, and :func:`stop_process` is the SIGTERM → grace → SIGKILL shutdown.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path


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
