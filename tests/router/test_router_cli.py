"""The router daemon as a process (``warmserve router serve``) and the client commands
(``generate``, ``chat``, ``status``, ``router drain``) against it, with a fake runner."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_runner import FakeRunner

from services.generation_client import GenerationClient, sampling_params
from services.healthcheck import check_health
from services.healthcheck import main as probe_main
from services.ports import free_port
from warmserve import cli
from warmserve.chat import interactive_chat as chat_loop

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def router_process() -> Iterator[tuple[str, FakeRunner, subprocess.Popen]]:
    runner = FakeRunner("fake-0")
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmserve.cli", "router", "serve", "--port", str(port), "--runner", runner.address,
         "--health-interval", "0.1", "--drain-grace", "2"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        end = time.monotonic() + 20
        while check_health(address, timeout_s=0.5) != "SERVING":
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < end
            time.sleep(0.1)
        yield address, runner, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        runner.stop()


def _wait_ready_through(address: str) -> None:
    end = time.monotonic() + 10
    with GenerationClient(address) as client:
        while True:
            try:
                client.model_info(timeout_s=1)
                return
            except Exception:
                assert time.monotonic() < end
                time.sleep(0.1)


def test_router_daemon_serves_cli_commands_and_stops_on_sigterm(router_process, capsys) -> None:
    address, runner, proc = router_process
    _wait_ready_through(address)

    assert cli.main(["generate", "--addr", address, "--raw", "--max-tokens", "5", "hello world"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "hello\n"
    assert "[fake-0] 5 tokens" in captured.err and "finish LENGTH" in captured.err

    assert cli.main(["generate", "--addr", address, "--max-tokens", "3", "chat me"]) == 0
    assert capsys.readouterr().out == "cha\n"  # the fake echoes the chat message's content

    assert cli.main(["status", "--addr", address, "--service", f"fake={runner.address}"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["router", address, "SERVING"] in rows
    assert ["fake", runner.address, "SERVING"] in rows
    # runner, address, state, programs, outstanding, lease, running/waiting, KV blocks, speculative,
    # failures (the programs column is "?": the fake runner's ModelInfo names no program state or
    # compile mode; nor a speculative method: off)
    assert [runner.address, runner.address, "READY", "?", "0", "static", "0/0", "-", "off", "0"] in rows

    assert cli.main(["router", "drain", runner.address, "--addr", address]) == 0
    assert cli.main(["status", "--addr", address]) == 0
    assert "DRAINING" in capsys.readouterr().out
    assert cli.main(["router", "drain", "nobody", "--addr", address]) == 1
    assert "knows no runner 'nobody'" in capsys.readouterr().err

    assert cli.main(["generate", "--addr", address, "--raw", "x"]) == 1
    assert "no runner is ready" in capsys.readouterr().err

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_bad_client_input_exits_2(capsys) -> None:
    assert cli.main(["generate", "--addr", "127.0.0.1:1", "--max-tokens", "0", "x"]) == 2
    assert "--max-tokens must be > 0" in capsys.readouterr().err
    assert cli.main(["status", "--service", "nonsense"]) == 2


def test_interactive_chat_keeps_history() -> None:
    runner = FakeRunner("fake-chat")
    try:
        out = io.StringIO()
        with GenerationClient(runner.address) as client:
            # The fake echoes the concatenated content of all messages, so the second answer
            # starts with the first turn's text: the history was sent.
            rc = chat_loop(client, sampling_params(max_tokens=6), system=None, timeout_s=5,
                           stdin=io.StringIO("abc\n\nxyz\n/exit\nnever\n"), stdout=out)
        assert rc == 0
        assert out.getvalue() == "abc\nabcabc\n"  # turn 1: "abc"; turn 2: "abc" + "abc" + "xyz" cut at 6
        assert runner.stats.requests == 2
    finally:
        runner.stop()


def test_chat_commands_are_never_sent_to_the_model_and_a_terminal_gets_a_banner(capsys) -> None:
    from warmserve.chat import CHAT_COMMANDS, chat_banner

    runner = FakeRunner("fake-chat")
    try:
        out = io.StringIO()
        with GenerationClient(runner.address) as client:
            rc = chat_loop(client, sampling_params(max_tokens=6), system=None, timeout_s=5, banner=True,
                           stdin=io.StringIO("/help\n/nope\nabc\n/reset\nxyz\n/quit\nnever\n"), stdout=out)
        assert rc == 0
        lines = out.getvalue().splitlines()
        assert lines[0] == chat_banner(runner.address) and "/help" in lines[0]
        assert [ln.split()[0] for ln in lines[1:1 + len(CHAT_COMMANDS)]] == list(CHAT_COMMANDS)
        assert lines[1 + len(CHAT_COMMANDS):] == ["(unknown command /nope; /help lists the commands)", "abc",
                                                  "(history cleared)", "xyz"]  # /reset: "abc" forgotten
        assert runner.stats.requests == 2  # abc, xyz: no command reached the model, /quit left
    finally:
        runner.stop()
    from warmserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--help"])
    helptext = capsys.readouterr().out
    assert all(c in helptext for c in CHAT_COMMANDS)


def test_health_probe_exit_codes(capsys) -> None:
    runner = FakeRunner("probe")
    try:
        assert probe_main([runner.address]) == 0
        runner.set_serving(False)
        assert probe_main([runner.address, "--service", "warmserve.v1.Generation"]) == 1
        assert "NOT_SERVING" in capsys.readouterr().out
    finally:
        runner.stop()
    assert probe_main([runner.address, "--timeout", "0.3"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out


def test_chat_says_how_to_go_on_once_the_history_outgrows_the_context() -> None:
    from services.errors import InvalidArgument

    class FullContext:
        """A client whose endpoint refuses any conversation of more than one user turn."""

        def stream_to(self, request, out, timeout_s=None):
            if len(request.chat.messages) > 1:
                raise InvalidArgument("the prompt has 2074 tokens but the context holds 2048")
            out.write("ok")

            class Result:
                text = "ok"
            return Result()

    out = io.StringIO()
    assert chat_loop(FullContext(), sampling_params(), system=None, timeout_s=5, stdin=io.StringIO("a\nb\n"),
                     stdout=out) == 0
    assert out.getvalue().splitlines()[-1] == "(the conversation no longer fits the context: /reset forgets it)"
    out = io.StringIO()  # a single message that does not fit: /reset would not help, so no hint
    assert chat_loop(FullContext(), sampling_params(), system="s", timeout_s=5, stdin=io.StringIO("a\n"),
                     stdout=out) == 0
    assert "/reset" not in out.getvalue()


def test_an_empty_system_message_is_still_sent() -> None:
    """``--system ""`` replaces the template's default system prompt, so it is sent, not dropped."""

    class Recording:
        def __init__(self) -> None:
            self.roles: list[list[str]] = []

        def stream_to(self, request, out, timeout_s=None):
            self.roles.append([m.role for m in request.chat.messages])

            class Result:
                text = "ok"
            return Result()

    client = Recording()
    assert chat_loop(client, sampling_params(), system="", timeout_s=5, stdin=io.StringIO("a\n/reset\nb\n"),
                     stdout=io.StringIO()) == 0
    assert client.roles == [["system", "user"], ["system", "user"]]
