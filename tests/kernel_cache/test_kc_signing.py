"""Signed kernel-cache entries: the publisher's signature is stored beside the entry (disk
manifest, S3 object metadata), returned by Lookup/Fetch/List, and a client with trusted keys
refuses a tampered, unsigned or foreign-signed entry before writing a byte of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.layout import BLOB, MANIFEST
from services.errors import InvalidArgument, Untrusted
from services.proto import kernel_cache_pb2 as pb
from services.signing import SigningKey, TrustedKeys

FP = "ab" * 32
NAME = "llama.decode.aoti"


@pytest.fixture
def keys():
    key = SigningKey.generate()
    return key, TrustedKeys([key.public_key()])


def _artifact(tmp_path: Path, data: bytes = b"\x7fELF" + bytes(range(256)) * 16) -> Path:
    path = tmp_path / "program.pt2"
    path.write_bytes(data)
    return path


def _entry_dir(root: Path) -> Path:
    return root / "entries" / NAME / FP


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def _assert_verifies(entry: EntryInfo, trusted: TrustedKeys, key: SigningKey) -> None:
    assert entry.signature.startswith(key.key_id + ":")
    assert trusted.verify(entry.signed_payload(), entry.signature, "entry") == key.key_id


@pytest.mark.parametrize("backend", ["disk", "s3"])
def test_a_signed_publish_is_returned_by_lookup_list_and_fetch_over_grpc(tmp_path, grpc_cache, keys, backend,
                                                                          request):
    key, trusted = keys
    url = request.getfixturevalue("s3").url if backend == "s3" else None
    cache = grpc_cache(store=url)
    publisher = KernelCacheClient(cache.address, signing_key=key)
    assert publisher.publish(NAME, FP, _artifact(tmp_path), producer="runner-0@h:1") == "PUBLISHED"
    reader = KernelCacheClient(cache.address, trusted_keys=trusted)
    _assert_verifies(reader.lookup(NAME, FP), trusted, key)
    _assert_verifies(reader.list(NAME)[0], trusted, key)
    got = reader.fetch(NAME, FP, tmp_path / "out.pt2")
    _assert_verifies(got, trusted, key)
    assert (tmp_path / "out.pt2").read_bytes() == _artifact(tmp_path).read_bytes() and reader.refusals == []
    if url:  # the signature lives in the object's metadata: a second daemon, fresh local tier, has it
        other = grpc_cache(store=url, root=tmp_path / "second-tier")
        _assert_verifies(KernelCacheClient(other.address).lookup(NAME, FP), trusted, key)
    else:  # beside the entry, in the manifest written atomically with it
        doc = json.loads((_entry_dir(cache.store.root) / MANIFEST).read_text())
        assert doc["signature"] == got.signature


def test_an_embedded_signed_publish_signs_at_commit_and_an_unsigned_one_keeps_the_old_manifest(tmp_path, keys):
    key, trusted = keys
    signed = KernelCacheClient(root=tmp_path / "kc", signing_key=key)
    assert signed.publish(NAME, FP, _artifact(tmp_path)) == "PUBLISHED"
    _assert_verifies(signed.lookup(NAME, FP), trusted, key)
    plain = KernelCacheClient(root=tmp_path / "kc2")
    plain.publish(NAME, FP, _artifact(tmp_path))
    assert plain.lookup(NAME, FP).signature == ""
    assert "signature" not in json.loads((_entry_dir(tmp_path / "kc2") / MANIFEST).read_text())


def test_without_trusted_keys_nothing_is_verified(tmp_path):
    KernelCacheClient(root=tmp_path / "kc").publish(NAME, FP, _artifact(tmp_path))
    assert KernelCacheClient(root=tmp_path / "kc").fetch(NAME, FP, tmp_path / "out") is not None


def _tampered(tmp_path: Path, key: SigningKey, how: str) -> Path:
    root = tmp_path / "kc"
    KernelCacheClient(root=root, signing_key=key).publish(NAME, FP, _artifact(tmp_path))
    d = _entry_dir(root)
    doc = json.loads((d / MANIFEST).read_text())
    if how == "blob":  # the bytes and the manifest's sha256 both rewritten: only the signature tells
        _flip_byte(d / BLOB, 100)
        import hashlib

        doc["sha256"] = hashlib.sha256((d / BLOB).read_bytes()).hexdigest()
    elif how == "signature":
        kid, b64 = doc["signature"].split(":")
        doc["signature"] = f"{kid}:{b64[:10]}{'A' if b64[10] != 'A' else 'B'}{b64[11:]}"
    elif how == "producer":
        doc["producer"] = "someone-else"
    elif how == "unsigned":
        doc.pop("signature")
    (d / MANIFEST).write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize("how", ["blob", "signature", "producer", "unsigned"])
def test_a_tampered_entry_is_refused_before_anything_is_written(tmp_path, keys, how):
    key, trusted = keys
    root = _tampered(tmp_path, key, how)
    reader = KernelCacheClient(root=root, trusted_keys=trusted)
    with pytest.raises(Untrusted):
        reader.fetch(NAME, FP, tmp_path / "out.pt2")
    assert not (tmp_path / "out.pt2").exists()
    assert [p.name for p in tmp_path.iterdir() if "warmserve" in p.name] == []
    assert len(reader.refusals) == 1


def test_an_entry_signed_by_an_untrusted_key_is_refused_over_grpc(tmp_path, grpc_cache, keys):
    _key, trusted = keys
    cache = grpc_cache()
    KernelCacheClient(cache.address, signing_key=SigningKey.generate()).publish(NAME, FP, _artifact(tmp_path))
    reader = KernelCacheClient(cache.address, trusted_keys=trusted)
    with pytest.raises(Untrusted, match="not trusted"):
        reader.fetch(NAME, FP, tmp_path / "out.pt2")
    assert not (tmp_path / "out.pt2").exists()


def test_a_directory_entry_is_verified_whole_before_it_is_unpacked(tmp_path, keys, monkeypatch):
    key, trusted = keys
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.so").write_bytes(b"x" * 5000)
    root = tmp_path / "kc"
    KernelCacheClient(root=root, signing_key=key).publish(NAME, FP, src)
    _flip_byte(_entry_dir(root) / BLOB, 2000)  # inside a.so's data: the tar itself still parses
    import tarfile

    def never(*a, **k):
        raise AssertionError("unverified bytes were unpacked")

    monkeypatch.setattr(tarfile, "open", never)
    assert KernelCacheClient(root=root, trusted_keys=trusted).fetch(NAME, FP, tmp_path / "out") is None
    assert not (tmp_path / "out").exists()


def test_a_malformed_signature_in_the_publish_header_is_invalid_argument(tmp_path, grpc_cache):
    import grpc

    from services.proto import kernel_cache_pb2_grpc as pb_grpc

    cache = grpc_cache()
    data = _artifact(tmp_path).read_bytes()
    import hashlib

    header = pb.PublishHeader(key=pb.ProgramKey(name=NAME, fingerprint=FP), size_bytes=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), format="file", signature="not-a-signature")
    stub = pb_grpc.KernelCacheStub(grpc.insecure_channel(cache.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.Publish(iter([pb.PublishRequest(header=header), pb.PublishRequest(chunk=data)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert KernelCacheClient(cache.address).lookup(NAME, FP) is None
    with pytest.raises(InvalidArgument):
        cache.store.begin_publish(NAME, FP, signature="x:y")
