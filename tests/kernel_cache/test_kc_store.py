"""The embedded store: round trips, keys, publish verification, integrity and quarantine, LRU
eviction under a byte budget with read leases. Every test taking the ``store`` fixture runs
against the disk store and the S3-backed store (``disk`` / ``s3``, see ``conftest.py``); damage is
done where each keeps its bytes for good (``_damage``). The budget and read-lease tests are about
the disk tier itself (its LRU in front of S3 is tested in ``test_kc_s3.py``)."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest
from kc_workers import tree_digest

from kernel_cache_service import artifact
from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.store import KernelStore
from services.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

BAD_KEYS = ["../x", "", "a" * 10_000, "a/b", ".", "..", "x..y", "x y", "caf\u00e9", "a\x00b"]


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _blob(store: KernelStore, name: str, fp: str) -> Path:
    return store.root / "entries" / name / fp / "blob"


def _s3_object(store, name: str, fp: str) -> tuple[object, str, str]:
    """``(boto3 client, bucket, key)`` of an S3-backed store's object for ``name``/``fp``."""
    from kernel_cache_service.s3_entries import entry_key

    objects = store.objects
    return objects.client, objects.location.bucket, objects.location.key(entry_key(name, fp))


def _damage(store, name: str, fp: str, damage) -> None:
    """Apply ``damage(path)`` to the bytes the store keeps for good: the disk store's blob; for
    the S3-backed store, the object in the bucket, rewritten behind the store's back with its
    metadata kept, after the local tier's copy is dropped (so the next read goes to the bucket,
    as it does on another host)."""
    if isinstance(store, KernelStore):
        damage(_blob(store, name, fp))
        return
    client, bucket, key = _s3_object(store, name, fp)
    meta = client.head_object(Bucket=bucket, Key=key)["Metadata"]
    path = store.root.parent / "damaged-object"
    path.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    damage(path)
    client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), Metadata=meta)
    store.local.evict(name, fp)


def _garble_manifest(store, name: str, fp: str) -> None:
    """Make the entry's manifest unreadable: the disk store's ``manifest.json``; the S3 object's
    metadata (rewritten, the local copy dropped)."""
    if isinstance(store, KernelStore):
        (store.root / "entries" / name / fp / "manifest.json").write_text("{not json")
        return
    client, bucket, key = _s3_object(store, name, fp)
    meta = client.head_object(Bucket=bucket, Key=key)["Metadata"]
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={**meta, "sha256": "{not json"})
    store.local.evict(name, fp)


def test_file_round_trip(store, tmp_path):
    data = os.urandom(300_000)
    src = _file(tmp_path, "prog.so", data)
    result = store.publish("llama.decode", "f1", src, producer="unit-test")
    assert result.status == "PUBLISHED"
    info = store.lookup("llama.decode", "f1")
    assert info is not None
    assert (info.name, info.fingerprint, info.size_bytes, info.sha256, info.format, info.producer) == (
        "llama.decode", "f1", len(data), hashlib.sha256(data).hexdigest(), "file", "unit-test")
    assert abs(info.created - time.time()) < 60 and info.last_access >= info.created
    out = tmp_path / "out.so"
    old_umask = os.umask(0o027)
    try:
        fetched = store.fetch("llama.decode", "f1", out)
    finally:
        os.umask(old_umask)
    assert fetched is not None and fetched.sha256 == info.sha256
    assert out.read_bytes() == data
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # 0o666 under umask 0o027
    assert [p.name for p in tmp_path.iterdir() if "warmserve" in p.name] == []  # no temp siblings


def test_directory_round_trip(store, tmp_path):
    src = tmp_path / "inductor-cache"
    (src / "fx" / "ab").mkdir(parents=True)
    (src / "fx" / "ab" / "kernel.so").write_bytes(os.urandom(50_000))
    (src / "fx" / "ab" / "kernel.cpp").write_text("// generated\n")
    (src / "empty").mkdir()
    (src / "latest").symlink_to("fx/ab/kernel.so")
    assert store.publish("llama.decode", "dir1", src).status == "PUBLISHED"
    info = store.lookup("llama.decode", "dir1")
    assert info.format == "dir"
    out = tmp_path / "restored"
    assert store.fetch("llama.decode", "dir1", out) is not None
    assert tree_digest(out) == tree_digest(src)
    assert (out / "empty").is_dir()
    assert os.readlink(out / "latest") == "fx/ab/kernel.so"
    # Fetching again over an existing directory swaps it whole (no stale files survive).
    (out / "stale.txt").write_text("old")
    assert store.fetch("llama.decode", "dir1", out) is not None
    assert not (out / "stale.txt").exists() and tree_digest(out) == tree_digest(src)


