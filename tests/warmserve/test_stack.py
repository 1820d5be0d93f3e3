"""LocalStack process management without a model: config validation, command lines, start-up
order and health waits, a child that dies while starting, and a clean stop."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from services.errors import InvalidArgument, Unavailable
from services.healthcheck import check_health
from services.proto import generation_pb2
from warmserve.stack import ChildProcess, LocalStack
from warmserve.stack_config import StackConfig, zygote_socket
from warmserve.stack_report import format_startup_report
from warmserve.stack_state import read_state, stack_services
from warmserve.up import ready_hint


def test_config_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="--runners"):
        StackConfig(runners=-1)
    with pytest.raises(InvalidArgument, match="--base-port"):
        StackConfig(base_port=80)
    with pytest.raises(InvalidArgument, match="compile"):
        StackConfig(compile="fast")
    with pytest.raises(InvalidArgument, match="--max-num-seqs"):
        StackConfig(max_num_seqs=0)


def test_ports_and_runner_command_line(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=2, base_port=50100, home=tmp_path, compile="off", max_num_seqs=8,
                                   runner_threads=3), progress=None)
    assert [stack.address(n) for n in ("router", "kernel-cache", "weights", "runner-0", "runner-1")] == [
        "127.0.0.1:50100", "127.0.0.1:50101", "127.0.0.1:50102", "127.0.0.1:50111", "127.0.0.1:50112"]
    argv = stack.runner_argv(1)
    assert argv[1:5] == ["-m", "warmserve.cli", "runner", "serve"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert flags == {
        "--model": "smollm2-135m-instruct", "--runner-id": "runner-1", "--host": "127.0.0.1", "--port": "50112",
        "--drain-grace": "5", "--weights": "127.0.0.1:50102", "--kernel-cache": "127.0.0.1:50101",
        "--router": "127.0.0.1:50100", "--sidecar-dir": str(tmp_path / "sidecars"), "--compile": "off",
        "--max-num-seqs": "8", "--threads": "3", "--auth-file": str(tmp_path / "auth" / "auth"),
        "--token-file": str(tmp_path / "auth" / "runner-1.token"), "--zygote": str(zygote_socket(tmp_path))}
    assert "--zygote" not in LocalStack(StackConfig(runners=1, base_port=0, home=tmp_path, runner_zygote=False),
                                        progress=None).runner_argv(0)
    assert stack.commands.zygote()[3:] == ["runner", "zygote", "--socket", str(zygote_socket(tmp_path))]


def test_the_zygote_socket_stays_within_a_socket_path(tmp_path: Path) -> None:
    assert zygote_socket(tmp_path) == tmp_path / "run" / "runner-zygote.sock"
    deep = tmp_path / ("d" * 120)
    short = zygote_socket(deep)
    assert len(os.fsencode(short)) <= 107 and short != zygote_socket(tmp_path / ("e" * 120))


def test_a_stack_started_without_runners_starts_its_zygote_with_the_first_runner(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path), progress=None)
    try:
        stack.start()
        assert stack.zygote is None
        stack._ensure_zygote()
        assert stack.zygote is not None and stack.zygote.running
        from runner_service.zygote import connect

        connect(zygote_socket(tmp_path), timeout_s=120).close()
    finally:
        stack.stop()
    assert not stack.zygote.running


def test_no_prefix_caching_reaches_every_runner(tmp_path: Path) -> None:
    from warmserve.cli import build_parser

    for argv, flagged in ((["up"], False), (["up", "--no-prefix-caching"], True)):
        config = StackConfig.from_args(build_parser().parse_args(argv))
        assert config.prefix_caching is not flagged
        stack = LocalStack(StackConfig(runners=2, base_port=0, home=tmp_path, prefix_caching=config.prefix_caching),
                           progress=None)
        assert [("--no-prefix-caching" in stack.runner_argv(i)) for i in range(2)] == [flagged, flagged]


def test_runner_threads_default_splits_the_cores_between_runners(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for runners, threads in ((1, "8"), (2, "4"), (3, "2"), (16, "1")):
        stack = LocalStack(StackConfig(runners=runners, base_port=0, home=tmp_path), progress=None)
        argv = stack.runner_argv(0)
        assert argv[argv.index("--threads") + 1] == threads


def test_startup_report_formatting() -> None:
    info = generation_pb2.ModelInfoResponse(
        runner_id="runner-0", model="smollm2-135m-instruct", family="llama", dtype="bf16", device="cpu",
        weights_dtype="int4", compile_mode="off", num_kv_blocks=100, block_size=16,
        startup=generation_pb2.StartupReport(total_seconds=3.5, phases=[
            generation_pb2.StartupPhase(name="weights", seconds=1.25, detail="sidecar HOT 100% resident"),
            generation_pb2.StartupPhase(name="kv_cache", seconds=0.5, detail="100 blocks")]))
    assert format_startup_report(info).splitlines() == [
        "start-up report of runner-0: 3.50 s total",
        "  model smollm2-135m-instruct (llama, int4 weights, bf16 compute, cpu, compile off, 100 KV blocks x 16 tokens)",
        "  weights      1.25 s  sidecar HOT 100% resident",
        "  kv_cache     0.50 s  100 blocks",
    ]
    info.compile_mode = "aoti"
    info.program_state, info.program_detail = "pending", "waiting for runner-1 to build llama.decode.aoti"
    assert format_startup_report(info).splitlines()[-1] == (
        "  serving eager at 3.5 s; compiled programs pending: waiting for runner-1 to build llama.decode.aoti")
    info.program_state, info.programs_installed_at_s = "installed", 131.04
    info.program_detail = "fetched llama.decode.aoti from runner-1's publish after waiting 120.2 s (3.6 MiB)"
    assert format_startup_report(info).splitlines()[-1] == (
        "  serving eager at 3.5 s; compiled programs installed at 131.0 s (fetched llama.decode.aoti from "
        "runner-1's publish after waiting 120.2 s (3.6 MiB))")


def test_stack_state_file_gives_status_its_restarts(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=1, base_port=50100, home=tmp_path, compile="off"), progress=None)
    stack.write_state()
    assert read_state(tmp_path, "127.0.0.1:50100") == {}  # no child launched yet: nothing to report
    doc = json.loads(stack.state_path.read_text())
    assert doc["router"] == "127.0.0.1:50100" and doc["pid"] == os.getpid()
    doc["children"] = {"router": {"restarts": 2}, "runner-0": {"restarts": 0},
                       "weights": {"restarts": 1, "address": "127.0.0.1:50102"}}
    stack.state_path.write_text(json.dumps(doc))
    assert read_state(tmp_path, "127.0.0.1:50100") == {"router": 2, "runner-0": 0, "weights": 1}
    assert stack_services(tmp_path, "127.0.0.1:50100") == {"weights": "127.0.0.1:50102"}
    assert read_state(tmp_path, "127.0.0.1:60000") == {}  # another stack's router
    doc["pid"] = 2 ** 22 + 17  # no such process: a stack that is gone
    stack.state_path.write_text(json.dumps(doc))
    assert read_state(tmp_path, "127.0.0.1:50100") == {}
    stack.stop()
    assert not stack.state_path.exists()


def test_services_start_in_order_and_stop_cleanly(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path), progress=None)
    with stack:
        endpoints = stack.endpoints()
        assert set(endpoints) == {"kernel-cache", "weights", "router"}
        for addr in endpoints.values():
            assert check_health(addr) == "SERVING"
        assert all(c.ready_s is not None and c.ready_s > 0 for c in stack.services.values())
        assert (tmp_path / "logs" / "router.log").stat().st_size > 0
    assert all(c.proc.returncode is not None for c in stack.services.values())
    for addr in endpoints.values():
        assert check_health(addr, timeout_s=0.3).startswith("UNREACHABLE")


def test_a_child_that_dies_while_starting_is_reported_and_the_rest_stopped(tmp_path: Path) -> None:
    (tmp_path / "kernel-cache").write_text("")  # the kernel cache's root is a file: it exits 2 (bad input)
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path), progress=None)
    with pytest.raises(InvalidArgument, match=r"kernel-cache exited with status 2 while starting; its log .* ends:"):
        stack.start()
    assert len(stack.services) == 3 and all(not c.running for c in stack.services.values())


def test_a_second_stack_on_busy_ports_fails_before_anything_starts(tmp_path: Path) -> None:
    """Issue 11 item 1: a stack whose ports another stack holds is one clear error before any child
    starts (not a false "ready" from the other stack's health answers), and its home stays empty."""
    first = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path / "a"), progress=None)
    with first:
        base = first.port("router")  # the second stack's router port is the first one's
        lines: list[str] = []
        second = LocalStack(StackConfig(runners=1, base_port=base, home=tmp_path / "b"), progress=lines.append)
        with pytest.raises(Unavailable, match=rf"port {base} \(router: address already in use\).*--base-port 0"):
            second.start()
        assert not second.services and not second.runners and not lines
        assert not (tmp_path / "b").exists()
        for addr in first.endpoints().values():
            assert check_health(addr) == "SERVING"  # the first stack is untouched


