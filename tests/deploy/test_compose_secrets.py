"""``deploy/compose/make_secrets.py`` (``make compose-secrets``): the credentials compose.yaml and
the k8s manifests require, in issue 23's contract formats: tokens, auth files whose hashes are
those tokens', a CA whose leaf certificates carry the names peers dial, Ed25519 signing keys with
their public halves; kept on a rerun, remade with ``--force``; never readable by other users."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "compose"))

import make_secrets  # noqa: E402  (deploy/compose/make_secrets.py)

from services.auth import AuthTable  # noqa: E402
from services.signing import SigningKey, TrustedKeys  # noqa: E402

TOKEN = re.compile(r"^wst_[A-Za-z0-9_-]{43}$")
SCOPES = {"read", "publish", "prepare", "admin", "register", "generate"}


def _read(out: Path, rel: str) -> bytes:
    return (out / rel).read_bytes()


@pytest.fixture(scope="module", params=["compose", "k8s"])
def made(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "secrets"
    assert make_secrets.prepare(out, request.param, log=lambda _m: None)
    return request.param, out


def test_every_file_is_made(made):
    kind, out = made
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert found == make_secrets.expected_files(make_secrets.fleet(kind))


def test_tokens_and_auth_files_are_the_contracts(made):
    kind, out = made
    layout = make_secrets.fleet(kind)
    tokens = {}
    for identity in layout["identities"]:
        (line,) = _read(out, f"tokens/{identity}.token").decode().splitlines()
        assert TOKEN.match(line), identity
        tokens[identity] = line
    assert len(set(tokens.values())) == len(tokens), "one token per identity"
    for server, admitted in layout["auth"].items():
        rows = [line.split() for line in _read(out, f"auth/{server}.auth").decode().splitlines()
                if line.strip() and not line.startswith("#")]
        assert [r[0] for r in rows] == list(admitted), server
        for name, scopes, digest in rows:
            assert set(scopes.split(",")) == set(admitted[name].split(",")) <= SCOPES, (server, name)
            assert digest == "sha256:" + hashlib.sha256(tokens[name].encode()).hexdigest(), (server, name)
        table = AuthTable.load(out / f"auth/{server}.auth")  # what the servers read
        for name in admitted:
            assert table.identify(tokens[name]).name == name, (server, name)
        assert not any(t in _read(out, f"auth/{server}.auth").decode() for t in tokens.values()), "hashes only"
    # who may do what: runners publish programs and register, the router generates on runners
    for runner in layout["runners"]:
        assert layout["auth"]["kernel-cache"][runner] == "read,publish"
        assert layout["auth"]["router"][runner] == "register,read"
    assert "admin" not in layout["auth"]["kernel-cache"]["runner-0" if kind == "compose" else "runner"]
    assert layout["auth"]["runner"] == {"router": "generate,read", "admin": "read"}
    assert TOKEN.match(_read(out, "api-key").decode().strip())


def test_certificates_are_signed_by_the_ca_for_the_names_peers_dial(made):
    kind, out = made
    ca = x509.load_pem_x509_certificate(_read(out, "tls/ca.pem"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, sans in make_secrets.fleet(kind)["certs"].items():
        cert = x509.load_pem_x509_certificate(_read(out, f"tls/{name}.pem"))
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(sans) | {"localhost"} <= set(names.get_values_for_type(x509.DNSName)), name
        assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"], name
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {u._name for u in usages} == {"serverAuth", "clientAuth"}, name  # also its outbound calls' cert
        key = serialization.load_pem_private_key(_read(out, f"tls/{name}.key"), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.public_key() == cert.public_key(), name
    if kind == "k8s":  # the router dials runners by pod IP and asks for `runner` (--tls-server-name)
        assert make_secrets.fleet(kind)["certs"]["runner"] == ["runner"]
        assert "router.warmserve.svc" in make_secrets.fleet(kind)["certs"]["router"]


def test_signing_keys_are_per_publisher_ed25519(made):
    kind, out = made
    publishers = make_secrets.fleet(kind)["publishers"]
    assert "weights" in publishers and len(publishers) == len(set(publishers))
    for name in publishers:
        key = serialization.load_pem_private_key(_read(out, f"signing/{name}.key"), None)
        pub = serialization.load_pem_public_key(_read(out, f"trusted/{name}.pub"))
        assert isinstance(key, ed25519.Ed25519PrivateKey) and isinstance(pub, ed25519.Ed25519PublicKey)
        assert key.public_key().public_bytes_raw() == pub.public_bytes_raw(), name
        signer = SigningKey.load(out / f"signing/{name}.key")  # what the publishers and verifiers read
        trusted = TrustedKeys.load(out / "trusted")
        assert trusted.verify(b"payload", signer.sign(b"payload"), name) == signer.key_id


def test_no_other_user_of_the_host_reads_them(made):
    _, out = made
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for path in out.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.is_file() and os.geteuid() == 0 and not path.name.endswith((".pub", "ca.pem")):
            assert mode == 0o600 and (path.stat().st_uid == make_secrets.CONTAINER_UID
                                      or path.name == "ca.key"), path
        if path.is_file() and path.name == "ca.key" and os.geteuid() == 0:
            assert path.stat().st_uid == 0, "nothing mounts the CA's key: not the containers' user's"


def test_a_rerun_keeps_them_and_force_remakes_them(tmp_path):
    out = tmp_path / "s"
    assert make_secrets.prepare(out, log=lambda _m: None)
    before = _read(out, "tokens/admin.token")
    assert not make_secrets.prepare(out, log=lambda _m: None)
    assert _read(out, "tokens/admin.token") == before
    (out / "tokens/router.token").unlink()
    (out / "tokens/router.token").mkdir()  # what docker-compose 1.29 leaves for a missing secret file
    assert make_secrets.prepare(out, log=lambda _m: None)
    assert (out / "tokens/router.token").is_file() and _read(out, "tokens/admin.token") != before
    assert make_secrets.prepare(out, force=True, log=lambda _m: None)


def test_k8s_secrets_one_per_component(tmp_path):
    out = tmp_path / "k"
    make_secrets.prepare(out, "k8s", log=lambda _m: None)
    docs = make_secrets.k8s_secrets(out)
    assert [d["metadata"]["name"] for d in docs] == [f"warmserve-{c}" for c in
                                                     ("kernel-cache", "weights", "router", "runner", "openai")]
    for doc in docs:
        assert {"ca.pem", "tls.crt", "tls.key"} <= set(doc["data"]) and "ca.key" not in str(doc["data"])
        assert doc["metadata"]["namespace"] == "warmserve"
    yaml.safe_load_all(yaml.safe_dump_all(docs))
