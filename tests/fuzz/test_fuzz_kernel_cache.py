"""Fuzzing every RPC of ``warmserve.v1.KernelCache`` over real gRPC on loopback: random and
adversarial messages, publishes whose chunks run past (or short of) the declared size, client
streams cut off, server streams cancelled, messages over the size limit. Each answer is a
documented status, the cache keeps serving, and nothing is written to the store except by a
publish it answered PUBLISHED (no leftover temp file)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from fuzz_harness import (
    C,
    Case,
    assert_serving,
    batches,
    cases,
    check_status,
    fuzz_channel,
    fuzz_settings,
    run_case,
    wait_until,
)
from hypothesis import given
from hypothesis import strategies as st
from proto_fuzz import field_bytes, length_delimited, varint

from kernel_cache_service.servicer import SERVICE_NAME, build_server
from kernel_cache_service.store import KernelStore
from services.bootstrap import ServerConfig
from services.proto import kernel_cache_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KernelCache"]
NAMES = ("llama.decode", "p", "x.y-z_1")
FINGERPRINTS = ("f1", "f2", "0123abcdef", "UNKNOWN")
SEEDED = {("p", "f1"): b"seed" * 2500, ("llama.decode", "f2"): b"\x7fELF" + bytes(300)}

HINTS = {
    "warmserve.v1.ProgramKey.name": st.sampled_from(NAMES),
    "warmserve.v1.ProgramKey.fingerprint": st.sampled_from(FINGERPRINTS),
    "warmserve.v1.FetchRequest.chunk_bytes": st.sampled_from((0, 1, 7, 4096, 4 << 20, (4 << 20) + 1)),
    "warmserve.v1.ClaimRequest.ttl_s": st.sampled_from((0.0, 0.05, 0.1, 0.5, 3600.0, 3600.5, -1.0)),
    "warmserve.v1.PublishHeader.format": st.sampled_from(("file", "dir", "zip", "")),
    "warmserve.v1.PublishHeader.size_bytes": st.integers(0, 64),
    "warmserve.v1.PublishHeader.sha256": st.sampled_from((hashlib.sha256(b"").hexdigest(), "00" * 32, "xyz")),
    "warmserve.v1.ListRequest.name_prefix": st.sampled_from(("", "p", "llama", "llama.")),
}


@st.composite
def publish_streams(draw) -> tuple[bytes, ...]:
    """A header whose size and sha256 match the bytes that follow, or are off by some bytes
    (chunks past or short of the declared size), or whose sha256 is another's; then the chunks."""
    data = draw(st.binary(min_size=1, max_size=96))
    mode = draw(st.sampled_from(("exact", "more", "less", "sha", "upper")))
    size = len(data) + {"more": -draw(st.integers(1, len(data))), "less": draw(st.integers(1, 1 << 40))}.get(mode, 0)
    sha = hashlib.sha256(data).hexdigest()
    sha = {"sha": hashlib.sha256(data + b"x").hexdigest(), "upper": sha.upper()}.get(mode, sha)
    key = field_bytes(1, draw(st.sampled_from(NAMES))) + field_bytes(2, draw(st.sampled_from(FINGERPRINTS[:3])))
    header = (length_delimited(1, key) + b"\x10" + varint(size) + field_bytes(3, sha)
              + field_bytes(4, draw(st.sampled_from(("fuzz", "x" * 300)))) + field_bytes(5, "file"))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return (length_delimited(1, header), *(length_delimited(2, c) for c in chunks))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    store = KernelStore(tmp_path_factory.mktemp("kc-fuzz") / "root")
    src = tmp_path_factory.mktemp("kc-fuzz-src")
    for (name, fp), data in SEEDED.items():
        (src / fp).write_bytes(data)
        store.publish(name, fp, src / fp)
    server = build_server(store, ServerConfig(service="kernel-cache-fuzz", max_streams=64))
    server.start()
    channel = fuzz_channel(server.address)
    try:
        yield channel, store
    finally:
        channel.close()
        server.stop()


