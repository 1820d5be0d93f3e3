"""The KServe door's limits (tests/kserve_stack.py: a router in front of one tiny runner): one
``ModelStreamInfer`` stream carrying 30 requests has at most 8 in flight, the rest refused in the
stream, so it can no longer push the runner past its own cap and get it ejected; invalid Unicode
is INVALID_ARGUMENT with a sentence, never an exception's text; refusals are counted."""

from __future__ import annotations

import json

import grpc
import pytest
from kserve_stack import MODEL_DIR, TinyStack

from router_service.registry import RunnerState
from services.proto.triton import grpc_service_pb2 as kpb
from services.proto.triton import grpc_service_pb2_grpc as kgrpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY_8 = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
#: U+D800 written as UTF-8 (CESU-8): bytes no UTF-8 decoder accepts.
SURROGATE_BYTES = b"\xed\xa0\x80"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("kserve-limits"), runner_streams=12)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield kgrpc.GRPCInferenceServiceStub(channel)


def request(text: bytes = b"w5 w6 w7", *, request_id: str = "", stream: bool | None = None,
            sampling: dict | str | None = None) -> kpb.ModelInferRequest:
    """A vLLM-backend request, its tensors in ``contents``."""
    req = kpb.ModelInferRequest(model_name=MODEL_DIR, id=request_id)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text)
    if stream is not None:
        req.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(stream)
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
            raw.encode())
    return req


def _refused(stack: TinyStack, reason: str) -> float:
    return stack.server.server.registry.get_sample_value("warmserve_refused_total", {"reason": reason}) or 0.0


def test_a_30_request_stream_has_8_in_flight_and_never_gets_the_runner_ejected(stack, stub) -> None:
    ejected = []
    stack.server.router.registry.on_ejected(ejected.append)
    before = _refused(stack, "stream_in_flight")
    assert stack.wait_idle()
    stack.slow_decode(0.2)  # the first 8 are still generating when the other 22 arrive
    try:
        responses = list(stub.ModelStreamInfer(iter([request(request_id=f"q{i}", stream=True, sampling=GREEDY_8)
                                                     for i in range(30)]), timeout=120))
        # Another client is served meanwhile... and after.
        other = stub.ModelInfer(request(sampling={"max_tokens": 2, "temperature": 0}), timeout=60)
    finally:
        stack.fast_decode()
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    finals = {r.infer_response.id for r in responses
              if not r.error_message and r.infer_response.parameters["triton_final_response"].bool_param}
    assert len(errors) == 22 and len(finals) == 8 and not errors.keys() & finals
    assert all("already has 8 requests in flight (--max-stream-requests)" in e for e in errors.values())
    assert other.outputs[0].name == "text_output"
    assert ejected == []
    (runner,) = stack.server.router.registry.snapshot()
    assert runner.state is RunnerState.READY and runner.consecutive_failures == 0
    assert _refused(stack, "stream_in_flight") == before + 22


def test_a_lone_surrogate_stop_string_is_invalid_argument_not_an_exception(stack, stub) -> None:
    before = _refused(stack, "unicode")
    sampling = '{"max_tokens": 4, "stop": ["ok", "\\ud800"]}'  # JSON's escape of a lone surrogate
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request(sampling=sampling), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("sampling parameter 'stop' string 1 is not valid Unicode: a lone surrogate "
                                   "U+D800 at character 0")
    (only,) = stub.ModelStreamInfer(iter([request(request_id="s", stream=True, sampling=sampling)]), timeout=60)
    assert only.error_message == err.value.details() and only.infer_response.id == "s"
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request(b"w5 " + SURROGATE_BYTES, sampling=GREEDY_8), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid UTF-8" in err.value.details()
    assert _refused(stack, "unicode") == before + 3


def test_bad_utf8_in_a_string_field_on_the_wire_is_invalid_argument(stack) -> None:
    bad_id = b"\x1a\x03" + SURROGATE_BYTES  # ModelInferRequest.id = 3
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with grpc.insecure_channel(stack.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", **identity)(bad_id, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid UTF-8" in err.value.details()
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer", **identity)
        with pytest.raises(grpc.RpcError) as err:
            list(stream(iter([bad_id]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid UTF-8" in err.value.details()


#: 20,000 nested arrays: 40 KB, under the size limit, deeper than Python's JSON parser goes.
DEEP = "[" * 20_000 + "]" * 20_000
#: 300 KB of nesting: over MAX_SAMPLING_JSON_BYTES (256 KiB).
HUGE = "[" * 150_000 + "]" * 150_000


def test_deeply_nested_or_oversize_sampling_json_is_one_sentence_of_invalid_argument(stack, stub) -> None:
    before = _refused(stack, "sampling_bytes")
    expected = {
        DEEP: "input 'sampling_parameters' is not a JSON object warmserve can read (nested too deeply or a "
              "number too long)",
        HUGE: f"input 'sampling_parameters' is {len(HUGE)} bytes; at most {256 * 1024} are allowed",
    }
    for sampling, sentence in expected.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request(sampling=sampling), timeout=60)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, sentence)
        (only,) = stub.ModelStreamInfer(iter([request(request_id="d", stream=True, sampling=sampling)]), timeout=60)
        assert (only.error_message, only.infer_response.id) == (sentence, "d")
    assert _refused(stack, "sampling_bytes") == before + 2
    assert stub.ModelInfer(request(sampling={"max_tokens": 2, "temperature": 0}), timeout=60).outputs


def test_a_stream_request_that_fails_unexpectedly_gets_a_sentence_not_the_exception(stack, stub,
                                                                                    monkeypatch) -> None:
    def broken(*_args, **_kwargs):
        raise RuntimeError("internal detail: /secret/path and a stack frame")

    monkeypatch.setattr(stack.server.router, "generate", broken)
    (only,) = stub.ModelStreamInfer(iter([request(request_id="x", stream=True, sampling=GREEDY_8)]), timeout=60)
    assert only.error_message == "the router failed to start the request; see its log"
