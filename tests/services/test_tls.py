"""TLS and mTLS (services/tls.py) on the shared bootstrap and client channel, exercised with the
KernelCache service: a TLS server serves a TLS client; plaintext, a certificate from another CA and
no certificate are each refused by an mTLS server; the plaintext ``--health-port`` answers health
only; ``--tls-server-name`` dials an IP whose certificate names only a DNS name."""

from __future__ import annotations

import argparse
import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.servicer import SERVICE_NAME, build_server
from kernel_cache_service.store import KernelStore
from services.bootstrap import ServerConfig, add_server_args, config_from_args
from services.channel import ClientSecurity, open_channel
from services.errors import InvalidArgument, Unavailable, WarmserveError
from services.healthcheck import check_health
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc
from services.tls import TLSFiles, add_tls_args, make_dev_pki, tls_from_args

MISS = pb.LookupResponse.STATUS_MISS


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"), ["localhost", "127.0.0.1"])


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("other-pki"), ["localhost", "127.0.0.1"], common_name="another CA")


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(tls: TLSFiles | None, **kw):
        srv = build_server(KernelStore(tmp_path / f"root{len(started)}"), ServerConfig(service="kc", tls=tls, **kw))
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def _lookup(address: str, security: ClientSecurity | None, timeout_s: float = 5.0) -> pb.LookupResponse:
    with open_channel(address, security=security) as ch:
        return pb_grpc.KernelCacheStub(ch).Lookup(pb.LookupRequest(key=pb.ProgramKey(name="n", fingerprint="f")), timeout=timeout_s)