def test_several_fingerprints_per_name_and_prefix_listing(store, tmp_path):
    for i, name in enumerate(["llama.decode", "llama.decode", "llama.prefill", "qwen.decode"]):
        assert store.publish(name, f"fp{i}", _file(tmp_path, f"a{i}", bytes([i]) * (i + 1))).status == "PUBLISHED"
    assert [(e.name, e.fingerprint) for e in store.list("llama.")] == [
        ("llama.decode", "fp0"), ("llama.decode", "fp1"), ("llama.prefill", "fp2")]
    assert [e.size_bytes for e in store.list()] == [1, 2, 3, 4]
    s = store.stat()
    assert (s["entries"], s["total_bytes"], s["publishes"]) == (4, 10, 4)


def test_first_publisher_wins(store, tmp_path):
    assert store.publish("p", "f", _file(tmp_path, "a", b"first")).status == "PUBLISHED"
    again = store.publish("p", "f", _file(tmp_path, "b", b"second"))
    assert again.status == "ALREADY_PRESENT" and again.entry.sha256 == hashlib.sha256(b"first").hexdigest()
    store.fetch("p", "f", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"first"


@pytest.mark.parametrize("size,sha,data,why", [
    (5, hashlib.sha256(b"hello").hexdigest(), b"hell", "received 4 bytes"),
    (5, hashlib.sha256(b"hello").hexdigest(), b"hello!", "more bytes"),
    (5, hashlib.sha256(b"hellO").hexdigest(), b"hello", "sha256"),
])
def test_announced_size_and_sha_are_verified(store, size, sha, data, why):
    with store.begin_publish("p", "f", size=size, sha256=sha) as pending:
        pending.write(data[:3])
        pending.write(data[3:])
        result = pending.commit()
    assert result.status == "REJECTED" and why in result.reason
    assert store.lookup("p", "f") is None
    assert list((store.root / "tmp").iterdir()) == []


def test_abandoned_publish_leaves_nothing(store):
    with pytest.raises(RuntimeError):
        with store.begin_publish("p", "f") as pending:
            pending.write(b"partial")
            raise RuntimeError("writer failed")
    assert store.lookup("p", "f") is None
    assert list((store.root / "tmp").iterdir()) == []


@pytest.mark.parametrize("bad", BAD_KEYS, ids=[repr(k[:12]) for k in BAD_KEYS])
def test_bad_keys_are_invalid_argument(store, tmp_path, bad):
    src = _file(tmp_path, "a", b"x")
    for call in (lambda: store.lookup(bad, "f"), lambda: store.lookup("n", bad),
                 lambda: store.publish(bad, "f", src), lambda: store.publish("n", bad, src),
                 lambda: store.fetch(bad, "f", tmp_path / "o"), lambda: store.evict(bad),
                 lambda: store.begin_publish("n", bad)):
        with pytest.raises(InvalidArgument):
            call()
    assert not any((store.root / "entries").iterdir())


def test_an_empty_artifact_is_invalid_argument_and_leaves_nothing(store, tmp_path):
    empty = _file(tmp_path, "empty", b"")
    with pytest.raises(InvalidArgument, match="empty artifact"):
        store.publish("p", "f", empty)
    with pytest.raises(InvalidArgument, match="empty artifact"):
        store.precheck("p", "f", size=0)
    with pytest.raises(InvalidArgument, match="empty artifact"):
        with store.begin_publish("p", "f") as pending:  # no size announced, nothing written
            pending.commit()
    assert store.lookup("p", "f") is None
    assert list((store.root / "tmp").iterdir()) == [] and not any((store.root / "entries").iterdir())
    assert store.stat()["publishes"] == 0


@pytest.mark.parametrize("err,kind,words", [
    (errno.ENOSPC, ResourceExhausted, "no space left"),
    (errno.EROFS, FailedPrecondition, "cannot write"),
])
def test_a_failing_disk_is_one_clear_error_and_leaves_nothing(store, tmp_path, monkeypatch, err, kind, words):
    src = _file(tmp_path, "a", os.urandom(300_000))

    def write(self, data):  # the disk is full / read-only
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(artifact.HashingWriter, "write", write)
    with pytest.raises(kind, match=words) as e:
        store.publish("p", "f", src)
    assert "p/f" in str(e.value) and "nothing was stored" in str(e.value)
    monkeypatch.undo()
    assert store.lookup("p", "f") is None
    assert list((store.root / "tmp").iterdir()) == [] and not any((store.root / "entries").iterdir())
    assert store.publish("p", "f", src).status == "PUBLISHED"  # the store is fine afterwards


def test_publish_of_a_missing_path_is_invalid_argument(store, tmp_path):
    with pytest.raises(InvalidArgument, match="not a file or a directory"):
        store.publish("p", "f", tmp_path / "nope")


def test_flipped_byte_is_quarantined_and_reported_as_miss(store, tmp_path):
    data = os.urandom(200_000)
    store.publish("p", "f", _file(tmp_path, "a", data))
    _damage(store, "p", "f", lambda blob: _flip_byte(blob, 123_456))
    out = tmp_path / "out"
    assert store.fetch("p", "f", out) is None
    assert not out.exists()
    assert store.lookup("p", "f") is None
    assert store.list() == []
    quarantined = list((store.root / "quarantine").iterdir())
    assert len(quarantined) == 1
    assert "p/f" in (quarantined[0] / "reason.txt").read_text()
    s = store.stat()
    assert (s["quarantined"], s["entries"], s["hits"]) == (1, 0, 0)
    # The key can be published again, cleanly.
    assert store.publish("p", "f", _file(tmp_path, "b", data)).status == "PUBLISHED"
    assert store.fetch("p", "f", out) is not None and out.read_bytes() == data


@pytest.mark.parametrize("where", ["tar-header", "file-data"])
def test_flipped_byte_in_a_directory_artifact_is_caught(store, tmp_path, where):
    src = tmp_path / "d"
    src.mkdir()
    data = os.urandom(30_000)
    (src / "k.so").write_bytes(data)
    store.publish("p", "d", src)

    def flip(blob: Path) -> None:
        start = blob.read_bytes().find(data[:64])
        assert start > 0
        _flip_byte(blob, 100 if where == "tar-header" else start + 15_000)

    _damage(store, "p", "d", flip)
    assert store.fetch("p", "d", tmp_path / "out") is None
    assert not (tmp_path / "out").exists()
    assert store.stat()["quarantined"] == 1


@pytest.mark.parametrize("damage", ["truncate", "manifest"])
def test_truncated_blob_or_bad_manifest_is_quarantined_on_lookup(store, tmp_path, damage):
    store.publish("p", "f", _file(tmp_path, "a", b"0123456789"))
    if damage == "truncate":
        _damage(store, "p", "f", lambda blob: os.truncate(blob, 4))
    else:
        _garble_manifest(store, "p", "f")
    assert store.lookup("p", "f") is None
    assert store.stat()["quarantined"] == 1
    assert not (store.root / "entries/p/f").exists()


def _publish_sized(store, tmp_path, fp, size):
    return store.publish("p", fp, _file(tmp_path, fp, bytes([len(fp)]) * size))


def test_lru_eviction_keeps_the_store_under_budget(tmp_path):
    store = KernelStore(tmp_path / "root", max_bytes=250_000)
    for fp in ("a", "b"):
        assert _publish_sized(store, tmp_path, fp, 100_000).status == "PUBLISHED"
        time.sleep(0.01)
    store.lookup("p", "a")  # "a" is now more recently used than "b"
    time.sleep(0.01)
    assert _publish_sized(store, tmp_path, "c", 100_000).status == "PUBLISHED"
    assert [e.fingerprint for e in store.list()] == ["a", "c"]
    s = store.stat()
    assert s["total_bytes"] == 200_000 <= s["max_bytes"] and s["evictions"] == 1
    for fp in ("d", "e", "f"):
        time.sleep(0.01)
        _publish_sized(store, tmp_path, fp, 120_000)
        assert store.stat()["total_bytes"] <= 250_000
    assert [e.fingerprint for e in store.list()] == ["e", "f"]
    too_big = _publish_sized(store, tmp_path, "g", 250_001)
    assert too_big.status == "REJECTED" and "budget" in too_big.reason


def test_eviction_never_removes_an_entry_being_read(tmp_path):
    store = KernelStore(tmp_path / "root", max_bytes=250_000)
    _publish_sized(store, tmp_path, "a", 100_000)
    time.sleep(0.01)
    _publish_sized(store, tmp_path, "b", 100_000)
    with store.open("p", "a") as reader:  # "a" is the LRU entry, but it is being read
        time.sleep(0.01)
        store.lookup("p", "b")
        assert _publish_sized(store, tmp_path, "c", 100_000).status == "PUBLISHED"
        assert [e.fingerprint for e in store.list()] == ["a", "c"]  # "b" went instead
        assert b"".join(reader.chunks(7_000)) == bytes([1]) * 100_000
        assert store.evict("p", "a") == (0, 0)  # explicit evict skips it too
        with store.open("p", "c"):
            full = _publish_sized(store, tmp_path, "d", 100_000)
            assert full.status == "REJECTED" and "being read" in full.reason
        assert store.stat()["total_bytes"] <= 250_000
    assert store.evict("p", "a") == (1, 100_000)


def test_eviction_respects_a_read_lease_held_by_another_process(tmp_path, worker):
    root = tmp_path / "root"
    store = KernelStore(root, max_bytes=150_000)
    _publish_sized(store, tmp_path, "a", 100_000)
    proc, line = worker("hold-read", str(root), "p", "a")
    assert line == "ready"
    assert store.evict("p", "a") == (0, 0)
    rejected = _publish_sized(store, tmp_path, "b", 100_000)
    assert rejected.status == "REJECTED"
    assert [e.fingerprint for e in store.list()] == ["a"]
    proc.stdin.close()  # the reader finishes and drops its lease
    assert proc.wait(timeout=30) == 0
    assert _publish_sized(store, tmp_path, "b", 100_000).status == "PUBLISHED"
    assert [e.fingerprint for e in store.list()] == ["b"]


def test_evict_forms(store, tmp_path):
    for fp in ("a", "b"):
        _publish_sized(store, tmp_path, fp, 10)
    store.publish("q", "a", _file(tmp_path, "q", b"12345"))
    assert store.evict("p", "a") == (1, 10)
    assert store.evict("p", "zzz") == (0, 0)
    assert store.evict("p") == (1, 10)
    assert store.evict(all=True) == (1, 5)
    assert store.list() == []
    with pytest.raises(InvalidArgument):
        store.evict()
    with pytest.raises(InvalidArgument):
        store.evict("p", all=True)
    with pytest.raises(InvalidArgument):
        store.evict(None, "a")


def test_a_live_publish_is_not_swept_by_another_store_starting(tmp_path):
    root = tmp_path / "root"
    writer = KernelStore(root)
    data = b"compiled" * 1000
    with writer.begin_publish("p", "f", size=len(data), sha256=hashlib.sha256(data).hexdigest()) as pending:
        pending.write(data[:100])
        other = KernelStore(root)  # another process starting up on the same root
        assert other.swept == 0
        pending.write(data[100:])
        assert pending.commit().status == "PUBLISHED"
    assert other.lookup("p", "f").size_bytes == len(data)


def test_embedded_client_matches_the_store(tmp_path):
    client = KernelCacheClient(root=tmp_path / "root", max_bytes=1000)
    src = _file(tmp_path, "a", b"abc")
    assert client.publish("p", "f", src) == "PUBLISHED"
    assert client.publish("p", "f", src) == "ALREADY_PRESENT"
    assert client.lookup("p", "f").size_bytes == 3
    assert client.fetch("p", "f", tmp_path / "o").sha256 == hashlib.sha256(b"abc").hexdigest()
    assert client.stat()["max_bytes"] == 1000
    assert client.evict("p") == (1, 3)
    with pytest.raises(InvalidArgument):
        KernelCacheClient("127.0.0.1:1", root=tmp_path)


def test_client_without_address_or_root_uses_the_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSERVE_HOME", str(tmp_path / "home"))
    client = KernelCacheClient()
    assert client.stat()["root"] == str(tmp_path / "home" / "kernel-cache")


def _tar_with(member: str, *, link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(member)
        if link is None:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
        else:
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
    return buf.getvalue()


def _publish_blob(store, fp: str, blob: bytes) -> None:
    with store.begin_publish("p", fp, fmt="dir", size=len(blob), sha256=hashlib.sha256(blob).hexdigest()) as pending:
        pending.write(blob)
        assert pending.commit().status == "PUBLISHED"  # the store does not parse artifacts


@pytest.mark.parametrize("blob", [
    pytest.param(_tar_with("../evil.txt"), id="parent-traversal"),
    pytest.param(_tar_with("lnk", link="/etc/passwd"), id="absolute-symlink"),
    pytest.param(_tar_with("lnk", link="../../outside"), id="escaping-symlink"),
    pytest.param(b"this is not a tar archive at all" * 100, id="not-a-tar"),
])
def test_a_hostile_or_broken_directory_artifact_is_refused_and_quarantined(store, tmp_path, blob):
    _publish_blob(store, "evil", blob)
    dest = tmp_path / "a" / "b"
    dest.parent.mkdir()
    assert store.fetch("p", "evil", dest) is None
    assert list(dest.parent.iterdir()) == [] and not (tmp_path / "evil.txt").exists()
    assert store.lookup("p", "evil") is None and store.stat()["quarantined"] == 1


def test_absolute_member_names_stay_inside_dest(store, tmp_path):
    _publish_blob(store, "abs", _tar_with("/tmp/warmserve-evil-abs.txt"))
    dest = tmp_path / "out"
    assert store.fetch("p", "abs", dest) is not None
    assert (dest / "tmp" / "warmserve-evil-abs.txt").read_bytes() == b"evil"
    assert not Path("/tmp/warmserve-evil-abs.txt").exists()
