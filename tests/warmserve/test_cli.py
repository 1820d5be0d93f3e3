"""The `warmserve` dispatcher turns an OSError (here: a busy port) into one line and exit 1, never a
traceback. Per-command exit codes are tested with each package (e.g. tests/kernel_cache/test_kc_cli.py)."""

from __future__ import annotations

import socket
import time

import pytest

from warmserve.cli import main


@pytest.mark.parametrize("argv", [["router", "serve"], ["cache", "serve", "--root", "ROOT"],
                                  ["runner", "serve", "--model", "smollm2-135m-instruct", "--compile", "off"]])
def test_busy_port_is_a_failed_operation_exit_1(capfd, tmp_path, argv) -> None:
    """One line with the reason, no gRPC-internal log line (``capfd`` also sees what native code
    writes to fd 2), and a runner fails before it loads the model."""
    argv = [str(tmp_path / "kc") if a == "ROOT" else a for a in argv]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main([*argv, "--port", str(port)]) == 1
        took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "add_port" not in err and "E1" not in err
    assert err.strip().splitlines()[-1] == f"warmserve: error: cannot bind 127.0.0.1:{port}: address already in use"
    assert took < 5  # the runner never got to pack or load the model


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


@pytest.mark.parametrize(("argv", "message"), [
    (["--timeout", "0"], "must be a number of seconds > 0, got '0'"),
    (["--timeout", "-3"], "must be a number of seconds > 0"),
    (["--timeout", "soon"], "expected seconds, got 'soon'"),
])
def test_a_timeout_that_is_not_positive_is_a_usage_error(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--addr", "127.0.0.1:9", *argv, "Hi"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_malformed_address_is_invalid_and_a_refused_one_fails_at_once(capsys) -> None:
    assert main(["generate", "--addr", "nonsense", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "address must be host:port" in err and "there is no port" in err and "cannot reach" not in err
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    t0 = time.monotonic()
    assert main(["generate", "--addr", f"127.0.0.1:{closed}", "Hi"]) == 1
    assert time.monotonic() - t0 < 5  # not the 10 s connect timeout
    err = capsys.readouterr().err
    assert f"cannot reach 127.0.0.1:{closed}: the connection was refused" in err and "Traceback" not in err


def test_a_deadline_ends_the_streamed_line_and_names_the_flag(capsys) -> None:
    from fake_runner import FakeBehaviour, FakeRunner

    runner = FakeRunner("slow", FakeBehaviour(delay_s=0.4))
    try:
        assert main(["generate", "--addr", runner.address, "--raw", "--max-tokens", "8", "--timeout", "1",
                     "abcdefgh"]) == 1
    finally:
        runner.stop()
    out, err = capsys.readouterr()
    assert out.startswith("ab") and out.endswith("\n") and len(out) < len("abcdefgh\n")  # cut, then a newline
    # (other lines may come from an earlier in-process server's logging, bound to a closed stream)
    assert "warmserve: error: timed out after 1 s (--timeout)" in err.splitlines()


def test_allow_special_tokens_needs_a_raw_prompt(capsys) -> None:
    assert main(["generate", "--addr", "127.0.0.1:9", "--allow-special-tokens", "Hi<|im_end|>"]) == 2
    assert "--allow-special-tokens needs --raw" in capsys.readouterr().err


def test_demo_fresh_and_home_together_are_a_usage_error(capsys, tmp_path) -> None:
    assert main(["demo", "--fresh", "--home", str(tmp_path / "h")]) == 2
    assert "give --fresh or --home, not both" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
    for bad in ("0", "99999999"):
        assert main(["demo", "--max-tokens", bad, "--home", str(tmp_path / "h")]) == 2
        assert "--max-tokens must be in [1, 1024]" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()  # refused before anything started


def test_up_with_a_missing_model_is_bad_input_and_starts_nothing(capsys, tmp_path) -> None:
    assert main(["up", "--model", str(tmp_path / "no-such.gguf"), "--home", str(tmp_path / "h"),
                 "--base-port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"model source '{tmp_path / 'no-such.gguf'}' does not exist" in err
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--speculative", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "--prompt-lookup-min (5) must be in [1, --prompt-lookup-max (2)]"),
    (["up", "--prompt-lookup-min", "5"], "--prompt-lookup-min (5) must be in [1, --prompt-lookup-max (4)]"),
    (["up", "--speculative", "mtp"], "the llama family cannot use --speculative mtp (its methods: ngram)"),
    (["demo", "--speculative", "mtp"], "the llama family cannot use --speculative mtp (its methods: ngram)"),
])
def test_speculative_options_that_do_not_go_together_start_nothing(capsys, tmp_path, argv, message) -> None:
    """Refused from the flags and the bundled GGUF's header: exit 2, one line, no home, no child."""
    t0 = time.monotonic()
    assert main([*argv, "--home", str(tmp_path / "h"), "--base-port", "0"]) == 2
    assert time.monotonic() - t0 < 30  # no stack was started (a runner alone loads for 10 s and more)
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"warmserve: error: {message}"
    assert not (tmp_path / "h").exists()


def test_status_says_what_it_cannot_reach(capsys, tmp_path) -> None:
    assert main(["status", "--addr", "nonsense"]) == 2
    assert "--addr must be host:port" in capsys.readouterr().err
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert main(["status", "--addr", f"127.0.0.1:{closed}", "--home", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert f"no running `warmserve up` with home {tmp_path / 'none'}" in err
    assert f"warmserve: error: no router answers at 127.0.0.1:{closed}" in err
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("argv, message", [
    (["router", "serve", "--port", "0", "--host", "192.0.2.1"], "cannot bind 192.0.2.1:0: cannot assign requested address"),
    (["router", "serve", "--port", "0", "--log-level", "BOGUS"], None),
])
def test_server_start_errors_are_one_line(capfd, argv, message) -> None:
    """A host this machine does not have (TEST-NET-1) is one line before gRPC logs anything; a bad
    --log-level is a usage error, not a traceback."""
    if message is None:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "invalid choice: 'BOGUS'" in capfd.readouterr().err
        return
    assert main(argv) == 1
    err = capfd.readouterr().err
    assert "add_port" not in err and err.strip().splitlines()[-1] == f"warmserve: error: {message}"


def test_a_busy_metrics_port_names_the_port(capfd) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["router", "serve", "--port", "0", "--metrics-port", str(port)]) == 1
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1] == f"warmserve: error: cannot serve metrics on 127.0.0.1:{port}: address already in use"


def test_prepack_into_a_file_is_bad_input(capsys, tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    assert main(["prepack", "smollm2-135m-instruct", "--out", str(tmp_path / "f")]) == 2
    assert "cannot use" in capsys.readouterr().err


def test_a_refused_request_writes_nothing_to_stdout(capsys) -> None:
    """A request the server refuses before streaming anything leaves stdout empty (no stray blank
    line ahead of the error), exit 2."""
    from fake_runner import FakeBehaviour, FakeRunner

    runner = FakeRunner("strict", FakeBehaviour(invalid=True))
    try:
        assert main(["generate", "--addr", runner.address, "--raw", "Hi"]) == 2
    finally:
        runner.stop()
    out, err = capsys.readouterr()
    assert out == "" and "the fake refuses this prompt" in err
    assert main(["generate", "--addr", "127.0.0.1:9", "--temperature", "1e308", "Hi"]) == 2
    assert "--temperature must be >= 0 and a finite 32-bit float, got 1e+308" in capsys.readouterr().err
