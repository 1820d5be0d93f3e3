"""Limits of the KernelCache service (issue 23): Publish/Fetch/Claim streams take slots, so
stalled streams cannot starve Lookup and health checks; a Publish that stalls is cancelled after
its idle timeout; free-text fields are bounded and checked before anything is written; chunks
past the declared size are refused. Every refusal counts in ``warmserve_refused_total``."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kernel_cache_service.limits import MAX_TEXT_BYTES
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc

DATA = b"\x7fELF" + bytes(4092)


def _header(name="p", fp="f", *, producer="test", fmt="file", size=len(DATA)) -> pb.PublishRequest:
    return pb.PublishRequest(header=pb.PublishHeader(
        key=pb.ProgramKey(name=name, fingerprint=fp), size_bytes=size, sha256=hashlib.sha256(DATA).hexdigest(),
        producer=producer, format=fmt))


def _stalled(release: threading.Event, fp: str):
    """A Publish request stream that sends its header, then nothing until ``release``."""
    yield _header(fp=fp)
    release.wait()


def _refused(server, reason: str) -> float:
    return server.registry.get_sample_value("warmserve_refused_total", {"reason": reason}) or 0.0


def _wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _tmp_entries(cache) -> list:
    tmp = cache.store.root / "tmp"
    return list(tmp.iterdir()) if tmp.is_dir() else []


def test_stalled_streams_leave_lookup_and_health_answering(grpc_cache):
    cache = grpc_cache(max_streams=4)  # a pool of 4 + 16 control threads
    release = threading.Event()
    channel = grpc.insecure_channel(cache.address)
    stub = pb_grpc.KernelCacheStub(channel)
    stalled = [stub.Publish.future(_stalled(release, f"f{i}")) for i in range(24)]
    try:
        # 4 streams hold the 4 slots; the other 20 are refused at once instead of taking threads
        assert _wait_until(lambda: sum(f.done() for f in stalled) == 20)
        refused = [f for f in stalled if f.done()]
        assert all(f.code() == grpc.StatusCode.UNAVAILABLE for f in refused)
        assert "maximum of 4 concurrent streams" in refused[0].details()
        assert _refused(cache.server, "stream_slots") == 20
        # a WAIT-less Claim and a Fetch are streams too: refused while the slots are held
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Fetch(pb.FetchRequest(key=pb.ProgramKey(name="p", fingerprint="f")), timeout=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Claim(pb.ClaimRequest(key=pb.ProgramKey(name="p", fingerprint="f"), holder="h"), timeout=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # the short calls still find a thread
        miss = stub.Lookup(pb.LookupRequest(key=pb.ProgramKey(name="p", fingerprint="f")), timeout=2)
        assert miss.status == pb.LookupResponse.STATUS_MISS
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        for f in stalled:
            f.cancel()
        channel.close()
    assert _wait_until(lambda: _tmp_entries(cache) == [])  # the stalled uploads left nothing


def test_a_stalled_publish_is_cancelled_after_its_idle_timeout_and_frees_its_slot(grpc_cache):
    cache = grpc_cache(max_streams=1, publish_idle_s=0.5)
    release = threading.Event()
    with grpc.insecure_channel(cache.address) as channel:
        stub = pb_grpc.KernelCacheStub(channel)
        start = time.monotonic()
        stalled = stub.Publish.future(_stalled(release, "f"))  # no deadline: only the idle timeout ends it
        with pytest.raises(grpc.RpcError) as err:
            stalled.result(timeout=10)
        assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert 0.4 < time.monotonic() - start < 5
        release.set()
        assert _wait_until(lambda: _refused(cache.server, "idle_stream") == 1)
        # the one slot is free again: a real publish goes through
        ok = stub.Publish(iter([_header(), pb.PublishRequest(chunk=DATA)]), timeout=10)
        assert ok.status == pb.PublishResponse.STATUS_PUBLISHED
    assert [e.fingerprint for e in cache.store.list()] == ["f"] and _tmp_entries(cache) == []


def test_two_9_mib_producers_are_refused_and_list_keeps_working(grpc_cache):
    cache = grpc_cache()
    huge = "x" * (9 << 20)
    with grpc.insecure_channel(cache.address) as channel:
        stub = pb_grpc.KernelCacheStub(channel)
        for fp in ("f1", "f2"):
            with pytest.raises(grpc.RpcError) as err:
                stub.Publish(iter([_header(fp=fp, producer=huge), pb.PublishRequest(chunk=DATA)]), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (f"the producer is {9 << 20} bytes long; the limit is {MAX_TEXT_BYTES} "
                                           "bytes, and nothing was stored")
        ok = stub.Publish(iter([_header(fp="f3", producer="p" * MAX_TEXT_BYTES), pb.PublishRequest(chunk=DATA)]))
        assert ok.status == pb.PublishResponse.STATUS_PUBLISHED
        listed = stub.List(pb.ListRequest(), timeout=10)
        assert [e.key.fingerprint for e in listed.entries] == ["f3"]
    assert _refused(cache.server, "invalid_argument") == 2 and _tmp_entries(cache) == []


@pytest.mark.parametrize("header, message", [
    (_header(fmt="zip"), "format must be one of file, dir, got 'zip'"),
    (_header(producer="é" * 129), "the producer is 258 bytes long"),
])
def test_a_bad_header_is_refused_before_the_store_is_asked(grpc_cache, header, message):
    cache = grpc_cache()
    cache.store.publish("p", "f", _write(cache, DATA))  # precheck would say ALREADY_PRESENT
    with grpc.insecure_channel(cache.address) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.KernelCacheStub(channel).Publish(iter([header, pb.PublishRequest(chunk=DATA)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def _write(cache, data: bytes):
    path = cache.store.root.parent / "artifact.bin"
    path.write_bytes(data)
    return path


def test_an_overlong_holder_is_refused_and_takes_no_lease(grpc_cache):
    cache = grpc_cache()
    with grpc.insecure_channel(cache.address) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.KernelCacheStub(channel).Claim(
            pb.ClaimRequest(key=pb.ProgramKey(name="p", fingerprint="f"), holder="h" * (MAX_TEXT_BYTES + 1)),
            timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "the holder is 257 bytes long" in err.value.details()
    assert cache.store.leases() == []


def test_chunks_past_the_declared_size_are_refused_without_an_entry(grpc_cache):
    cache = grpc_cache()
    with grpc.insecure_channel(cache.address) as channel:
        stub = pb_grpc.KernelCacheStub(channel)
        chunks = [pb.PublishRequest(chunk=DATA), pb.PublishRequest(chunk=bytes(4 << 20))]
        result = stub.Publish(iter([_header(), *chunks]), timeout=30)
    assert result.status == pb.PublishResponse.STATUS_REJECTED and "more bytes arrived" in result.reason
    assert cache.store.list() == [] and _tmp_entries(cache) == []
    assert _refused(cache.server, "past_declared_size") == 1
