"""``warmserve openai serve`` as a process: bad flags exit 2 with a message, a busy port exits 1
with one sentence, and a door started from the command line serves the in-process stack
(tests/openai/conftest.py) under the name it was given, then stops on SIGTERM."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from services.procs import stop_process, wait_for_log_record

REPO = Path(__file__).resolve().parents[2]


def serve(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmserve.cli", "openai", "serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
    (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--router", "localhost"], "--router must be host:port (e.g. 127.0.0.1:50051 or [::1]:50051), got 'localhost'"),
    (["--port", "70000"], "--port must be in [0, 65535] (0: a free port), got 70000"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
])
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str) -> None:
    done = serve(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_busy_port_exits_1_with_one_sentence() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = serve("--port", str(port))
    assert done.returncode == 1
    assert done.stderr.strip() == f"warmserve: error: cannot bind 127.0.0.1:{port}: address already in use"


def test_serve_from_the_command_line_until_sigterm(door, tmp_path: Path) -> None:
    log = tmp_path / "openai.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "warmserve.cli", "openai", "serve", "--router", door.router,
                                 "--port", "0", "--served-model-name", "my-model"], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        ready = wait_for_log_record(proc, log, "ready", timeout_s=60)
        assert ready["service"] == "openai" and ready["router"] == door.router
        assert ready["url"] == f"http://{ready['address']}/v1" and ready["address"].startswith("127.0.0.1:")
        with openai.OpenAI(base_url=ready["url"], api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["my-model"]
            for name in ("my-model", door.model_source):
                got = client.completions.create(model=name, prompt="w5 w6 w7", max_tokens=3, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert got.model == "my-model" and got.usage.completion_tokens == 3
            with pytest.raises(openai.NotFoundError):  # the source's default name is not this door's
                client.completions.create(model="tiny-llama", prompt="w5", max_tokens=1)
    finally:
        assert stop_process(proc, grace_s=15)
    assert proc.returncode in (0, -15)
