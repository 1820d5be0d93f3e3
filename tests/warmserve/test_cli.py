"""The `warmserve` dispatcher turns an OSError (here: a busy port) into one line and exit 1, never a
traceback. Per-command exit codes are tested with each package (e.g. tests/kernel_cache/test_kc_cli.py)."""

from __future__ import annotations

import socket

import pytest

from warmserve.cli import main


def test_busy_port_is_a_failed_operation_exit_1(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["router", "serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"warmserve: error: cannot bind 127.0.0.1:{port}" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "-1", "Hi"], "--seed must be in [0, 2^64), got -1"),
    (["--seed", str(2**64), "Hi"], "--seed must be in [0, 2^64)"),
    (["--max-tokens", str(2**31), "Hi"], "--max-tokens must be > 0 and < 2^31"),
    (["--raw", "\udcff\udcfe"], "the prompt is not valid UTF-8 text"),
])
def test_generate_bad_sampling_values_are_usage_errors_before_dialing(capsys, argv, message) -> None:
    # port 9 (discard) on loopback: nothing listens, so reaching the network would fail differently
    assert main(["generate", "--addr", "127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"warmserve: error: {message}" in err
