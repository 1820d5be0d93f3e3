"""A default `warmserve up`-style stack checks tokens (issue 23): publish, evict, register and
drain without one are UNAUTHENTICATED; a runner registering under a live id with another
credential is refused and never receives a request; with the tokens of HOME/auth everything works,
and `warmserve generate` finds the client token by itself."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
from fake_runner import FakeRunner

from kernel_cache_service.client import KernelCacheClient
from router_service.client import drain_runner, list_runners
from runner_service.registration import RunnerRegistration
from services.auth import AuthTable
from services.bootstrap import ServerConfig
from services.channel import open_channel
from services.errors import Unauthenticated
from services.ports import KERNEL_CACHE
from services.proto import router_pb2, router_pb2_grpc
from warmserve.cli import main
from warmserve.stack import LocalStack
from warmserve.stack_auth import stack_identities, stack_security
from warmserve.stack_config import StackConfig


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack-auth")
    with LocalStack(StackConfig(runners=0, base_port=0, home=home), progress=None) as s:
        yield s


def _runner(stack: LocalStack, runner_id: str) -> FakeRunner:
    table = AuthTable.load(stack.home / "auth" / "auth")  # the stack's own table: only its router may call
    return FakeRunner(runner_id, server_config=ServerConfig(service=runner_id, port=0, auth=table))


def _register(stack: LocalStack, runner_id: str, runner: FakeRunner, identity: str) -> RunnerRegistration:
    reg = RunnerRegistration(stack.router_address, runner_id=runner_id, address=runner.address, model="fake",
                             max_num_seqs=4, load_fn=dict, lease_seconds=3.0, retry_s=0.1,
                             security=stack.credentials(identity))
    reg.start()
    return reg


def test_tokens_are_made_private_and_every_daemon_checks_them(stack: LocalStack) -> None:
    d = stack.home / "auth"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {p.name for p in d.iterdir()} >= {"auth", "openai.key", *(f"{n}.token" for n in stack_identities(0))}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in d.iterdir())
    assert all("--auth-file" in c.argv for c in stack.services.values())


def test_publish_evict_register_and_drain_without_a_token_are_refused(stack: LocalStack, tmp_path: Path) -> None:
    blob = tmp_path / "p.bin"
    blob.write_bytes(b"\x7fELF" + bytes(4092))
    with KernelCacheClient(stack.address(KERNEL_CACHE)) as cache:
        with pytest.raises(Unauthenticated):
            cache.publish("llama.decode.aoti", "f" * 16, blob)
        with pytest.raises(Unauthenticated):
            cache.evict(all=True)
    with open_channel(stack.router_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            router_pb2_grpc.RouterControlStub(ch).RegisterRunner(router_pb2.RegisterRunnerRequest(
                runner_id="runner-0", address="127.0.0.1:9"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Unauthenticated):
        drain_runner(stack.router_address, "runner-0")
    with KernelCacheClient(stack.address(KERNEL_CACHE), security=stack.credentials("runner-0")) as cache:
        cache.publish("llama.decode.aoti", "f" * 16, blob)  # a runner's own token may publish
    with KernelCacheClient(stack.address(KERNEL_CACHE), security=stack.credentials("admin")) as cache:
        assert cache.evict(all=True)[0] == 1


def test_an_impostor_under_a_live_id_is_refused_and_the_client_token_is_found(stack: LocalStack, monkeypatch,
                                                                               capsys) -> None:
    real, impostor = _runner(stack, "runner-0"), _runner(stack, "runner-0")
    regs = [_register(stack, "runner-0", real, "runner-0")]
    try:
        assert regs[0].registered.wait(10)
        with open_channel(stack.router_address, security=stack.credentials("runner-1")) as ch:
            with pytest.raises(grpc.RpcError) as e:
                router_pb2_grpc.RouterControlStub(ch).RegisterRunner(router_pb2.RegisterRunnerRequest(
                    runner_id="runner-0", address=impostor.address, model="fake"), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        monkeypatch.setenv("WARMSERVE_HOME", str(stack.home))
        monkeypatch.delenv("WARMSERVE_TOKEN", raising=False)
        for _ in range(3):
            assert main(["generate", "--addr", stack.router_address, "--raw", "hey"]) == 0
        assert "hey" in capsys.readouterr().out
        assert real.stats.requests == 3 and impostor.stats.requests == 0
        assert [r.address for r in list_runners(stack.router_address, security=stack.credentials())] == [real.address]
        assert main(["router", "drain", "runner-0", "--addr", stack.router_address,
                     "--token-file", str(stack.home / "auth" / "admin.token")]) == 0
        assert main(["router", "drain", "runner-0", "--addr", stack.router_address]) == 1  # no token
    finally:
        for reg in regs:
            reg.stop(drain=False)
        real.stop()
        impostor.stop()


def test_a_stack_with_auth_off_starts_its_daemons_without_the_flags(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=1, base_port=0, home=tmp_path, auth=False), progress=None)
    assert "--auth-file" not in stack.runner_argv(0) and "--token-file" not in stack.runner_argv(0)
    assert stack_security(tmp_path).token is None  # nothing made before start


def _plant(home: Path, owner: int | None) -> None:
    """What another user with umask 0 leaves for the victim's `up --home HOME`: world-writable
    directories and a world-readable admin token and API key whose values they know."""
    (home / "auth").mkdir(parents=True)
    for name in ("admin.token", "openai.key"):
        (home / "auth" / name).write_text("wst_known_to_the_attacker\n")
    for p in (home / "auth" / "admin.token", home / "auth" / "openai.key", home / "auth", home):
        p.chmod(0o666 if p.is_file() else 0o777)
        if owner is not None:
            os.chown(p, owner, owner)


@pytest.mark.parametrize("owner", [None, pytest.param(65534, marks=pytest.mark.skipif(
    os.geteuid() != 0, reason="giving files to another uid needs root"))])
def test_up_refuses_a_home_with_planted_credentials_and_starts_nothing(tmp_path: Path, monkeypatch, capsys,
                                                                       owner: int | None) -> None:
    home = tmp_path / "host-a"
    _plant(home, owner)
    launched = []
    monkeypatch.setattr(LocalStack, "_launch", lambda self, child: launched.append(child) or pytest.fail("launched"))
    argv = ["up", "--home", str(home), "--base-port", "0", "--runners", "0", "--no-openai"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    problem = f"owned by uid {owner}" if owner is not None else "writable by group or others (mode 0777)"
    assert f"refusing the home {home}: it is {problem}" in err
    home.chmod(0o700)
    if owner is not None:
        os.chown(home, os.geteuid(), os.getegid())
    assert main(argv) == 2
    problem = f"owned by uid {owner}" if owner is not None else "writable by group or others (mode 0777)"
    assert f"refusing the credentials directory {home / 'auth'}: it is {problem}" in capsys.readouterr().err
    (home / "auth").chmod(0o700)
    if owner is not None:
        os.chown(home / "auth", os.geteuid(), os.getegid())
    assert main(argv) == 2
    assert f"refusing the token file {home / 'auth' / 'admin.token'}: " in capsys.readouterr().err
    (home / "auth" / "admin.token").unlink()
    assert main(argv) == 2
    assert f"refusing the OpenAI door's API key file {home / 'auth' / 'openai.key'}: " in capsys.readouterr().err
    assert launched == [] and (home / "auth" / "admin.token").read_text() != "wst_known_to_the_attacker\n"


def test_up_tls_refuses_a_tls_directory_another_user_could_change(tmp_path: Path, monkeypatch, capsys) -> None:
    home = tmp_path / "host-a"
    (home / "tls").mkdir(parents=True)
    (home / "tls").chmod(0o777)
    monkeypatch.setattr(LocalStack, "_launch", lambda self, child: pytest.fail("launched"))
    assert main(["up", "--home", str(home), "--base-port", "0", "--runners", "0", "--no-openai", "--tls"]) == 2
    assert f"refusing the TLS directory {home / 'tls'}: it is writable by group or others" in capsys.readouterr().err
    assert not (home / "tls" / "key.pem").exists()