def _refused(address: str, security: ClientSecurity | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        _lookup(address, security)
    return e.value.code()


def test_tls_server_serves_a_tls_client(pki, serve):
    srv = serve(TLSFiles(cert=str(pki.cert), key=str(pki.key)))  # server-only TLS: no client certificate asked
    assert _lookup(srv.address, ClientSecurity(tls=TLSFiles(ca=str(pki.ca)))).status == MISS
    assert check_health(srv.address, security=ClientSecurity(tls=TLSFiles(ca=str(pki.ca)))) == "SERVING"
    assert _refused(srv.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext against TLS


def test_mtls_server_serves_a_client_with_a_certificate_of_its_ca(pki, serve):
    srv = serve(pki.files())
    assert _lookup(srv.address, ClientSecurity(tls=pki.files())).status == MISS
    with KernelCacheClient(srv.address, security=ClientSecurity(tls=pki.files())) as client:
        assert client.lookup("n", "f") is None
        assert client.list() == []


def test_mtls_server_refuses_plaintext_another_ca_and_no_certificate(pki, other_pki, serve):
    srv = serve(pki.files())
    assert _refused(srv.address, None) == grpc.StatusCode.UNAVAILABLE
    # A certificate signed by another CA (which also trusts our server's CA, so only the client
    # side can fail): refused.
    stranger = TLSFiles(cert=str(other_pki.cert), key=str(other_pki.key), ca=str(pki.ca))
    assert _refused(srv.address, ClientSecurity(tls=stranger)) == grpc.StatusCode.UNAVAILABLE
    # The right CA but no certificate to present: refused.
    assert _refused(srv.address, ClientSecurity(tls=TLSFiles(ca=str(pki.ca)))) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the server.
    assert _refused(srv.address, ClientSecurity(tls=other_pki.files())) == grpc.StatusCode.UNAVAILABLE
    with KernelCacheClient(srv.address, security=ClientSecurity(tls=TLSFiles(ca=str(pki.ca)))) as client, \
            pytest.raises(WarmserveError):
        client.lookup("n", "f")


def test_health_port_is_plaintext_and_serves_health_only(pki, serve):
    srv = serve(pki.files(), health_port=0)
    assert srv.health_port and srv.health_port != srv.port
    health_addr = f"127.0.0.1:{srv.health_port}"
    assert check_health(health_addr) == "SERVING"
    assert check_health(health_addr, service=SERVICE_NAME) == "SERVING"
    assert _refused(health_addr, None) == grpc.StatusCode.UNIMPLEMENTED  # no KernelCache RPC there
    assert _refused(srv.address, None) == grpc.StatusCode.UNAVAILABLE  # the main port stays mTLS
    # No reflection either: the health port says nothing about the services behind it.
    with grpc.insecure_channel(health_addr) as ch:
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        with pytest.raises(grpc.RpcError) as e:
            list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    srv.set_serving(False)
    with grpc.insecure_channel(health_addr) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # the same statuses as the main port


def test_server_name_override_dials_an_ip_whose_certificate_names_a_dns_name(tmp_path, serve):
    pki = make_dev_pki(tmp_path / "pki", ["warmserve-runner"])
    srv = serve(pki.files())
    assert srv.address.startswith("127.0.0.1:")
    assert _refused(srv.address, ClientSecurity(tls=pki.files())) == grpc.StatusCode.UNAVAILABLE  # name mismatch
    assert _lookup(srv.address, ClientSecurity(tls=pki.files(server_name="warmserve-runner"))).status == MISS
    wrong = ClientSecurity(tls=pki.files(server_name="someone-else"))
    assert _refused(srv.address, wrong) == grpc.StatusCode.UNAVAILABLE


def test_open_channel_ready_timeout_fails_against_a_refusing_server(pki, serve):
    srv = serve(pki.files())
    with pytest.raises(Unavailable):
        open_channel(srv.address, ready_timeout_s=1.0)
    open_channel(srv.address, security=ClientSecurity(tls=pki.files()), ready_timeout_s=5.0).close()


def test_tls_files_validation(tmp_path, pki):
    with pytest.raises(InvalidArgument, match="go together"):
        TLSFiles(cert=str(pki.cert))
    with pytest.raises(InvalidArgument, match="go together"):
        TLSFiles(key=str(pki.key), ca=str(pki.ca))
    with pytest.raises(InvalidArgument, match="TLS needs"):
        TLSFiles()
    with pytest.raises(InvalidArgument, match="cannot read TLS CA"):
        TLSFiles(ca=str(tmp_path / "missing.pem")).channel_credentials()
    with pytest.raises(InvalidArgument, match="needs --tls-cert"):
        TLSFiles(ca=str(pki.ca)).server_credentials()
    with pytest.raises(InvalidArgument, match="needs --tls-cert"):
        ServerConfig(service="kc", tls=TLSFiles(ca=str(pki.ca)))
    assert pki.files().mutual and not TLSFiles(cert=str(pki.cert), key=str(pki.key)).mutual
    assert TLSFiles(ca=str(pki.ca), server_name="n").channel_options() == (("grpc.ssl_target_name_override", "n"),)
    assert TLSFiles(ca=str(pki.ca)).channel_options() == ()


def test_dev_pki_files_and_modes(tmp_path):
    from cryptography import x509

    pki = make_dev_pki(tmp_path / "pki", ["localhost", "127.0.0.1", "warmserve-runner"])
    for private in (pki.key, pki.ca_key):
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate(pki.cert.read_bytes())
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "warmserve-runner"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    again = make_dev_pki(tmp_path / "pki", ["localhost"])  # replaces the files
    assert again.ca.read_bytes() != b"" and x509.load_pem_x509_certificate(again.cert.read_bytes()) != leaf


def test_flags_make_tls_files_and_a_tls_server_config(pki):
    parser = argparse.ArgumentParser()
    add_server_args(parser, default_port=0)
    args = parser.parse_args(["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca),
                              "--tls-server-name", "warmserve-runner", "--health-port", "0"])
    cfg = config_from_args(args, "kc")
    assert cfg.tls == pki.files(server_name="warmserve-runner") and cfg.health_port == 0
    assert config_from_args(parser.parse_args([]), "kc").tls is None
    client = argparse.ArgumentParser()
    add_tls_args(client, server=False)
    assert tls_from_args(client.parse_args([])) is None
    assert tls_from_args(client.parse_args(["--tls-ca", str(pki.ca)])) == TLSFiles(ca=str(pki.ca))


def test_the_health_probe_command_speaks_tls(pki, serve):
    from services.healthcheck import main

    srv = serve(pki.files())
    assert main([srv.address, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]) == 0
    assert main([srv.address, "--timeout", "1"]) == 1


def test_the_router_dials_mtls_runners_by_ip_with_the_server_name(tmp_path):
    """Runners register by IP; their certificates name ``warmserve-runner``: the router reaches
    them with ``--tls-server-name warmserve-runner`` and its own certificate, and not without."""
    from fake_runner import FakeBehaviour, FakeGeneration, FakeStats

    from kserve_service.door import router_server
    from router_service.config import RouterConfig
    from services.bootstrap import ServiceServer
    from services.generation_client import GENERATION_SERVICE, GenerationClient, text_request
    from services.proto import generation_pb2_grpc

    only_name = make_dev_pki(tmp_path / "only-name", ["warmserve-runner"])
    runner = ServiceServer(ServerConfig(service="runner", tls=only_name.files()), [
        (generation_pb2_grpc.add_GenerationServicer_to_server,
         FakeGeneration("runner-0", FakeBehaviour(), FakeStats()), GENERATION_SERVICE)])
    runner.start()
    routers = []
    try:
        for server_name in ("warmserve-runner", None):
            security = ClientSecurity(tls=only_name.files(server_name=server_name))
            router = router_server(RouterConfig(static_runners=(runner.address,), health_interval_s=0.1),
                                   ServerConfig(service="router", tls=only_name.files()), security=security)
            router.start()
            routers.append(router)
        named, unnamed = routers
        assert named.router.wait_ready(1, 10)
        client_security = ClientSecurity(tls=only_name.files(server_name="warmserve-runner"))
        with GenerationClient(named.address, security=client_security) as client:
            assert client.complete(text_request("hi"), timeout_s=10).text
        assert not unnamed.router.wait_ready(1, 1.5)  # the certificate does not name 127.0.0.1
    finally:
        for router in routers:
            router.stop()
        runner.stop()
