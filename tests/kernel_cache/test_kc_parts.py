"""Fingerprint parts records in the kernel cache: stored beside the entry (disk ``parts.json``, an
S3 ``parts/`` object), returned by ``List(with_parts)``, checked on publish (a bad record is
INVALID_ARGUMENT and nothing is stored), bound to the key by its digest (so a signature over the
entry covers it, and verifiers of entries without one are unchanged)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest

import kernel_cache_service.keys as keys_module
from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.explain import ABSENT, differences, explain, one_line
from kernel_cache_service.fingerprint import program_parts
from kernel_cache_service.layout import PARTS_FILE
from kernel_cache_service.limits import MAX_PARTS_BYTES
from services.errors import InvalidArgument
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc
from services.signing import SigningKey, TrustedKeys

NAME = "llama.decode.aoti"
PLATFORM = {"machine": "x86_64", "system": "Linux", "isa": "AVX512", "device": "cpu"}


def record(threads: int = 2, name: str = NAME) -> dict:
    return program_parts(name, sources=[keys_module], layout={"block_size": 16, "kv_pools": [["k", 2, [16, 2, 8]]]},
                         arch={"family": "llama", "config": {"hidden_size": 32}}, dtype="float32",
                         compile_options={"mode": "aoti", "threads": threads, "environment": {}},
                         platform=PLATFORM, package_version="0.1.0", torch_version="2.13.0", python_version="3.11")


def text_of(doc: dict) -> str:
    """The canonical JSON, written independently of the code under test."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def key_of(doc: dict) -> str:
    return hashlib.sha256(text_of(doc).encode()).hexdigest()


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    path = tmp_path / "program.pt2"
    path.write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    return path


def _raw_publish(address: str, fp: str, parts: str, data: bytes = b"program") -> pb.PublishResponse:
    header = pb.PublishHeader(key=pb.ProgramKey(name=NAME, fingerprint=fp), size_bytes=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), producer="t", format="file",
                              fingerprint_parts=parts)
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.KernelCacheStub(channel).Publish(iter([pb.PublishRequest(header=header),
                                                              pb.PublishRequest(chunk=data)]))


def test_a_published_record_is_stored_beside_the_entry_and_listed_with_parts(store, artifact):
    doc = record()
    fp = key_of(doc)
    result = store.publish(NAME, fp, artifact, parts=json.dumps(doc, indent=2))  # any JSON form; kept canonical
    assert result.status == "PUBLISHED" and result.entry.parts == text_of(doc)
    assert store.list(NAME)[0].parts == ""  # not asked for: listings stay as cheap as before
    listed = store.list(NAME, with_parts=True)
    assert [(e.fingerprint, e.parts) for e in listed] == [(fp, text_of(doc))]
    if hasattr(store, "objects"):  # S3: an object of its own (metadata holds 2 KiB at most)
        got = store.objects.get_bytes(f"parts/{NAME}/{fp}")
        assert got is not None and got[1].decode() == text_of(doc)
        assert "parts" not in store.objects.head(f"entries/{NAME}/{fp}").metadata
    else:
        assert (store.root / "entries" / NAME / fp / PARTS_FILE).read_text() == text_of(doc)
    assert store.evict(NAME) == (1, artifact.stat().st_size)
    assert store.list(NAME, with_parts=True) == []
    if hasattr(store, "objects"):
        assert list(store.objects.list("parts/")) == []  # the record goes with its entry


def test_an_entry_without_a_record_lists_with_empty_parts(store, artifact):
    store.publish(NAME, "ab" * 32, artifact)
    assert [e.parts for e in store.list(NAME, with_parts=True)] == [""]


BAD_RECORDS = {
    "not JSON": lambda doc: "{not json",
    "not an object": lambda doc: "[1, 2]",
    "a null value": lambda doc: text_of({**doc, "dtype": None}),
    "NaN": lambda doc: text_of(doc).replace('"threads":2', '"threads":NaN'),
    "no sources": lambda doc: text_of({**doc, "sources": {}}),
    "a source hash that is not hex": lambda doc: text_of({**doc, "sources": {"m": "zz" * 32}}),
    "a missing part": lambda doc: text_of({k: v for k, v in doc.items() if k != "layout"}),
    "an unknown part": lambda doc: text_of({**doc, "port": 50051}),
    "an empty version": lambda doc: text_of({**doc, "torch": ""}),
    "another program's": lambda doc: text_of(record(name="llama.prefill.aoti")),
    "another key's": lambda doc: text_of(record(threads=3)),
    "too large": lambda doc: text_of({**doc, "arch": {"pad": "x" * MAX_PARTS_BYTES}}),
    "nested too deeply": lambda doc: "[" * 30_000 + "]" * 30_000,
}