def test_a_port_answered_by_another_process_is_never_taken_for_our_child(tmp_path: Path) -> None:
    """The health check proves it reached our child: a port answered by some other server (here the
    first stack's router, for a child that never binds) is an error naming that process."""
    first = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path / "a"), progress=None)
    with first:
        stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path / "b"), progress=None)
        impostor = ChildProcess("router", [sys.executable, "-c", "import time; time.sleep(60)"],
                                first.router_address, tmp_path / "router.log")
        stack.services["router"] = stack._launch(impostor)
        try:
            router_pid = first.services["router"].proc.pid
            with pytest.raises(Unavailable, match=rf"answered by another process \(pid {router_pid}\)"):
                stack._wait_serving([impostor])
        finally:
            stack.stop()
        assert check_health(first.router_address, pid=router_pid) == "SERVING"
        assert check_health(first.router_address, pid=impostor.proc.pid) == f"FOREIGN: pid {router_pid}"


def test_a_missing_model_is_bad_input_before_anything_starts(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=1, base_port=0, home=tmp_path / "h", model=str(tmp_path / "nope.gguf")),
                       progress=None)
    with pytest.raises(InvalidArgument, match=r"nope.gguf' does not exist"):
        stack.start()
    assert not stack.services and not (tmp_path / "h").exists()


