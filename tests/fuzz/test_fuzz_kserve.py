"""Fuzzing every RPC of the router's KServe v2 door (``inference.GRPCInferenceService``) over
real gRPC on loopback, in front of a tiny in-process runner: random and adversarial messages,
requests shaped like the vLLM backend's (prompts, shapes, datatypes, sampling JSON, the
``stream`` flag), ``ModelStreamInfer`` streams cut off or cancelled, messages over the size
limit. Each answer is a documented status (an in-stream error is a response, as Triton's), the
door keeps serving, and the runner holds no sequence or KV block afterwards."""

from __future__ import annotations

import json

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
)
from generation_hints import WORDS
from hypothesis import given
from hypothesis import strategies as st
from kserve_stack import MODEL_DIR, TinyStack
from proto_fuzz import field_bytes

from kserve_service.servicer import SERVICE_NAME
from services.proto.triton import grpc_service_pb2 as kserve_pb2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVICE = kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
NAMES = st.sampled_from((MODEL_DIR, "", "other", MODEL_DIR.upper()))
VERSIONS = st.sampled_from(("", "1", "2", "-1", "x"))
JSON_VALUES = st.one_of(st.integers(-2, 40), st.sampled_from((0.0, 0.5, 1e308, "x", None, [], {}, True,
                                                            {"3": 100}, {"-1": 1}, {"7": 101.0})))


@st.composite
def infer_requests(draw) -> bytes:
    """A ``ModelInferRequest`` shaped like a vLLM-backend client's, with random values."""
    r = kserve_pb2.ModelInferRequest(model_name=draw(NAMES), model_version=draw(VERSIONS), id=draw(st.text(max_size=6)))
    text = r.inputs.add(name=draw(st.sampled_from(("text_input", "text_input", "prompt"))),
                        datatype=draw(st.sampled_from(("BYTES", "BYTES", "INT32", "FP32"))),
                        shape=draw(st.lists(st.integers(-1, 3), max_size=3)))
    prompts = draw(st.lists(WORDS.map(str.encode), max_size=2))
    if draw(st.booleans()):
        text.contents.bytes_contents.extend(prompts)
    else:  # raw_input_contents: each BYTES element length-prefixed, or junk
        r.raw_input_contents.append(b"".join(len(p).to_bytes(4, "little") + p for p in prompts)
                                    + draw(st.sampled_from((b"", b"\xff\xff\xff\x7f", b"\x01"))))
    if draw(st.booleans()):
        flag = r.inputs.add(name=draw(st.sampled_from(("stream", "exclude_input_in_output", "return_finish_reason"))),
                            datatype=draw(st.sampled_from(("BOOL", "BYTES"))), shape=[1])
        flag.contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=2)))
    if draw(st.booleans()):
        params = r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        keys = st.sampled_from(("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "bogus", "ignore_eos",
                                "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                "logit_bias"))
        body = json.dumps(draw(st.dictionaries(keys, JSON_VALUES, max_size=3)))
        params.contents.bytes_contents.append(draw(st.sampled_from((body, body, "{", "[]", "null"))).encode())
    if draw(st.booleans()):
        r.parameters[draw(st.sampled_from(("max_tokens", "stream", "x")))].int64_param = draw(st.integers(-2, 40))
    if draw(st.booleans()):
        r.outputs.add(name=draw(st.sampled_from(("text_output", "finish_reason", "nope"))))
    return r.SerializeToString()


HINTS = {
    "inference.ModelInferRequest": infer_requests(),
    "inference.ModelReadyRequest.name": NAMES,
    "inference.ModelReadyRequest.version": VERSIONS,
    "inference.ModelMetadataRequest.name": NAMES,
    "inference.ModelMetadataRequest.version": VERSIONS,
    "inference.ModelConfigRequest.name": NAMES,
    "inference.ModelConfigRequest.version": VERSIONS,
}


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    stack = TinyStack(tmp_path_factory.mktemp("kserve-fuzz"))
    channel = fuzz_channel(stack.address)
    try:
        yield stack, channel
    finally:
        channel.close()
        stack.close()


@given(batch=batches(cases(SERVICE, HINTS, max_stream=3, often={"ModelInfer": 6, "ModelStreamInfer": 6})))
@fuzz_settings(2000)
def test_every_kserve_rpc_answers_a_documented_status_and_the_runner_frees_its_kv_blocks(door, batch):
    stack, channel = door
    for case in batch:
        code, _, cancelled = run_case(channel, case)
        check_status(SERVICE_NAME, case, code, cancelled)
        assert_serving(channel, SERVICE_NAME)
        assert stack.wait_idle(5.0), f"{case!r} left {stack.engine.stats()}"


@pytest.mark.parametrize("method", ["ModelInfer", "ModelStreamInfer"])
def test_a_message_over_the_size_limit_is_resource_exhausted(door, method):
    stack, channel = door
    big = field_bytes(1, "m" * (17 << 20))  # a 17 MiB model name
    code, _, cancelled = run_case(channel, Case(SERVICE.methods_by_name[method], (big,)))
    assert code == C.RESOURCE_EXHAUSTED and not cancelled
    assert_serving(channel, SERVICE_NAME)
    assert stack.wait_idle(5.0)
