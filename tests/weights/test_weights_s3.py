"""Sidecars shared through an S3 bucket (``weights serve --store``), against a real S3 server
(moto) on loopback: host A packs and uploads, host B (another root, no shared disk) fetches,
verified, and packs nothing; a corrupt remote sidecar is dropped and packed again; a changed
checkpoint is never served a stale sidecar; an unreachable bucket only costs a pack."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from weights_tiny import write_tiny_checkpoint

import weight_service.prepare as prepare_module
from services.bootstrap import ServerConfig
from services.s3 import ObjectStore
from services.s3_location import S3Location, make_client
from weight_service.client import WeightsClient
from weight_service.s3_sidecars import FOLDER, RemoteSidecars
from weight_service.servicer import build_server
from weight_service.sidecar import validate_sidecar

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    write_tiny_checkpoint(tmp_path / "ckpt", shards=2, tied=False, tokenizer=True)
    return tmp_path / "ckpt"


@pytest.fixture
def packs(monkeypatch) -> list[str]:
    """Every pack ``prepare`` runs in this process, by sidecar directory name."""
    done: list[str] = []
    real = prepare_module.pack_sidecar

    def counting(src, family, dtype, directory, emit):
        done.append(Path(directory).parent.name)
        return real(src, family, dtype, directory, emit)

    monkeypatch.setattr(prepare_module, "pack_sidecar", counting)
    return done


@pytest.fixture
def host(tmp_path, s3):
    """Factory: ``host(name)`` starts a Weights server whose sidecar root is ``tmp_path/name``
    (its own disk), sharing the test's bucket; returns ``(client, root)``."""
    started = []

    def start(name: str) -> tuple[WeightsClient, Path]:
        root = tmp_path / name
        server = build_server(ServerConfig(service="weights", port=0), root, RemoteSidecars.open_url(s3.url),
                              model_roots=[tmp_path])
        server.start()
        client = WeightsClient(server.address)
        started.append((server, client))
        return client, root

    yield start
    for server, client in started:
        client.close()
        server.stop()


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if not p.name.startswith(".")}


def test_a_second_host_fetches_the_sidecar_and_packs_nothing(tmp_path, s3, host, ckpt, packs):
    client_a, root_a = host("host-a")
    handle_a = client_a.prepare(str(ckpt), dtype="bf16")
    assert handle_a.state == "BUILT" and packs == ["host-a"]
    files_a = _digests(handle_a.path)
    assert set(files_a) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    keys = s3.keys()  # one manifest naming one upload of every file
    assert len(keys) == len(files_a) + 1 and keys[0].startswith(f"team/{FOLDER}/{handle_a.path.name}/")
    manifest = [k for k in keys if k.endswith("/manifest.json")]
    assert len(manifest) == 1
    for name, digest in files_a.items():
        obj = next(k for k in keys if k.endswith(f"/{name}"))
        assert s3.client.head_object(Bucket=s3.bucket, Key=obj)["Metadata"]["sha256"] == digest

    client_b, root_b = host("host-b")
    events = []
    handle_b = client_b.prepare(str(ckpt), dtype="bf16", progress=events.append)
    assert packs == ["host-a"]  # host B packed nothing
    assert handle_b.state in ("HOT", "COLD") and handle_b.state != "BUILT"
    assert handle_b.path == root_b / handle_a.path.name and handle_b.fingerprint == handle_a.fingerprint
    assert _digests(handle_b.path) == files_a  # byte for byte what host A packed
    assert [e.message for e in events if e.phase == "fetch"][-1] == f"fetched from {s3.url}/{FOLDER}"
    assert validate_sidecar(handle_b.path, fingerprint=handle_a.fingerprint).size_bytes == handle_a.size_bytes
    # A runner of host B gets it through host B's service, as from a local pack.
    fetched = client_b.fetch(handle_b, tmp_path / "runner-b")
    assert _digests(fetched) == files_a
    assert client_b.prepare(str(ckpt), dtype="bf16").state in ("HOT", "COLD") and packs == ["host-a"]
    assert s3.keys() == keys  # nothing uploaded twice


