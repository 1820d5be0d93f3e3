"""The runner zygote (:mod:`runner_service.zygote`) as real processes on a tiny HF checkpoint: a
runner launched through it serves like one started directly (health answers with the launching
process's pid), signals reach it, its exit status comes back as the launcher's own (a clean
drain 0, a refused flag 2, a kill re-raised), the runner dies with its launcher, and launches
the zygote must not run are refused with a sentence."""

from __future__ import annotations

import array
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from test_runner_cli import _serve_cmd, _serving
from weights_tiny import write_tiny_checkpoint

from runner_service import zygote
from services.healthcheck import check_health
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "ckpt"
    write_tiny_checkpoint(path, tokenizer=True, vocab=96)
    return path


@pytest.fixture(scope="module")
def zygote_proc(tmp_path_factory):
    """A ``warmserve runner zygote`` for the module; yields ``(socket path, process)``."""
    path = tmp_path_factory.mktemp("zsock") / "z.sock"
    log = open(path.parent / "zygote.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "warmserve.cli", "runner", "zygote", "--socket", str(path)],
                            stdout=log, stderr=log)
    try:
        zygote.connect(path, timeout_s=120).close()
        yield path, proc
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        log.close()
        assert not path.exists()  # the socket goes with the zygote


@pytest.fixture
def zygote_socket(zygote_proc):
    path, proc = zygote_proc
    yield path
    assert proc.poll() is None, "the zygote died"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie the zygote has not reaped yet counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _runner_pid(raw: list[str]) -> int:
    """The forked runner's pid, from its own log records (``pid`` of the JSON lines)."""
    import json

    for line in raw:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "pid" in rec:
            return int(rec["pid"])
    raise AssertionError(f"no pid in the runner's log: {raw[-3:]}")


def test_a_runner_launched_through_the_zygote_serves_and_drains(tiny_ckpt, tmp_path, zygote_socket):
    cmd = _serve_cmd(tiny_ckpt, tmp_path / "sidecars", "--runner-id", "z-runner", "--zygote", str(zygote_socket))
    with _serving(cmd) as (proc, raw, address):
        runner = _runner_pid(raw)
        assert runner != proc.pid and _alive(runner)
        # health answers from the launcher's child, by its pid: a launcher's "is it mine" check holds
        assert check_health(address, timeout_s=5, pid=proc.pid) == "SERVING"
        assert check_health(address, timeout_s=5, pid=runner).startswith("FOREIGN")
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            msgs = list(stub.Generate(pb.GenerateRequest(
                text="w5 w6 w7", sampling=pb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))))
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 5
            assert stub.ModelInfo(pb.ModelInfoRequest()).runner_id == "z-runner"
        proc.send_signal(signal.SIGTERM)  # passed on: the runner drains and exits 0, and so does its launcher
        assert proc.wait(timeout=60) == 0
    assert not _alive(runner)


def test_killing_the_launcher_kills_the_runner_and_a_kill_comes_back_as_one(tiny_ckpt, tmp_path, zygote_socket):
    cmd = _serve_cmd(tiny_ckpt, tmp_path / "sidecars", "--zygote", str(zygote_socket))
    with _serving(cmd) as (proc, raw, _address):
        runner = _runner_pid(raw)
        proc.kill()  # SIGKILL cannot be passed on: the zygote sees its client gone and kills the runner
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(runner) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(runner)
    with _serving(cmd) as (proc, raw, _address):
        runner = _runner_pid(raw)
        os.kill(runner, signal.SIGKILL)  # the runner dies of a signal: its launcher dies of the same one
        assert proc.wait(timeout=30) == -signal.SIGKILL


def test_exit_codes_and_messages_match_a_direct_runner(tiny_ckpt, tmp_path, zygote_socket):
    bad = ["--max-model-len", "100000"]  # refused once the checkpoint's config is read: exit 2
    direct = subprocess.run(_serve_cmd(tiny_ckpt, tmp_path / "s1", *bad), capture_output=True, text=True, timeout=120)
    through = subprocess.run(_serve_cmd(tiny_ckpt, tmp_path / "s2", *bad, "--zygote", str(zygote_socket)),
                             capture_output=True, text=True, timeout=120)
    assert direct.returncode == through.returncode == 2
    assert "max_position_embeddings" in direct.stderr and "max_position_embeddings" in through.stderr


