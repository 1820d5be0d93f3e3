"""``warmserve up`` starts the OpenAI-compatible HTTP door with the router: its flags, port and
command line, the busy-port check, and a stack without runners whose door is up (503 on
``/health`` from its own pid), recorded in ``stack.json``, shown by ``warmserve status``,
relaunched when it dies, and stopped with the stack."""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from openai_service.healthcheck import check_http_health
from services.errors import InvalidArgument, Unavailable
from services.ports import DEFAULT_BASE_PORT, DEFAULT_PORTS, OPENAI, ROUTER
from warmserve.cli import build_parser
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig
from warmserve.stack_report import print_status
from warmserve.stack_state import stack_services
from warmserve.up import door_curl, ready_hint


def test_up_starts_the_door_unless_told_not_to_and_the_demo_does_not() -> None:
    parse = build_parser().parse_args
    assert (StackConfig.from_args(parse(["up"])).openai, StackConfig.from_args(parse(["up"])).openai_port) == (True, None)
    assert StackConfig.from_args(parse(["up", "--no-openai"])).openai is False
    assert StackConfig.from_args(parse(["up", "--openai-port", "8123"])).openai_port == 8123
    assert StackConfig.from_args(parse(["demo"])).openai is False
    with pytest.raises(InvalidArgument, match="--openai-port must be in"):
        StackConfig.from_args(parse(["up", "--openai-port", "70000"]))


def test_the_doors_port_and_command_line(tmp_path: Path) -> None:
    assert DEFAULT_BASE_PORT + 3 == DEFAULT_PORTS[OPENAI]  # `warmserve openai serve`'s default is the default stack's door
    stack = LocalStack(StackConfig(base_port=50100, home=tmp_path, openai=True), progress=None)
    assert stack.address(OPENAI) == "127.0.0.1:50103"
    assert stack.commands.service(OPENAI)[1:] == ["-m", "warmserve.cli", "openai", "serve", "--router", "127.0.0.1:50100",
                                               "--host", "127.0.0.1", "--port", "50103",
                                               "--token-file", str(tmp_path / "auth" / "doors.token"),
                                               "--api-key-file", str(tmp_path / "auth" / "openai.key")]
    assert LocalStack(StackConfig(base_port=50100, home=tmp_path, openai=True, openai_port=8123),
                      progress=None).address(OPENAI) == "127.0.0.1:8123"
    free = LocalStack(StackConfig(base_port=50100, home=tmp_path, openai=True, openai_port=0), progress=None)
    assert free.port(OPENAI) not in (0, 50103) and free.port(OPENAI) == free.port(OPENAI)


def test_one_served_model_name_reaches_both_doors(tmp_path: Path) -> None:
    """`up --served-model-name` names the model for the router's KServe door and the OpenAI door."""
    args = build_parser().parse_args(["up", "--served-model-name", "smol", "--base-port", "50100"])
    stack = LocalStack(StackConfig.from_args(args), progress=None)
    for name in (OPENAI, ROUTER):
        argv = stack.commands.service(name)
        assert argv[argv.index("--served-model-name") + 1] == "smol", name
    plain = LocalStack(StackConfig(base_port=50100, home=tmp_path, openai=True), progress=None)
    assert all("--served-model-name" not in plain.commands.service(n) for n in (OPENAI, ROUTER))
    with pytest.raises(InvalidArgument, match="--served-model-name must not be empty"):
        StackConfig(served_model_name=" ")


def test_a_busy_door_port_fails_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path / "h", openai=True, openai_port=port),
                           progress=None)
        with pytest.raises(Unavailable, match=rf"port {port} \(openai: address already in use\)"):
            stack.start()
        assert not stack.services and not (tmp_path / "h").exists()


def test_a_stack_runs_records_shows_heals_and_stops_its_door(tmp_path: Path) -> None:
    lines: list[str] = []
    stack = LocalStack(StackConfig(runners=0, base_port=0, home=tmp_path, openai=True, restart_backoff_s=0.1),
                       progress=lines.append)
    with stack:
        door = stack.services[OPENAI]
        assert "starting kernel-cache, weights, router and openai ..." in lines
        assert door.ready_s is not None and door.argv[3:5] == ["openai", "serve"]
        # no runner: the door is up, and says 503 from its own pid
        assert check_http_health(door.address, pid=door.proc.pid) == "NOT_SERVING"
        assert (tmp_path / "logs" / "openai.log").stat().st_size > 0
        state = json.loads(stack.state_path.read_text())
        assert state["children"][OPENAI] == {"address": door.address, "pid": door.proc.pid, "restarts": 0}
        services = stack_services(tmp_path, stack.router_address)
        assert services[OPENAI] == door.address
        out = io.StringIO()
        assert print_status(stack.router_address, services, out=out, security=stack.credentials()) == 0
        row = next(line for line in out.getvalue().splitlines() if line.startswith("openai"))
        assert f"http://{door.address}/v1" in row and "NOT_SERVING" in row
        hint = ready_hint(stack)
        assert f"OpenAI-compatible API: http://{door.address}/v1" in hint
        # the hint's curl line carries the API key, and not on any command line (ps shows argv)
        url = f"http://{door.address}/v1/models"
        assert f"(e.g. {door_curl(stack)} {url})" in hint
        key = (tmp_path / "auth" / "openai.key").read_text().strip()
        assert key not in hint
        for line, status in ((f"{door_curl(stack)} {url}", "503"), (f"curl {url}", "401")):  # no runner: 503
            done = subprocess.run(["bash", "-c", f"{line} -s -o /dev/null -w '%{{http_code}}'"], capture_output=True,
                                  text=True, timeout=30)
            assert done.stdout == status, (line, done.stdout, done.stderr)

        door.proc.send_signal(signal.SIGKILL)
        door.proc.wait(timeout=10)
        end = time.monotonic() + 60
        while not (door.restarts == 1 and check_http_health(door.address, pid=door.proc.pid) == "NOT_SERVING"):
            assert time.monotonic() < end, "the door was not relaunched"
            assert stack.heal() == []
            time.sleep(0.2)
        assert stack.restarts()[OPENAI] == 1
    assert not door.running
    assert check_http_health(door.address, timeout_s=0.5).startswith("UNREACHABLE")
