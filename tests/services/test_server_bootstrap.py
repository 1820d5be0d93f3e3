"""The shared server bootstrap (services/bootstrap.py), exercised with the KernelCache service:
health (SERVING, then NOT_SERVING on drain), reflection, Prometheus metrics, bearer auth."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from auth_tokens import make_creds
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kernel_cache_service.servicer import SERVICE_NAME, build_server
from kernel_cache_service.store import KernelStore
from services.bootstrap import ServerConfig
from services.errors import InvalidArgument
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def server(tmp_path):
    srv = build_server(KernelStore(tmp_path / "root"), ServerConfig(service="kc", metrics_port=0))
    srv.start()
    yield srv
    srv.stop()


def _check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_is_serving_then_not_serving_on_drain(server):
    assert server.config.host == "127.0.0.1" and server.port > 0
    assert _check(server.address) == SERVING
    assert _check(server.address, SERVICE_NAME) == SERVING
    with pytest.raises(grpc.RpcError) as e:
        _check(server.address, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    # A Watch opened before the drain sees the transition; a Check made while draining (from an
    # on_drain callback, i.e. before the listener closes) answers NOT_SERVING.
    channel = grpc.insecure_channel(server.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert next(watch).status == SERVING
    during: list[int] = []
    server.on_drain.append(lambda: during.append(_check(server.address)))
    drainer = threading.Thread(target=server.drain, kwargs={"grace_s": 5})
    drainer.start()
    assert next(watch).status == NOT_SERVING
    watch.cancel()
    drainer.join(timeout=30)
    assert during == [NOT_SERVING]
    assert server.wait(timeout=0)
    with pytest.raises(grpc.RpcError) as e:
        _check(server.address)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = list(stub.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        ])))
    names = {s.name for s in responses[0].list_services_response.service}
    assert names == {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert responses[1].file_descriptor_response.file_descriptor_proto  # grpcurl can describe it


def test_metrics_endpoint_counts_rpcs(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.KernelCacheStub(ch)
        for _ in range(3):
            stub.Lookup(pb.LookupRequest(key=pb.ProgramKey(name="p", fingerprint="f")))
        with pytest.raises(grpc.RpcError):
            stub.Lookup(pb.LookupRequest(key=pb.ProgramKey(name="../x", fingerprint="f")))
    assert server.metrics_port and server.metrics_port > 0
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    lookup = f'method="/{SERVICE_NAME}/Lookup"'
    lines = body.splitlines()
    assert f'warmserve_rpc_total{{code="OK",{lookup}}} 3.0' in lines
    assert f'warmserve_rpc_total{{code="INVALID_ARGUMENT",{lookup}}} 1.0' in lines
    assert f"warmserve_rpc_seconds_count{{{lookup}}} 4.0" in lines
    assert "warmserve_kernel_cache_misses_total 3.0" in lines
    assert "warmserve_kernel_cache_entries 0.0" in lines


def test_the_auth_table_guards_every_method_but_health(tmp_path):
    creds = make_creds(tmp_path / "auth", ops="admin,read")
    srv = build_server(KernelStore(tmp_path / "root"), ServerConfig(service="kc", auth=creds.table))
    srv.start()
    try:
        assert _check(srv.address) == SERVING  # health never needs the token
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.KernelCacheStub(ch)
            for metadata in ((), (("authorization", "Bearer bad"),), (("authorization", creds.token("ops")),)):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Evict(pb.EvictRequest(all=True), metadata=metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Stat(pb.StatRequest(), metadata=creds.metadata("ops")).entries == 0
            assert stub.Evict(pb.EvictRequest(all=True), metadata=creds.metadata("ops")).evicted == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("kwargs", [{"port": 70000}, {"metrics_port": -1}, {"max_workers": 0},
                                    {"drain_grace_s": -1.0}, {"health_port": 70000}])
def test_server_config_is_validated(kwargs):
    with pytest.raises(InvalidArgument):
        ServerConfig(service="kc", **kwargs)


def test_a_busy_port_is_an_os_error(server, tmp_path):
    other = build_server(KernelStore(tmp_path / "other"), ServerConfig(service="kc", port=server.port))
    with pytest.raises(OSError, match="cannot bind"):
        other.start()


def test_a_request_that_does_not_parse_is_invalid_argument_not_internal(server, tmp_path):
    """Found by tests/fuzz: grpcio answers INTERNAL ("Exception deserializing request!") for a
    corrupt message or invalid UTF-8 in a string field; every server answers INVALID_ARGUMENT."""
    channel = grpc.insecure_channel(server.address)
    bad_utf8 = b"\x0a\x04\x0a\x02\xff\xfe"  # LookupRequest.key.name = b"\xff\xfe"
    lookup = channel.unary_unary(f"/{SERVICE_NAME}/Lookup", request_serializer=None,
                                 response_deserializer=pb.LookupResponse.FromString)
    for raw in (bad_utf8, b"\x0a\xff\xff"):
        with pytest.raises(grpc.RpcError) as e:
            lookup(raw, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not valid UTF-8" in e.value.details() or "not a well-formed protobuf message" in e.value.details()
    # in a client stream: the header parses, the chunk after it does not; nothing is kept
    header = pb.PublishRequest(header=pb.PublishHeader(key=pb.ProgramKey(name="p", fingerprint="f"), size_bytes=4,
                                                       sha256="00" * 32)).SerializeToString()
    publish = channel.stream_unary(f"/{SERVICE_NAME}/Publish", request_serializer=None,
                                   response_deserializer=pb.PublishResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        publish(iter([header, b"\x12\xff"]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert list((tmp_path / "root" / "tmp").iterdir()) == []
    assert _check(server.address) == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_unauthenticated_open_streams_cannot_take_the_pool(tmp_path):
    """A pool of max_streams + control_threads + OPEN_STREAMS = 1 + 1 + 4 threads. 40 health
    Watch streams (callback style: no thread each) and reflection streams past OPEN_STREAMS
    (refused Overloaded) leave a Lookup and a Check answering; every Watch still sees the drain."""
    from services.errors import is_overloaded
    from services.stream_slots import OPEN_STREAMS

    cfg = ServerConfig(service="kc", max_streams=1, control_threads=1)
    assert cfg.pool_threads == 2 + OPEN_STREAMS
    srv = build_server(KernelStore(tmp_path / "root"), cfg)
    srv.start()
    channels = [grpc.insecure_channel(srv.address) for _ in range(4)]
    try:
        watches = [health_pb2_grpc.HealthStub(channels[i % 4]).Watch(health_pb2.HealthCheckRequest())
                   for i in range(40)]
        assert all(next(w).status == SERVING for w in watches)
        hold = threading.Event()

        def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            hold.wait(30)  # keep the stream (and its thread) open

        reflections = [reflection_pb2_grpc.ServerReflectionStub(channels[0]).ServerReflectionInfo(requests())
                       for _ in range(OPEN_STREAMS)]
        assert all(next(r).list_services_response.service for r in reflections)
        extra = reflection_pb2_grpc.ServerReflectionStub(channels[1]).ServerReflectionInfo(requests())
        with pytest.raises(grpc.RpcError) as e:
            next(extra)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and is_overloaded(e.value), e.value.details()
        stub = pb_grpc.KernelCacheStub(channels[2])
        for _ in range(5):
            miss = stub.Lookup(pb.LookupRequest(key=pb.ProgramKey(name="p", fingerprint="f")), timeout=5)
            assert miss.status == pb.LookupResponse.STATUS_MISS
            assert _check(srv.address) == SERVING
        hold.set()
        for r in reflections:
            r.cancel()
        srv.drain(grace_s=1)
        assert all(next(w).status == NOT_SERVING for w in watches)
    finally:
        for ch in channels:
            ch.close()
        srv.stop()
