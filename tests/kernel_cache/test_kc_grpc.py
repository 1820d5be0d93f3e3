"""The KernelCache service over real gRPC on loopback: round trips, key validation, the publish
protocol, bearer-token auth, integrity, read leases during a Fetch, and drain on SIGTERM."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from auth_tokens import make_creds
from kc_workers import tree_digest

from kernel_cache_service import artifact
from kernel_cache_service.client import KernelCacheClient
from services.errors import InvalidArgument, Unauthenticated, Unavailable
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc

BAD_KEYS = ["../x", "", "a" * 10_000, "a/b", ".."]


def _wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _stub(address: str) -> pb_grpc.KernelCacheStub:
    return pb_grpc.KernelCacheStub(grpc.insecure_channel(address))


def _key(name: str, fp: str) -> pb.ProgramKey:
    return pb.ProgramKey(name=name, fingerprint=fp)


def _publish_requests(name, fp, data: bytes, *, size=None, sha=None, chunk=4096, fmt="file"):
    header = pb.PublishHeader(key=_key(name, fp), size_bytes=len(data) if size is None else size,
                              sha256=hashlib.sha256(data).hexdigest() if sha is None else sha,
                              producer="test", format=fmt)
    yield pb.PublishRequest(header=header)
    for i in range(0, len(data), chunk):
        yield pb.PublishRequest(chunk=data[i:i + chunk])


def test_round_trip_over_grpc(grpc_cache, tmp_path):
    cache = grpc_cache()
    client = KernelCacheClient(cache.address)
    data = os.urandom(3 * (1 << 20) + 17)  # several 1 MiB chunks and a ragged tail
    (tmp_path / "prog.so").write_bytes(data)
    src_dir = tmp_path / "cache-dir"
    (src_dir / "sub").mkdir(parents=True)
    (src_dir / "sub" / "k.so").write_bytes(os.urandom(100_000))
    (src_dir / "index.json").write_text("{}")
    (tmp_path / "empty.bin").write_bytes(b"")

    assert client.lookup("llama.decode", "f1") is None
    assert client.publish("llama.decode", "f1", tmp_path / "prog.so", producer="t") == "PUBLISHED"
    assert client.publish("llama.decode", "f1", tmp_path / "prog.so") == "ALREADY_PRESENT"
    assert client.publish("llama.decode", "d1", src_dir) == "PUBLISHED"
    with pytest.raises(InvalidArgument, match="empty artifact"):  # 0 bytes is no program
        client.publish("llama.decode", "e0", tmp_path / "empty.bin")

    info = client.lookup("llama.decode", "f1")
    assert (info.size_bytes, info.sha256, info.format, info.producer) == (
        len(data), hashlib.sha256(data).hexdigest(), "file", "t")
    assert client.fetch("llama.decode", "f1", tmp_path / "out.so").size_bytes == len(data)
    assert (tmp_path / "out.so").read_bytes() == data
    assert client.fetch("llama.decode", "f1", tmp_path / "out-small.so", chunk_bytes=10_000) is not None
    assert (tmp_path / "out-small.so").read_bytes() == data
    assert client.fetch("llama.decode", "d1", tmp_path / "restored").format == "dir"
    assert tree_digest(tmp_path / "restored") == tree_digest(src_dir)
    assert client.fetch("llama.decode", "e0", tmp_path / "empty.out") is None
    assert not (tmp_path / "empty.out").exists()
    assert client.fetch("llama.decode", "nope", tmp_path / "miss") is None
    assert not (tmp_path / "miss").exists()

    # The stream: entry info on the first message only, chunks no larger than asked.
    msgs = list(_stub(cache.address).Fetch(pb.FetchRequest(key=_key("llama.decode", "f1"), chunk_bytes=1 << 20)))
    assert msgs[0].entry.sha256 == info.sha256 and not any(m.HasField("entry") for m in msgs[1:])
    assert [len(m.data) for m in msgs] == [1 << 20] * 3 + [17]

    assert [(e.fingerprint, e.format) for e in client.list("llama")] == [("d1", "dir"), ("f1", "file")]
    s = client.stat()
    assert (s["entries"], s["publishes"], s["root"]) == (2, 2, str(cache.store.root))
    assert client.evict("llama.decode", "f1") == (1, len(data))
    assert client.evict(all=True)[0] == 1  # d1 is left
    assert client.list() == []
    client.close()


def test_fetch_of_a_missing_entry_is_not_found(grpc_cache):
    stub = _stub(grpc_cache().address)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Fetch(pb.FetchRequest(key=_key("p", "absent"))))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("bad", BAD_KEYS, ids=["traversal", "empty", "10kB", "slash", "dotdot"])
def test_bad_keys_are_invalid_argument_over_grpc(grpc_cache, tmp_path, bad):
    cache = grpc_cache()
    stub = _stub(cache.address)
    calls = [
        lambda: stub.Lookup(pb.LookupRequest(key=_key(bad, "f"))),
        lambda: stub.Lookup(pb.LookupRequest(key=_key("n", bad))),
        lambda: list(stub.Fetch(pb.FetchRequest(key=_key(bad, "f")))),
        lambda: stub.Publish(_publish_requests(bad, "f", b"data")),
        lambda: stub.Publish(_publish_requests("n", bad, b"data")),
        lambda: stub.Evict(pb.EvictRequest(key=_key(bad, "f"))),
    ]
    if bad:  # an empty prefix means "every name", an empty evict fingerprint "every fingerprint"
        calls.append(lambda: stub.List(pb.ListRequest(name_prefix=bad)))
        calls.append(lambda: stub.Evict(pb.EvictRequest(key=_key("n", bad))))
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert cache.store.list() == [] and list((cache.store.root / "tmp").iterdir()) == []
    client = KernelCacheClient(cache.address)
    (tmp_path / "a").write_bytes(b"x")
    for call in (lambda: client.lookup(bad, "f"), lambda: client.publish(bad, "f", tmp_path / "a"),
                 lambda: client.fetch("n", bad, tmp_path / "o")):
        with pytest.raises(InvalidArgument):
            call()


def test_publish_protocol_is_verified(grpc_cache):
    cache = grpc_cache()
    stub = _stub(cache.address)
    data = os.urandom(50_000)
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(iter([pb.PublishRequest(chunk=b"no header")]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(_publish_requests("p", "f", data, sha=""))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(_publish_requests("p", "f", data, fmt="zip"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "format" in e.value.details()
    short = stub.Publish(_publish_requests("p", "f", data, size=len(data) + 1))
    assert short.status == pb.PublishResponse.STATUS_REJECTED and "announced" in short.reason
    long = stub.Publish(_publish_requests("p", "f", data, size=len(data) - 1))
    assert long.status == pb.PublishResponse.STATUS_REJECTED and "more bytes" in long.reason
    wrong = stub.Publish(_publish_requests("p", "f", data, sha=hashlib.sha256(b"other").hexdigest()))
    assert wrong.status == pb.PublishResponse.STATUS_REJECTED and "sha256" in wrong.reason
    assert stub.Lookup(pb.LookupRequest(key=_key("p", "f"))).status == pb.LookupResponse.STATUS_MISS
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(_publish_requests("p", "f", b""))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty artifact" in e.value.details()
    # announced as 50 000 bytes, none sent: a short transfer (REJECTED), not an empty artifact
    none_sent = stub.Publish(_publish_requests("p", "f", b"", size=len(data), sha=hashlib.sha256(data).hexdigest()))
    assert none_sent.status == pb.PublishResponse.STATUS_REJECTED and "announced" in none_sent.reason
    ok = stub.Publish(_publish_requests("p", "f", data))
    assert ok.status == pb.PublishResponse.STATUS_PUBLISHED and ok.entry.size_bytes == len(data)
    again = stub.Publish(_publish_requests("p", "f", data))
    assert again.status == pb.PublishResponse.STATUS_ALREADY_PRESENT
    assert list((cache.store.root / "tmp").iterdir()) == []


def test_a_full_disk_in_the_daemon_is_resource_exhausted_and_leaves_nothing(grpc_cache, monkeypatch):
    cache = grpc_cache()
    stub = _stub(cache.address)

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifact.HashingWriter, "write", full)
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(_publish_requests("p", "f", os.urandom(10_000)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no space left" in e.value.details() and "\n" not in e.value.details()
    monkeypatch.undo()
    assert stub.Lookup(pb.LookupRequest(key=_key("p", "f"))).status == pb.LookupResponse.STATUS_MISS
    assert list((cache.store.root / "tmp").iterdir()) == []


def test_every_rpc_needs_a_token_with_its_scope_when_the_daemon_has_an_auth_file(grpc_cache, tmp_path):
    creds = make_creds(tmp_path / "auth", publisher="read,publish", reader="read", admin="admin,read")
    cache = grpc_cache(auth=creds.table)
    stub = _stub(cache.address)
    wrong = (("authorization", "Bearer wst_wrong"),)
    for metadata in ((), wrong):
        for call in (lambda md: stub.Publish(_publish_requests("p", "f", b"data"), metadata=md),
                     lambda md: stub.Evict(pb.EvictRequest(all=True), metadata=md),
                     lambda md: stub.Lookup(pb.LookupRequest(key=_key("p", "f")), metadata=md)):
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reader = creds.metadata("reader")
    assert stub.Lookup(pb.LookupRequest(key=_key("p", "f")), metadata=reader).status == pb.LookupResponse.STATUS_MISS
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(_publish_requests("p", "f", b"data"), metadata=reader)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "reader lacks the 'publish' scope" in e.value.details()
    (tmp_path / "a").write_bytes(b"data")
    with pytest.raises(Unauthenticated):
        KernelCacheClient(cache.address).publish("p", "f", tmp_path / "a")
    assert KernelCacheClient(cache.address, security=creds.security("publisher")).publish(
        "p", "f", tmp_path / "a") == "PUBLISHED"
    assert KernelCacheClient(cache.address, security=creds.security("reader")).fetch(
        "p", "f", tmp_path / "b").size_bytes == 4
    with pytest.raises(grpc.RpcError) as e:
        stub.Evict(pb.EvictRequest(all=True), metadata=creds.metadata("publisher"))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stub.Evict(pb.EvictRequest(all=True), metadata=creds.metadata("admin")).evicted == 1
    assert cache.store.list() == []


def test_corrupt_entry_is_not_found_over_grpc_and_quarantined(grpc_cache, tmp_path):
    cache = grpc_cache()
    client = KernelCacheClient(cache.address)
    data = os.urandom(2_500_000)
    (tmp_path / "a").write_bytes(data)
    client.publish("p", "f", tmp_path / "a")
    blob = cache.store.root / "entries/p/f/blob"
    with open(blob, "r+b") as f:
        f.seek(2_000_000)
        f.write(bytes([data[2_000_000] ^ 1]))
    assert client.fetch("p", "f", tmp_path / "out") is None
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if "warmserve" in p.name] == []
    assert client.lookup("p", "f") is None
    assert client.stat()["quarantined"] == 1


def test_over_budget_publish_is_rejected_before_the_bytes(grpc_cache, tmp_path):
    cache = grpc_cache(max_bytes=1000)
    (tmp_path / "big").write_bytes(b"x" * 1001)
    result = KernelCacheClient(cache.address).publish_result("p", "f", tmp_path / "big")
    assert result.status == "REJECTED" and "budget" in result.reason


def test_an_entry_is_not_evicted_while_a_fetch_streams_it(grpc_cache, tmp_path):
    cache = grpc_cache()
    data = os.urandom(4 << 20)
    (tmp_path / "a").write_bytes(data)
    KernelCacheClient(cache.address).publish("p", "f", tmp_path / "a")
    stub = _stub(cache.address)
    stream = stub.Fetch(pb.FetchRequest(key=_key("p", "f"), chunk_bytes=64 * 1024))
    received = [next(stream).data]
    assert stub.Evict(pb.EvictRequest(key=_key("p", "f"))).evicted == 0
    received.extend(m.data for m in stream)
    assert b"".join(received) == data
    assert stub.Evict(pb.EvictRequest(key=_key("p", "f"))).evicted == 1


def test_a_client_dying_mid_publish_leaves_nothing(grpc_cache, worker):
    cache = grpc_cache()
    proc, line = worker("slow-publish-grpc", cache.address, "p", "f")
    assert line == "ready"
    tmp = cache.store.root / "tmp"
    assert _wait_until(lambda: len(list(tmp.iterdir())) == 1)  # the daemon is receiving it
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _wait_until(lambda: list(tmp.iterdir()) == [])  # the daemon dropped the partial bytes
    assert cache.store.lookup("p", "f") is None


def test_unreachable_daemon_is_unavailable(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    client = KernelCacheClient("127.0.0.1:1", timeout_s=5)
    with pytest.raises(Unavailable, match="127.0.0.1:1"):
        client.lookup("p", "f")
    with pytest.raises(Unavailable):
        client.fetch("p", "f", tmp_path / "o")


def test_sigterm_lets_an_in_flight_fetch_finish(daemon, tmp_path):
    d = daemon("--drain-grace", "30")
    data = os.urandom(40 << 20)  # more than gRPC's flow-control windows can buffer
    (tmp_path / "big").write_bytes(data)
    assert KernelCacheClient(d.address).publish("p", "f", tmp_path / "big") == "PUBLISHED"
    channel = grpc.insecure_channel(d.address)
    stream = pb_grpc.KernelCacheStub(channel).Fetch(pb.FetchRequest(key=_key("p", "f"), chunk_bytes=64 * 1024))
    first = next(stream)
    assert first.entry.size_bytes == len(data)
    sha = hashlib.sha256(first.data)
    received = len(first.data)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the daemon is draining; it must wait for this stream
    assert d.proc.poll() is None
    with pytest.raises(Unavailable):  # ... while refusing new work
        KernelCacheClient(d.address, timeout_s=5).lookup("p", "f")
    for i, msg in enumerate(stream):
        sha.update(msg.data)
        received += len(msg.data)
        if i % 64 == 0:
            time.sleep(0.01)  # a slow reader
    assert received == len(data)
    assert sha.hexdigest() == hashlib.sha256(data).hexdigest()
    assert d.proc.wait(timeout=30) == 0
    channel.close()
    assert '"msg": "stopped"' in Path(d.log).read_text()


def test_a_runner_presents_its_own_token_file_to_a_protected_kernel_cache(grpc_cache, tmp_path):
    """`runner serve --token-file F`: the runner's programs talk to a protected kernel cache with
    the runner's own credential."""
    from runner_service.daemon import kernel_cache_from_args
    from runner_service.programs.cache import open_kernel_cache
    from services.channel import client_security_from_args
    from warmserve.cli import build_parser

    creds = make_creds(tmp_path / "auth", **{"runner-0": "read,publish"})
    cache = grpc_cache(auth=creds.table)
    (tmp_path / "a").write_bytes(b"data")
    parse = build_parser().parse_args
    base = ["runner", "serve", "--model", "m", "--kernel-cache", cache.address]
    args = parse([*base, "--token-file", str(creds.token_file("runner-0"))])
    with_token = kernel_cache_from_args(args, client_security_from_args(args, env={}))
    assert open_kernel_cache(with_token).publish("p", "f", tmp_path / "a") == "PUBLISHED"
    args = parse(base)
    without = kernel_cache_from_args(args, client_security_from_args(args, env={}))
    with pytest.raises(Unauthenticated):
        open_kernel_cache(without).publish("p", "g", tmp_path / "a")
    with pytest.raises(InvalidArgument, match="cannot read token file"):
        client_security_from_args(parse([*base, "--token-file", str(tmp_path / "absent")]), env={})