def test_a_launch_with_another_import_time_environment_is_refused(tiny_ckpt, tmp_path, zygote_socket):
    env = dict(os.environ, OMP_NUM_THREADS="7")
    out = subprocess.run(_serve_cmd(tiny_ckpt, tmp_path / "s", "--zygote", str(zygote_socket)), env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "refused the launch" in out.stderr and "OMP_NUM_THREADS" in out.stderr


@pytest.mark.parametrize("request_, message", [
    ({"argv": ["cache", "ls"]}, "launches `runner serve` only"),
    ({"argv": ["runner", "serve", "--zygote", "x"]}, "without --zygote"),
    ({"argv": "runner serve"}, "argv, a list of strings"),
    ({"argv": ["runner", "serve"], "python": "/usr/bin/python3"}, "this zygote runs"),
])
def test_the_zygote_refuses_what_it_must_not_run(zygote_socket, request_, message):
    good = {"env": dict(os.environ), "cwd": os.getcwd(), "python": sys.executable, "code": zygote._CODE_DIR}
    with zygote.connect(zygote_socket, timeout_s=5) as sock:
        zygote.send_message(sock, {**good, **request_}, fds=[0, 1, 2])
        reply, _ = zygote.receive_message(sock)
    assert message in reply["error"]


def test_a_launch_without_its_streams_or_with_garbage_is_refused_and_the_zygote_keeps_serving(zygote_socket):
    with zygote.connect(zygote_socket, timeout_s=5) as sock:
        zygote.send_message(sock, {"argv": ["runner", "serve"], "env": dict(os.environ), "cwd": os.getcwd(),
                                   "python": sys.executable, "code": zygote._CODE_DIR})
        reply, _ = zygote.receive_message(sock)
    assert "stdin, stdout and stderr" in reply["error"]
    with zygote.connect(zygote_socket, timeout_s=5) as sock:
        sock.sendall(b"\xff\xff\xff\xff")  # a length over the limit
        reply, _ = zygote.receive_message(sock)
    assert "bytes" in reply["error"]
    with zygote.connect(zygote_socket, timeout_s=5) as sock:
        sock.sendall(b"\x00\x00\x00\x02[]")
        reply, _ = zygote.receive_message(sock)
    assert "JSON object" in reply["error"]


def test_no_zygote_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="no runner zygote answers"):
        zygote.connect(tmp_path / "none.sock", timeout_s=0.2)


def test_without_zygote_flag():
    assert zygote.without_zygote_flag(["runner", "serve", "--zygote", "a", "--model", "m", "--zygote=b"]) == [
        "runner", "serve", "--model", "m"]


def test_a_second_zygote_on_a_served_socket_refuses(zygote_socket):
    server = zygote.ZygoteServer(zygote_socket)
    with pytest.raises(Exception, match="another runner zygote serves"):
        server.bind()
    with socket.socket(socket.AF_UNIX) as s:  # still served
        s.connect(str(zygote_socket))


def _request(**over) -> dict:
    return {"argv": ["runner", "serve", "--model", "m"], "env": dict(os.environ), "cwd": os.getcwd(),
            "python": sys.executable, "code": zygote._CODE_DIR, **over}


def _refusal(path, payload: bytes = b"", message: dict | None = None, fds=None) -> str:
    with zygote.connect(path, timeout_s=5) as sock:
        if message is not None:
            zygote.send_message(sock, message, fds=fds)
        else:
            sock.sendall(payload)
        reply, _ = zygote.receive_message(sock)
    return reply["error"]


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settled_fds(pid: int, timeout_s: float = 5.0) -> int:
    """``pid``'s open fds once the count holds still for 0.2 s (a connection the zygote accepted,
    such as the fixture's readiness probe, is closed a moment after its client closes it)."""
    deadline = time.monotonic() + timeout_s
    n = _open_fds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if (m := _open_fds(pid)) == n:
            break
        n = m
    return n


def test_hostile_requests_are_refused_without_leaking_and_the_zygote_lives_on(zygote_proc):
    path, proc = zygote_proc
    before = _settled_fds(proc.pid)
    nested = b"[" * 200_000
    assert "not JSON" in _refusal(path, len(nested).to_bytes(4, "big") + nested)  # RecursionError in json
    for _ in range(5):  # refused with three fds attached each time: none of them may stay open in the zygote
        with zygote.connect(path, timeout_s=5) as sock:
            sock.sendmsg([b"\xff\xff\xff\xff"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
            assert "bytes" in zygote.receive_message(sock)[0]["error"]
    assert "JSON object" in _refusal(path, message=None, payload=b"\x00\x00\x00\x02[]")
    deadline = time.monotonic() + 5  # the last refused connection is closed right after its answer
    while _open_fds(proc.pid) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_fds(proc.pid) == before
    # --zygote abbreviated as argparse would accept it: never a launch from a launch
    for argv in (["runner", "serve", "--model", "m", "--zyg", "x"], ["runner", "serve", "--model", "m", "--z=x"],
                 ["runner", "serve", "--zygote", "x"]):
        assert "without --zygote" in _refusal(path, message=_request(argv=argv), fds=[0, 1, 2])


def test_a_client_gone_before_its_pid_or_a_slow_one_does_not_stop_the_zygote(zygote_proc):
    path, proc = zygote_proc
    with zygote.connect(path, timeout_s=5) as sock:  # a launch that will fail, abandoned at once
        zygote.send_message(sock, _request(argv=["runner", "serve", "--no-such-flag"]), fds=[0, 1, 2])
    slow = zygote.connect(path, timeout_s=5)
    slow.sendall(b"\x00\x00")  # half a header, then nothing
    start = time.monotonic()
    assert "launches `runner serve` only" in _refusal(path, message=_request(argv=["cache", "ls"]), fds=[0, 1, 2])
    assert time.monotonic() - start < zygote.REQUEST_TIMEOUT_S + 3  # the slow client got its deadline, no more
    assert "not complete within" in zygote.receive_message(slow)[0]["error"]
    slow.close()
    assert proc.poll() is None


def test_bind_refuses_a_shared_directory_and_a_file_in_the_way(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(Exception, match="open to other users"):
        zygote.ZygoteServer(shared / "z.sock").bind()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "z.sock").write_text("not a socket")
    with pytest.raises(Exception, match="not a socket"):
        zygote.ZygoteServer(private / "z.sock").bind()
    assert (private / "z.sock").read_text() == "not a socket"