def test_the_ready_hint_works_with_and_without_runners(tmp_path: Path) -> None:
    none = LocalStack(StackConfig(runners=0, base_port=50100, home=tmp_path), progress=None)
    assert "no runners" in ready_hint(none) and "warmserve generate" not in ready_hint(none)
    assert (f"warmserve runner serve --model smollm2-135m-instruct --router 127.0.0.1:50100 --weights "
            f"127.0.0.1:50102 --kernel-cache 127.0.0.1:50101 --sidecar-dir {tmp_path / 'sidecars'} --port 0"
            ) in ready_hint(none)
    two = LocalStack(StackConfig(runners=2, base_port=50100, home=tmp_path), progress=None)
    two.runners = [None, None]  # as after start()
    assert ready_hint(two).startswith('ready: warmserve generate --addr 127.0.0.1:50100 "Hello!"')


def test_heal_relaunches_with_doubling_backoff_and_gives_up_past_the_cap(tmp_path: Path) -> None:
    lines: list[str] = []
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path, restart_backoff_s=0.1,
                                   max_restart_backoff_s=0.3, max_restarts_per_minute=3), progress=lines.append)
    child = ChildProcess("weights", [sys.executable, "-c", "import sys; sys.exit(3)"], "127.0.0.1:1",
                         tmp_path / "weights.log")
    stack.services["weights"] = stack._launch(child)
    end = time.monotonic() + 20
    given_up = []
    while not given_up:
        assert time.monotonic() < end, lines
        given_up = stack.heal()
        time.sleep(0.01)
    assert given_up == [child] and child.restarts == 3 and stack.restarts() == {"weights": 3}
    exits = [m for m in lines if "exited (status 3)" in m]
    # 0.1 s doubled per restart in the last minute, capped at 0.3 s
    assert [m.split("restarting in ")[1].split(" s")[0] for m in exits] == ["0.1", "0.2", "0.3"]
    assert len([m for m in lines if "restarted (pid" in m]) == 3
    gaps = [b - a for a, b in zip(child.restart_times, child.restart_times[1:], strict=False)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.3, gaps  # each relaunch waited out its backoff
    assert stack.heal() == [child] and child.restarts == 3  # stays given up


def test_a_long_start_says_what_the_child_is_doing(tmp_path: Path, monkeypatch) -> None:
    """Issue 11 item 3: each "still starting" line names the child's latest logged phase and the
    time elapsed, instead of repeating the same words."""
    import warmserve.stack as stack_module

    monkeypatch.setattr(stack_module, "NOTE_INTERVAL_S", 0.3)
    lines: list[str] = []
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path, startup_timeout_s=2.0),
                       progress=lines.append)
    script = ("import json, time\n"
              "print(json.dumps({'msg': 'preparing the weight sidecar locally'}), flush=True)\n"
              "time.sleep(0.8)\n"
              "print(json.dumps({'msg': 'loading the model from the sidecar'}), flush=True)\n"
              "time.sleep(30)\n")
    child = ChildProcess("runner-0", [sys.executable, "-c", script], "127.0.0.1:1", tmp_path / "runner-0.log")
    stack.runners = [stack._launch(child)]
    try:
        with pytest.raises(Unavailable, match="runner-0 not SERVING after 2 s"):
            stack._wait_serving([child])
    finally:
        stack.stop()
    notes = [m for m in lines if "still starting" in m]
    assert any(m.endswith("now preparing the weight sidecar locally") for m in notes), notes
    assert notes[-1].endswith("now loading the model from the sidecar"), notes
    elapsed = [float(m.split("still starting (")[1].split(" s)")[0]) for m in notes]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= 1


def test_a_home_that_cannot_be_one_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path / "file"), progress=None)
    with pytest.raises(InvalidArgument, match="is not a directory"):
        stack.start()
    under_a_file = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path / "file" / "home"), progress=None)
    with pytest.raises(InvalidArgument, match=r"cannot create the home .*file/home"):
        under_a_file.start()
    assert not stack.services and not under_a_file.services


def test_free_ports_are_never_given_twice_in_one_stack(tmp_path, monkeypatch):
    """The kernel hands a just-freed port out again: two services told the same port would have
    one answer the other's health check (a flake seen in CI)."""
    import services.ports as ports_module

    handed = iter([41000, 41000, 41000, 41001, 41001, 41002])
    monkeypatch.setattr(ports_module, "free_port", lambda host: next(handed))
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path, openai=True), progress=None)
    ports = [stack.port(name) for name in ("kernel-cache", "weights", "router")]
    assert ports == [41000, 41001, 41002]
