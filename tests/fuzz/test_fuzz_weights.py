"""Fuzzing every RPC of ``warmserve.v1.Weights`` over real gRPC on loopback: random and
adversarial sources (traversal, device files, invalid UTF-8), dtypes, policies and chunk sizes,
streams cancelled after their first answer, messages over the size limit. Each answer is a
documented status, the service keeps serving, and the sidecar root holds the same files as
before, with no temp file left (the tiny checkpoint is packed in every dtype up front, so a
valid Prepare finds its sidecar or repacks the same files)."""

from __future__ import annotations

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
from proto_fuzz import field_bytes
from weights_tiny import write_tiny_checkpoint

from services.bootstrap import ServerConfig
from services.errors import InvalidArgument
from services.proto import weights_pb2 as pb
from weight_service.prepare import LOCK_DIR, prepare
from weight_service.servicer import SERVICE_NAME, build_server
from weight_service.sidecar import TEMP_PREFIX

SERVICE = pb.DESCRIPTOR.services_by_name["Weights"]
DTYPES = ("f32", "bf16", "int8", "int4", "auto", "", "f64", "F32")
#: Filled by the fixture: the tiny checkpoint's directory and its f32 sidecar's fingerprint.
TINY: dict[str, str] = {}

HINTS = {
    "warmserve.v1.PrepareRequest.source": st.one_of(st.sampled_from(("tiny", "missing")).map(
        lambda k: TINY.get("source", "") if k == "tiny" else TINY.get("source", "") + "/../nope")),
    "warmserve.v1.WeightsFetchRequest.source": st.just("tiny").map(lambda _: TINY.get("source", "")),
    "warmserve.v1.PrepareRequest.dtype": st.sampled_from(DTYPES),
    "warmserve.v1.WeightsFetchRequest.dtype": st.sampled_from(DTYPES),
    "warmserve.v1.PrepareRequest.cold_policy": st.sampled_from(("accept", "reject", "", "ACCEPT")),
    "warmserve.v1.WeightsFetchRequest.fingerprint": st.just("fp").map(lambda _: TINY.get("fingerprint", "")),
    "warmserve.v1.WeightsFetchRequest.chunk_bytes": st.sampled_from((0, 1, 1000, 4 << 20, (4 << 20) + 1)),
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("weights-fuzz-src") / "tiny-llama"
    write_tiny_checkpoint(ckpt, tokenizer=True)
    root = tmp_path_factory.mktemp("weights-fuzz") / "sidecars"
    TINY["source"] = str(ckpt)
    for dtype in DTYPES[:5]:
        try:
            handle = prepare(str(ckpt), dtype=dtype, root=root)
        except InvalidArgument:  # a dtype the tiny shapes cannot hold (int4 of a 48-wide matrix)
            continue
        if dtype == "f32":
            TINY["fingerprint"] = handle.fingerprint
    server = build_server(ServerConfig(service="weights-fuzz", max_streams=64), root, model_roots=[ckpt.parent])
    server.start()
    channel = fuzz_channel(server.address)
    try:
        yield channel, root
    finally:
        channel.close()
        server.stop()
        TINY.clear()


def _snapshot(root) -> tuple[set[str], list[str]]:
    """The sidecar root's files (locks aside), and its temp files, in one walk."""
    files, temps = set(), []
    for p in root.rglob("*"):
        if p.name.startswith(TEMP_PREFIX):
            temps.append(str(p))
        elif LOCK_DIR not in p.parts and p.is_file():
            files.add(str(p.relative_to(root)))
    return files, temps


def test_the_fuzz_reaches_the_tiny_sidecar(weights):
    """The fuzz is not all refusals: the sidecar the hints name is listed."""
    channel, _ = weights
    got = channel.unary_unary("/warmserve.v1.Weights/List", request_serializer=None,
                              response_deserializer=pb.WeightsListResponse.FromString)(b"", timeout=10)
    assert TINY["fingerprint"] in {s.fingerprint for s in got.sidecars}


@given(batch=batches(cases(SERVICE, HINTS)))
@fuzz_settings(2000)
def test_every_weights_rpc_answers_a_documented_status_and_writes_nothing_new(weights, batch):
    channel, root = weights
    for case in batch:
        before = _snapshot(root)
        code, _, cancelled = run_case(channel, case)
        check_status(SERVICE_NAME, case, code, cancelled)
        assert_serving(channel, SERVICE_NAME)
        # a cancelled Prepare may still be repacking in the background: wait for it to finish
        assert wait_until(lambda before=before: _snapshot(root) == before), f"{case!r} changed {before} to {_snapshot(root)}"


def test_a_message_over_the_size_limit_is_resource_exhausted(weights):
    channel, root = weights
    before = _snapshot(root)
    big = field_bytes(1, "a" * (17 << 20))  # a 17 MiB source
    code, _, cancelled = run_case(channel, Case(SERVICE.methods_by_name["Prepare"], (big,)))
    assert code == C.RESOURCE_EXHAUSTED and not cancelled
    assert_serving(channel, SERVICE_NAME)
    assert _snapshot(root) == before
