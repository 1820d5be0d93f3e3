"""services.auth and services.scopes: the auth-file format and its errors, digests only on disk,
UNAUTHENTICATED vs PERMISSION_DENIED, caller() inside a handler, and one scope for every RPC."""

from __future__ import annotations

import os
import stat

import grpc
import pytest
from auth_tokens import make_creds

from services.auth import (
    AuthTable,
    Credential,
    caller,
    ensure_credentials,
    new_token,
    read_token,
    token_digest,
)
from services.bootstrap import ServerConfig, ServiceServer
from services.channel import ClientSecurity, open_channel
from services.errors import InvalidArgument
from services.proto import router_pb2, router_pb2_grpc
from services.proto.triton import grpc_service_pb2
from services.proto.warmserve.v1 import generation_pb2, kernel_cache_pb2, weights_pb2
from services.scopes import METHOD_SCOPES, OPEN_METHODS, OPEN_PREFIXES, SCOPES, scope_of

DIGEST = token_digest("wst_x")


@pytest.mark.parametrize("text, needle", [
    ("alice read", "expected 'NAME"),
    ("alice read sha256:abc", "digest"),
    ("alice fly " + DIGEST, "scopes must be some of"),
    ("al ice read " + DIGEST, "expected 'NAME"),
    ("-x read " + DIGEST, "credential name"),
    ("# only a comment\n\n", "holds no credential"),
    (f"a read {DIGEST}\na admin {token_digest('wst_y')}", "appears twice"),
    (f"a read {DIGEST}\nb admin {DIGEST}", "appears twice"),
])
def test_malformed_auth_files_are_refused_with_the_line(text: str, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        AuthTable.parse(text)


def test_table_round_trips_and_identifies_by_token() -> None:
    token = new_token()
    assert token.startswith("wst_") and len(token) == 47
    table = AuthTable.parse(f"# fleet\nrunner-0 read,publish {token_digest(token)}  # trailing\n")
    assert table.identify(token) == Credential("runner-0", frozenset({"read", "publish"}), token_digest(token))
    assert table.identify(new_token()) is None
    assert AuthTable.parse(table.text()).names() == ["runner-0"]


def test_ensure_credentials_writes_digests_only_and_keeps_tokens(tmp_path) -> None:
    d = tmp_path / "auth"
    table = ensure_credentials(d, {"runner-0": ["read", "register"], "admin": SCOPES})
    tokens = {n: read_token(d / f"{n}.token") for n in ("runner-0", "admin")}
    text = (d / "auth").read_text()
    assert all(t not in text for t in tokens.values())  # the table holds no secret
    assert all(token_digest(t) in text for t in tokens.values())
    assert table.identify(tokens["admin"]).scopes == frozenset(SCOPES)
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    ensure_credentials(d, {"runner-0": ["read", "register"], "admin": SCOPES})
    assert read_token(d / "runner-0.token") == tokens["runner-0"]  # a restart keeps its token


def test_read_token_prefers_the_file_then_the_environment(tmp_path) -> None:
    f = tmp_path / "t"
    f.write_text("wst_file\n")
    assert read_token(f, {"WARMSERVE_TOKEN": "wst_env"}) == "wst_file"
    assert read_token(None, {"WARMSERVE_TOKEN": "wst_env"}) == "wst_env"
    assert read_token(None, {}) is None
    f.write_text("\n")
    with pytest.raises(InvalidArgument, match="empty"):
        read_token(f)


class _Control(router_pb2_grpc.RouterControlServicer):
    seen: list = []

    def ListRunners(self, request, context):
        cred = caller()
        self.seen.append(cred.name if cred else None)
        return router_pb2.ListRunnersResponse()

    def Drain(self, request, context):
        return router_pb2.DrainResponse(found=False)


def test_the_interceptor_tells_unknown_callers_from_unprivileged_ones(tmp_path) -> None:
    creds = make_creds(tmp_path, reader="read", operator="read,admin")
    server = ServiceServer(ServerConfig(service="t", port=0, auth=creds.table), [
        (router_pb2_grpc.add_RouterControlServicer_to_server, _Control(), "warmserve.v1.RouterControl")])
    server.start()
    try:
        def call(method: str, security: ClientSecurity | None):
            with open_channel(server.address, security=security) as ch:
                stub = router_pb2_grpc.RouterControlStub(ch)
                req = router_pb2.ListRunnersRequest() if method == "ListRunners" else router_pb2.DrainRequest()
                return getattr(stub, method)(req, timeout=5)

        for security in (None, ClientSecurity(token=new_token())):
            with pytest.raises(grpc.RpcError) as e:
                call("Drain", security)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            call("Drain", creds.security("reader"))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin" in e.value.details()
        assert call("Drain", creds.security("operator")).found is False
        _Control.seen.clear()
        call("ListRunners", creds.security("reader"))
        call("ListRunners", creds.security("operator"))
        assert _Control.seen == ["reader", "operator"]  # caller() inside the handler
        assert caller() is None  # and nothing outside one
    finally:
        server.stop()


SERVICES = [
    *(s for m in (kernel_cache_pb2, weights_pb2, generation_pb2, router_pb2) for s in m.DESCRIPTOR.services_by_name.values()),
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
]


def test_every_rpc_of_every_service_has_a_scope_or_is_open() -> None:
    methods = {f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods}
    assert {s.full_name for s in SERVICES} >= {"warmserve.v1.KernelCache", "warmserve.v1.Weights",
                                               "warmserve.v1.Generation", "warmserve.v1.RouterControl",
                                               "inference.GRPCInferenceService"}
    missing = sorted(m for m in methods if m not in METHOD_SCOPES and m not in OPEN_METHODS
                     and not m.startswith(OPEN_PREFIXES))
    assert not missing, f"RPCs without a scope in services/scopes.py: {missing}"
    assert set(METHOD_SCOPES) <= methods, sorted(set(METHOD_SCOPES) - methods)  # no stale entries
    assert set(METHOD_SCOPES.values()) <= set(SCOPES)
    assert scope_of("/grpc.health.v1.Health/Check") is None
    with pytest.raises(KeyError):
        scope_of("/warmserve.v1.KernelCache/NoSuchRpc")


def test_make_creds_files_are_private(tmp_path) -> None:
    creds = make_creds(tmp_path, a="read")
    assert os.stat(creds.token_file("a")).st_mode & 0o077 == 0


def _planted(d):
    """An auth directory someone else prepared (umask 0): a world-writable directory and a
    world-readable admin token whose value they know."""
    d.mkdir()
    d.chmod(0o777)
    (d / "admin.token").write_text("wst_known_to_the_attacker\n")
    (d / "admin.token").chmod(0o666)
    return d


def test_ensure_credentials_refuses_a_directory_or_token_another_user_could_write(tmp_path) -> None:
    wanted = {"admin": SCOPES}
    d = _planted(tmp_path / "auth")
    with pytest.raises(InvalidArgument, match=f"refusing the credentials directory {d}: it is writable by group "
                                              "or others \\(mode 0777\\)"):
        ensure_credentials(d, wanted)
    d.chmod(0o700)  # a private directory, but a token readable and writable by all
    with pytest.raises(InvalidArgument, match=f"refusing the token file {d / 'admin.token'}: group or others "
                                              "may access it \\(mode 0666\\)"):
        ensure_credentials(d, wanted)
    assert not (d / "auth").exists()  # nothing accepts the planted token
    (d / "admin.token").unlink()
    (d / "admin.token").symlink_to(tmp_path / "elsewhere.token")
    with pytest.raises(InvalidArgument, match="it is a symbolic link"):
        ensure_credentials(d, wanted)
    (d / "admin.token").unlink()
    table = ensure_credentials(d, wanted)  # what remains is ours: a fresh token
    assert table.identify("wst_known_to_the_attacker") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_ensure_credentials_refuses_files_of_another_user(tmp_path) -> None:
    d = tmp_path / "auth"
    ensure_credentials(d, {"admin": SCOPES})
    os.chown(d / "admin.token", 65534, 65534)
    with pytest.raises(InvalidArgument, match="admin.token: it is owned by uid 65534"):
        ensure_credentials(d, {"admin": SCOPES})
    os.chown(d / "admin.token", 0, 0)
    os.chown(d, 65534, 65534)
    with pytest.raises(InvalidArgument, match=f"{d}: it is owned by uid 65534"):
        ensure_credentials(d, {"admin": SCOPES})
