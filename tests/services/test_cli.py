"""The `warmserve` dispatcher's error contract: one line on stderr, exit 2 for bad input, 1 for a
failed operation (including OS errors such as a busy port), never a traceback."""

from __future__ import annotations

import socket

from services.cli import main


def test_unknown_fingerprint_is_bad_input_exit_2(tmp_path, capsys) -> None:
    artifact = tmp_path / "prog.so"
    artifact.write_bytes(b"\x7fELF")
    assert main(["cache", "put", "llama.decode", "UNKNOWN", str(artifact), "--root", str(tmp_path / "kc")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("warmserve: error: fingerprint UNKNOWN is never stored") and err.count("\n") == 1
    assert not (tmp_path / "kc" / "entries").exists() or not any((tmp_path / "kc" / "entries").iterdir())


def test_busy_port_is_a_failed_operation_exit_1(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["router", "serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"warmserve: error: cannot bind 127.0.0.1:{port}" in err