@pytest.mark.parametrize("why", BAD_RECORDS)
def test_a_bad_record_is_invalid_argument_over_grpc_and_nothing_is_stored(grpc_cache, why):
    cache = grpc_cache()
    doc = record()
    fp = key_of(doc)
    parts = BAD_RECORDS[why](doc)
    with pytest.raises(grpc.RpcError) as e:
        _raw_publish(cache.address, fp, parts)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nothing was stored" in e.value.details()
    assert cache.store.list() == [] and list((cache.store.root / "tmp").iterdir()) == []
    assert _raw_publish(cache.address, fp, text_of(doc)).status == pb.PublishResponse.STATUS_PUBLISHED


def test_an_embedded_publish_checks_the_record_too(tmp_path, artifact):
    client = KernelCacheClient(root=tmp_path / "kc")
    doc = record()
    with pytest.raises(InvalidArgument, match="digest"):
        client.publish(NAME, key_of(record(threads=3)), artifact, parts=text_of(doc))
    assert client.list() == []


def test_a_record_of_another_schema_is_accepted_when_it_is_its_keys(grpc_cache):
    """A newer (or older) warmserve's record: its shape and its digest bind it to its key."""
    cache = grpc_cache()
    doc = {**record(), "schema": 99, "new_part": {"x": 1}}
    assert _raw_publish(cache.address, key_of(doc), text_of(doc)).status == pb.PublishResponse.STATUS_PUBLISHED


def test_a_client_publishes_the_record_it_computed_for_the_key(grpc_cache, artifact):
    """``known_parts``: a key computed by ``program_fingerprint`` in this process is published
    with its record without the caller passing it (the runner's publish path is unchanged)."""
    from kernel_cache_service.fingerprint import program_fingerprint

    doc = record(threads=5)
    fp = program_fingerprint(NAME, sources=[keys_module], layout=doc["layout"], arch=doc["arch"], dtype="float32",
                             compile_options=doc["compile_options"], platform=PLATFORM, package_version="0.1.0",
                             torch_version="2.13.0")
    doc["python"] = json.loads(text_of(doc))["python"]  # program_fingerprint takes this interpreter's
    cache = grpc_cache()
    client = KernelCacheClient(cache.address)
    assert client.publish(NAME, fp, artifact) == "PUBLISHED"
    (entry,) = client.list(NAME, with_parts=True)
    assert key_of(json.loads(entry.parts)) == fp and json.loads(entry.parts)["compile_options"]["threads"] == 5


def test_a_signed_entry_with_a_record_verifies_with_the_unchanged_payload(grpc_cache, artifact):
    """The signature covers name, fingerprint, sha256, size, format and producer as before; the
    record is covered through the fingerprint, which is its sha256."""
    key = SigningKey.generate()
    trusted = TrustedKeys([key.public_key()])
    cache = grpc_cache()
    doc = record()
    fp = key_of(doc)
    assert KernelCacheClient(cache.address, signing_key=key).publish(NAME, fp, artifact, parts=text_of(doc)) \
        == "PUBLISHED"
    reader = KernelCacheClient(cache.address, trusted_keys=trusted)
    (entry,) = reader.list(NAME, with_parts=True)
    old_payload = ("warmserve-program-v1\n" + json.dumps(
        {"name": NAME, "fingerprint": fp, "sha256": entry.sha256, "size_bytes": entry.size_bytes, "format": "file",
         "producer": entry.producer}, sort_keys=True, separators=(",", ":"))).encode()
    assert entry.signed_payload() == old_payload
    assert trusted.verify(old_payload, entry.signature, "entry") == key.key_id
    assert key_of(json.loads(entry.parts)) == entry.fingerprint
    assert reader.fetch(NAME, fp, artifact.with_name("out.pt2")) is not None and reader.refusals == []


def test_a_tampered_stored_record_is_never_used_to_explain(tmp_path, artifact):
    client = KernelCacheClient(root=tmp_path / "kc")
    doc = record()
    fp = key_of(doc)
    client.publish(NAME, fp, artifact, parts=text_of(doc))
    (tmp_path / "kc" / "entries" / NAME / fp / PARTS_FILE).write_text(text_of({**doc, "dtype": "bfloat16"}))
    e = client.explain(NAME, key_of(record(threads=3)), record(threads=3))
    assert e.nearest == () and e.without_parts == (fp,)
    assert "without fingerprint parts" in one_line(e)