def _records(caplog, logger: str) -> list[logging.LogRecord]:
    """The captured records of ``logger`` at WARNING or above: other loggers (botocore's INFO
    lines, when an earlier test left the root logger at INFO) are not what these tests check."""
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def test_a_corrupt_remote_sidecar_is_dropped_and_packed_again(tmp_path, s3, host, ckpt, packs, caplog):
    client_a, _ = host("host-a")
    handle_a = client_a.prepare(str(ckpt), dtype="f32")
    weights = next(k for k in s3.keys() if k.endswith("/model.safetensors"))
    meta = s3.client.head_object(Bucket=s3.bucket, Key=weights)["Metadata"]
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=weights)["Body"].read())
    body[-5] ^= 0xFF  # a flipped byte in a tensor: the header still parses
    s3.client.put_object(Bucket=s3.bucket, Key=weights, Body=bytes(body), Metadata=meta)

    client_c, root_c = host("host-c")
    with caplog.at_level(logging.WARNING, logger="weight_service.s3_sidecars"):
        handle_c = client_c.prepare(str(ckpt), dtype="f32")
    records = _records(caplog, "weight_service.s3_sidecars")
    assert [r.getMessage() for r in records] == ["dropped a corrupt remote sidecar; packing instead"]
    assert "model.safetensors" in records[0].reason and "metadata says" in records[0].reason
    assert handle_c.state == "BUILT" and packs == ["host-a", "host-c"]  # never served the corrupt bytes
    assert _digests(handle_c.path) == _digests(handle_a.path)
    assert weights not in s3.keys()  # the corrupt upload is gone; host C's own replaced it

    client_d, _ = host("host-d")
    handle_d = client_d.prepare(str(ckpt), dtype="f32")
    assert handle_d.state != "BUILT" and packs == ["host-a", "host-c"]
    assert _digests(handle_d.path) == _digests(handle_a.path)


def test_a_changed_checkpoint_is_packed_not_served_a_stale_sidecar(s3, host, ckpt, packs):
    client_a, _ = host("host-a")
    old = client_a.prepare(str(ckpt), dtype="f32")
    shard = next(ckpt.glob("model-*.safetensors"))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the checkpoint changed since
    client_b, _ = host("host-b")
    new = client_b.prepare(str(ckpt), dtype="f32")
    assert new.state == "BUILT" and packs == ["host-a", "host-b"]
    assert new.fingerprint != old.fingerprint
    assert len([k for k in s3.keys() if k.endswith("/manifest.json")]) == 2  # one per checkpoint state


def test_an_unreachable_bucket_costs_a_pack_not_the_prepare(tmp_path, s3, ckpt, packs, caplog):
    os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1"  # restored by the s3 fixture
    os.environ["AWS_MAX_ATTEMPTS"] = "1"
    try:
        remote = RemoteSidecars(ObjectStore(S3Location(s3.bucket, f"team/{FOLDER}"), make_client()))
    finally:
        del os.environ["AWS_MAX_ATTEMPTS"]
    with caplog.at_level(logging.WARNING, logger="weight_service.prepare"):
        handle = prepare_module.prepare(str(ckpt), dtype="f32", root=tmp_path / "root", remote=remote)
    assert handle.state == "BUILT" and packs == ["root"]
    records = _records(caplog, "weight_service.prepare")
    assert [r.getMessage() for r in records] == [
        "could not fetch the sidecar from the object store; packing it here",
        "could not upload the sidecar to the object store; it serves from this host only"]
    assert "127.0.0.1:1" in records[0].error


def test_weights_serve_refuses_a_missing_bucket_with_exit_2(tmp_path, s3):
    out = subprocess.run([sys.executable, "-m", "warmserve.cli", "weights", "serve", "--root", str(tmp_path / "r"),
                          "--port", "0", "--store", "s3://warmserve-no-such-bucket/x"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr
    last = out.stderr.splitlines()[-1]
    assert last.startswith("warmserve: error: cannot use the object store") and "does not exist" in last