def _entries(store: KernelStore) -> set[tuple[str, str]]:
    return {(p.parent.name, p.name) for p in (store.root / "entries").glob("*/*")}


def _temp_files(store: KernelStore) -> list:
    return list((store.root / "tmp").iterdir())


def _publish_key(case: Case) -> tuple[str, str] | None:
    try:
        first = pb.PublishRequest.FromString(case.requests[0])
    except Exception:
        return None
    return first.header.key.name, first.header.key.fingerprint


def _complete_artifact(case: Case) -> bool:
    """The publish sent, before any cut, a header and exactly the bytes it declared (size and
    sha256): a client that cancels after that may find its (verified) entry stored, because the
    server can see the cancelled stream end as a normal one before it learns of the cancel."""
    sent = case.requests if case.cut is None else case.requests[:case.cut]
    try:
        msgs = [pb.PublishRequest.FromString(r) for r in sent]
    except Exception:
        return False
    if not msgs or msgs[0].WhichOneof("kind") != "header" or any(m.WhichOneof("kind") != "chunk" for m in msgs[1:]):
        return False
    data, h = b"".join(m.chunk for m in msgs[1:]), msgs[0].header
    return len(data) == h.size_bytes and hashlib.sha256(data).hexdigest() == h.sha256.lower()


def test_the_fuzz_channel_reaches_the_seeded_entries(cache):
    """The fuzz is not all refusals: a plain Lookup of a seeded entry is a HIT."""
    channel, _ = cache
    got = channel.unary_unary("/warmserve.v1.KernelCache/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                              response_deserializer=pb.LookupResponse.FromString)(
        pb.LookupRequest(key=pb.ProgramKey(name="llama.decode", fingerprint="f2")), timeout=5)
    assert got.status == pb.LookupResponse.STATUS_HIT


@given(batch=batches(cases(SERVICE, HINTS, extra={"Publish": publish_streams()})))
@fuzz_settings(2000)
def test_every_kernel_cache_rpc_answers_a_documented_status_and_writes_nothing_it_refused(cache, batch):
    channel, store = cache
    for case in batch:
        if case.method.name == "Claim":  # a WAIT stream lasts as long as the builder's lease: stop at the first event
            case = dataclasses.replace(case, cancel_first=True)
        before = _entries(store)
        code, responses, cancelled = run_case(channel, case)
        check_status(SERVICE_NAME, case, code, cancelled)
        assert_serving(channel, SERVICE_NAME)
        assert wait_until(lambda: not _temp_files(store)), f"{case!r} left {_temp_files(store)}"
        after = _entries(store)
        name = case.method.name
        if name == "Evict":
            assert after <= before, case
        elif name == "Publish" and code == C.OK and responses[0].status == pb.PublishResponse.STATUS_PUBLISHED:
            assert after - before == {_publish_key(case)} and before <= after, case
        elif name == "Publish" and code == C.CANCELLED and _complete_artifact(case):
            assert after - before <= {_publish_key(case)} and before <= after, case
        else:
            assert after == before, f"{case!r} changed the store: {before ^ after}"


@pytest.mark.parametrize("method", ["Lookup", "Publish"])
def test_a_message_over_the_size_limit_is_resource_exhausted_and_stores_nothing(cache, method):
    channel, store = cache
    m = SERVICE.methods_by_name[method]
    big = field_bytes(2, bytes(17 << 20))  # a 17 MiB chunk, or an unknown 17 MiB field of LookupRequest
    before = _entries(store)
    header = (length_delimited(1, field_bytes(1, "p") + field_bytes(2, "big")) + b"\x10" + varint(17 << 20)
              + field_bytes(3, "00" * 32))
    requests = (big,) if method == "Lookup" else (length_delimited(1, header), big)
    code, _, cancelled = run_case(channel, Case(m, requests))
    assert code == C.RESOURCE_EXHAUSTED and not cancelled
    assert_serving(channel, SERVICE_NAME)
    assert wait_until(lambda: not _temp_files(store)) and _entries(store) == before