def test_explain_names_the_nearest_entries_first_with_stored_and_wanted_values(tmp_path, artifact):
    client = KernelCacheClient(root=tmp_path / "kc")
    near, far = record(threads=3), {**record(threads=4), "dtype": "bfloat16"}
    for doc in (near, far):
        client.publish(NAME, key_of(doc), artifact, parts=text_of(doc))
    client.publish(NAME, "cd" * 32, artifact)  # an older warmserve's entry: no record
    client.publish("llama.prefill.aoti", key_of(record(name="llama.prefill.aoti")), artifact)
    wanted = record(threads=2)
    e = client.explain(NAME, key_of(wanted), wanted)
    assert not e.hit and e.without_parts == ("cd" * 32,)
    assert [n.entry.fingerprint for n in e.nearest] == [key_of(near), key_of(far)]
    assert [(d.path, d.stored, d.wanted) for d in e.nearest[0].differences] == [("compile_options.threads", 3, 2)]
    assert [(d.path, d.stored, d.wanted) for d in e.nearest[1].differences] == [
        ("compile_options.threads", 4, 2), ("dtype", "bfloat16", "float32")]
    assert one_line(e) == (f"MISS: nearest {NAME} entry {key_of(near)[:12]} differs in compile_options.threads "
                           "(3 -> 2)")
    assert client.explain(NAME, key_of(near), near).hit and one_line(client.explain(NAME, key_of(near), near)) == ""


def test_differences_name_sources_by_module_and_show_absent_leaves():
    a = {"sources": {"pkg.mod": "1" * 64}, "compile_options": {"environment": {}}}
    b = {"sources": {"pkg.mod": "2" * 64, "pkg.new": "3" * 64},
         "compile_options": {"environment": {"TORCHINDUCTOR_FREEZING": "1"}}}
    assert [(d.path, d.stored, d.wanted) for d in differences(b, a)] == [
        ("compile_options.environment.TORCHINDUCTOR_FREEZING", ABSENT, "1"),
        ("sources[pkg.mod]", "1" * 64, "2" * 64),
        ("sources[pkg.new]", ABSENT, "3" * 64),
    ]
    assert explain(NAME, "ee" * 32, b, []).nearest == ()


def test_the_one_line_summary_names_four_parts_then_says_how_many_more():
    stored = record()
    wanted = {**stored, "dtype": "bfloat16", "torch": "2.14.0", "python": "3.12", "warmserve": "0.2.0",
              "arch": {"family": "llama", "config": {"hidden_size": 64}}}
    entry = EntryInfo(NAME, key_of(stored), 1, "0" * 64, 1.0, "t", "file", parts=text_of(stored))
    line = one_line(explain(NAME, key_of(wanted), wanted, [entry]))
    assert line == (f"MISS: nearest {NAME} entry {key_of(stored)[:12]} differs in arch.config.hidden_size (32 -> 64), "
                    'dtype ("float32" -> "bfloat16"), python ("3.11" -> "3.12"), torch ("2.13.0" -> "2.14.0") '
                    f"and 1 more part (warmserve cache explain {NAME} {key_of(wanted)})")


def test_cache_explain_over_a_daemon_prints_each_differing_part(grpc_cache, artifact, tmp_path, capsys):
    from warmserve.cli import main

    cache = grpc_cache()
    stored, wanted = record(threads=4), record(threads=2)
    KernelCacheClient(cache.address).publish(NAME, key_of(stored), artifact, parts=text_of(stored))
    (tmp_path / "wanted.json").write_text(text_of(wanted))
    capsys.readouterr()
    assert main(["cache", "explain", "--parts", str(tmp_path / "wanted.json"), "--addr", cache.address]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"MISS {NAME}/{key_of(wanted)}; nearest entries of {NAME} (part: stored -> wanted):"
    assert out[1].startswith(f"  {key_of(stored)} (created ") and out[1].endswith("): 1 part differs")
    assert out[2:] == ["    compile_options.threads: 4 -> 2"]


def test_a_list_answer_carries_records_up_to_its_byte_budget(grpc_cache, artifact, monkeypatch):
    import kernel_cache_service.servicer as servicer

    docs = sorted((record(threads=t) for t in (2, 3)), key=key_of)  # List sorts by fingerprint
    monkeypatch.setattr(servicer, "MAX_LIST_PARTS_BYTES", len(text_of(docs[0])) + 10)
    cache = grpc_cache()
    client = KernelCacheClient(cache.address)
    for doc in docs:
        client.publish(NAME, key_of(doc), artifact, parts=text_of(doc))
    assert [e.parts for e in client.list(NAME, with_parts=True)] == [text_of(docs[0]), ""]
    assert [e.parts for e in client.list(NAME)] == ["", ""]
