"""The `warmserve` dispatcher turns an OSError (here: a busy port) into one line and exit 1, never a
traceback. Per-command exit codes are tested with each package (e.g. tests/kernel_cache/test_kc_cli.py)."""

from __future__ import annotations

import socket

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
