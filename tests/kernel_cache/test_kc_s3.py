"""The S3-backed kernel cache beyond the shared contract tests (those run against it through the
``store`` fixture): two daemons that share nothing but a bucket, a corrupt object in the bucket,
the local tier's read-through and LRU bound, a bucket that fails mid-publish, and ``cache serve
--store`` refusing bad stores. The bucket is a real S3 server (moto) on loopback."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kc_workers import REPO, child_env

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.s3_entries import entry_key
from kernel_cache_service.s3_store import S3KernelStore
from services.errors import Unavailable
from services.s3 import ObjectStore
from services.s3_location import S3Location, make_client

NAME = "llama.decode.aoti"


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _object_key(s3, name: str, fp: str) -> str:
    return f"{s3.prefix}/kernel-cache/{entry_key(name, fp)}"


def test_two_daemons_share_programs_through_the_bucket_only(tmp_path, s3, daemon):
    """Two ``cache serve --store`` processes with their own roots (two hosts): what one publishes,
    the other serves, fetched from the bucket on first use and from its own disk after that."""
    a, b = daemon("--store", s3.url), daemon("--store", s3.url)
    data = os.urandom(300_000)
    with KernelCacheClient(a.address) as host_a, KernelCacheClient(b.address) as host_b:
        assert host_a.publish(NAME, "f1", _file(tmp_path, "prog.so", data), producer="host-a") == "PUBLISHED"
        assert host_b.lookup(NAME, "f1").sha256 == hashlib.sha256(data).hexdigest()
        assert host_b.fetch(NAME, "f1", tmp_path / "out-b").size_bytes == len(data)
        assert (tmp_path / "out-b").read_bytes() == data
        assert host_b.publish(NAME, "f1", _file(tmp_path, "other.so", b"other bytes")) == "ALREADY_PRESENT"
        assert [(e.name, e.fingerprint, e.producer) for e in host_b.list()] == [(NAME, "f1", "host-a")]
        stat_b = host_b.stat()
    # hits: the lookup, the fetch, and the lookup the client makes before a publish
    assert (stat_b["hits"], stat_b["misses"], stat_b["publishes"], stat_b["entries"]) == (3, 0, 0, 1)
    assert (b.root / "entries" / NAME / "f1" / "blob").read_bytes() == data  # the local tier holds a copy
    assert s3.keys() == [_object_key(s3, NAME, "f1")]


def test_a_corrupt_object_is_reported_and_never_served(tmp_path, s3, grpc_cache, caplog):
    """Bytes overwritten in the bucket behind the daemons' backs (metadata kept): a host that reads
    them answers NOT_FOUND (a MISS), logs a warning, keeps the bytes in its quarantine and drops
    the object; the key is then built again. The host that published keeps serving its own
    verified copy."""
    a, b = grpc_cache(store=s3.url), grpc_cache(store=s3.url)
    data = os.urandom(200_000)
    key = _object_key(s3, NAME, "f1")
    with KernelCacheClient(a.address) as host_a, KernelCacheClient(b.address) as host_b:
        assert host_a.publish(NAME, "f1", _file(tmp_path, "prog.so", data)) == "PUBLISHED"
        meta = s3.client.head_object(Bucket=s3.bucket, Key=key)["Metadata"]
        bad = bytearray(data)
        bad[123_456] ^= 0xFF
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(bad), Metadata=meta)

        with caplog.at_level(logging.WARNING, logger="kernel_cache_service.s3_read_through"):
            assert host_b.fetch(NAME, "f1", tmp_path / "out-b") is None  # NOT_FOUND over gRPC
        assert not (tmp_path / "out-b").exists()
        warnings = [r for r in caplog.records if r.getMessage() == "quarantined corrupt entry from the object store"]
        assert len(warnings) == 1 and "sha256" in warnings[0].reason
        assert s3.keys() == []  # dropped from the bucket: no host reads it again
        quarantined = list((b.store.root / "quarantine").iterdir())
        assert len(quarantined) == 1 and (quarantined[0] / "blob").read_bytes() == bytes(bad)
        assert f"{NAME}/f1" in (quarantined[0] / "reason.txt").read_text()
        assert host_b.lookup(NAME, "f1") is None
        stat_b = host_b.stat()
        assert (stat_b["quarantined"], stat_b["hits"], stat_b["entries"]) == (1, 0, 0)
        assert list((b.store.root / "entries").iterdir()) == []

        # The publisher still holds its verified copy; a claim on the other host builds it again.
        assert host_a.fetch(NAME, "f1", tmp_path / "out-a") is not None
        assert (tmp_path / "out-a").read_bytes() == data
        handle = host_b.claim(NAME, "f1", holder="runner-b")
        assert handle.status == "OWNER"
        assert host_b.publish(NAME, "f1", _file(tmp_path, "rebuilt.so", data)) == "PUBLISHED"
    assert s3.keys() == [key]


def test_the_local_tier_reads_through_and_stays_under_its_budget(tmp_path, s3):
    """Host B's tier (250 kB) fetches what host A published on first use, verified, then serves
    it from disk; least recently used copies go first; an evicted copy is fetched again."""
    host_a = S3KernelStore.open_url(s3.url, tmp_path / "a")
    blobs = {fp: bytes([i + 1]) * 100_000 for i, fp in enumerate("abc")}
    for fp, body in blobs.items():
        assert host_a.publish("p", fp, _file(tmp_path, f"src-{fp}", body)).status == "PUBLISHED"
    host_b = S3KernelStore.open_url(s3.url, tmp_path / "b", max_bytes=250_000)
    assert host_b.stat()["entries"] == 0
    for fp in ("a", "b"):
        assert host_b.fetch("p", fp, tmp_path / f"out-{fp}").sha256 == hashlib.sha256(blobs[fp]).hexdigest()
        time.sleep(0.01)
    assert host_b.lookup("p", "a") is not None  # "a" is now more recently used than "b"
    time.sleep(0.01)
    assert host_b.fetch("p", "c", tmp_path / "out-c") is not None
    assert [e.fingerprint for e in host_b.local.list()] == ["a", "c"]  # "b" went: least recently used
    s = host_b.stat()
    assert (s["entries"], s["total_bytes"], s["evictions"], s["max_bytes"]) == (2, 200_000, 1, 250_000)
    assert [e.fingerprint for e in host_b.list()] == ["a", "b", "c"]  # all still in the bucket
    assert host_b.fetch("p", "b", tmp_path / "again-b") is not None  # fetched again, verified
    assert (tmp_path / "again-b").read_bytes() == blobs["b"]
    assert host_b.stat()["total_bytes"] <= 250_000
    assert (host_b.stat()["hits"], host_b.stat()["misses"]) == (5, 0)
    assert list((tmp_path / "b" / "tmp").iterdir()) == []


def test_a_tier_without_room_serves_a_verified_copy_and_keeps_nothing(tmp_path, s3):
    """Every copy in the local tier is being read: a read of another entry is served from a
    verified temporary copy, which is removed afterwards; the tier stays within its budget."""
    host_a = S3KernelStore.open_url(s3.url, tmp_path / "a")
    for fp, byte in (("a", 1), ("b", 2)):
        host_a.publish("p", fp, _file(tmp_path, f"src-{fp}", bytes([byte]) * 100_000))
    host_b = S3KernelStore.open_url(s3.url, tmp_path / "b", max_bytes=150_000)
    with host_b.open("p", "a") as reading:
        assert host_b.fetch("p", "b", tmp_path / "out-b") is not None
        assert (tmp_path / "out-b").read_bytes() == bytes([2]) * 100_000
        assert b"".join(reading.chunks()) == bytes([1]) * 100_000
    assert [e.fingerprint for e in host_b.local.list()] == ["a"]
    assert list((tmp_path / "b" / "tmp").iterdir()) == []


def test_an_unreachable_bucket_fails_a_publish_and_stores_nothing(tmp_path, s3):
    """The endpoint goes away after the store opened: a publish is UNAVAILABLE with one sentence,
    and neither the bucket nor the local tier keeps anything of it."""
    os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1"  # restored by the s3 fixture
    dead = ObjectStore(S3Location(s3.bucket, "team/kernel-cache"), make_client())
    store = S3KernelStore(tmp_path / "root", objects=dead)
    data = os.urandom(50_000)
    with pytest.raises(Unavailable, match="nothing was stored") as e:
        store.publish("p", "f", _file(tmp_path, "a", data))  # refused at the existence check
    assert "127.0.0.1:1" in str(e.value)
    with pytest.raises(Unavailable, match="nothing was stored") as e:  # refused at the upload itself
        with store.begin_publish("p", "f", size=len(data), sha256=hashlib.sha256(data).hexdigest()) as pending:
            pending.write(data)
            pending.commit()
    assert "publishing p/f" in str(e.value)
    assert list((tmp_path / "root" / "tmp").iterdir()) == [] and list((tmp_path / "root" / "entries").iterdir()) == []
    assert s3.keys() == []


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmserve.cli", *args, "--port", "0"], capture_output=True,
                          text=True, timeout=120, env=env or child_env(), cwd=REPO)


@pytest.mark.parametrize("store, needle", [  # every malformed URL: tests/services/test_s3.py
    ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
    ("s3://warmserve-no-such-bucket/x", "does not exist"),
])
def test_cache_serve_refuses_a_bad_store_with_exit_2(tmp_path, s3, store, needle):
    out = _serve("cache", "serve", "--root", str(tmp_path / "root"), "--store", store)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1].startswith("warmserve: error: ") and needle in out.stderr.splitlines()[-1]


def test_cache_serve_refuses_an_unreachable_endpoint_with_exit_2(tmp_path, s3):
    env = dict(child_env(), AWS_ENDPOINT_URL="http://127.0.0.1:1", AWS_MAX_ATTEMPTS="1")
    out = _serve("cache", "serve", "--root", str(tmp_path / "root"), "--store", s3.url, env=env)
    assert out.returncode == 2, out.stderr
    assert "127.0.0.1:1" in out.stderr and "cannot use the object store" in out.stderr, out.stderr
