"""die_with_parent: a child launched with WARMSERVE_PARENT_PID stops when its launcher dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD = "from services.procs import die_with_parent; die_with_parent(); import time; time.sleep(120)"


def _gone(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_child_gets_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, WARMSERVE_PARENT_PID=str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env, cwd={str(REPO)!r},
                                 start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO)
    try:
        end = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < end, "the launcher did not start its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(1.0)  # the child has run die_with_parent by now (imports take well under 1 s)
        assert not _gone(child, 0.1)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(child, 10), "the child outlived its killed launcher"
    finally:
        parent.kill()


def test_child_whose_launcher_is_already_gone_stops_at_once() -> None:
    env = dict(os.environ, WARMSERVE_PARENT_PID="1")  # pid 1 is never our parent here
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=REPO, timeout=30)
    assert proc.returncode == -signal.SIGTERM


def test_without_the_variable_nothing_happens() -> None:
    env = {k: v for k, v in os.environ.items() if k != "WARMSERVE_PARENT_PID"}
    code = "from services.procs import die_with_parent; die_with_parent(); print('alive')"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, timeout=30, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "alive"
