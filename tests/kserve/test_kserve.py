"""The router's KServe v2 / Triton door (``inference.GRPCInferenceService``) over real gRPC on
loopback, with plain grpc stubs: a router in front of one in-process runner of a tiny random
Llama checkpoint (tests/kserve_stack.py). The expected answers come from the warmserve.v1
``Generate`` path through the same router, and the tensor layouts from Triton's vLLM backend
(``src/model.py``, ``src/utils/request.py`` of triton-inference-server/vllm_backend) and Triton's
gRPC frontend (``src/grpc/stream_infer_handler.cc`` of triton-inference-server/server)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import grpc
import pytest
from fake_runner import FakeRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kserve_stack import MODEL_DIR, TinyStack

from kserve_service import convert as kserve_convert
from kserve_service import tensors as kserve_tensors
from kserve_service.door import router_server
from router_service.config import RouterConfig
from services.bootstrap import ServerConfig
from services.errors import InvalidArgument
from services.healthcheck import check_health
from services.ports import free_port
from services.proto import generation_pb2, router_pb2, router_pb2_grpc
from services.proto.triton import grpc_service_pb2 as kpb
from services.proto.triton import grpc_service_pb2_grpc as kgrpc
from services.proto.triton import model_config_pb2 as mpb

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
PROMPT = "w5 w6 w7"
#: The vLLM backend's input and output tensors this door serves, as its auto-complete lists them
#: (name, KServe datatype, dims); max_batch_size 0, so no batch dimension.
VLLM_INPUTS = [("text_input", "BYTES", [1]), ("stream", "BOOL", [1]), ("sampling_parameters", "BYTES", [1]),
               ("exclude_input_in_output", "BOOL", [1]), ("return_finish_reason", "BOOL", [1]),
               ("return_num_input_tokens", "BOOL", [1]), ("return_num_output_tokens", "BOOL", [1])]
VLLM_OUTPUTS = [("text_output", "BYTES", [-1]), ("finish_reason", "BYTES", [-1]),
                ("num_input_tokens", "UINT32", [1]), ("num_output_tokens", "UINT32", [-1])]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("kserve"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield kgrpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def reference(stack):
    """The Generate path's greedy 8-token answer to PROMPT and its prompt token count."""
    return stack.greedy(PROMPT, 8)


def _length_prefixed(*elements: bytes) -> bytes:
    """Triton's serialized BYTES tensor: per element a 4-byte little-endian length, then the bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def infer_request(text: str | None = PROMPT, *, model: str = MODEL_DIR, version: str = "", form: str = "raw",
                  request_id: str = "", stream: bool | None = None, sampling: dict | None = None,
                  **flags: bool) -> kpb.ModelInferRequest:
    """A request as a vLLM-backend client builds it, its tensor data in ``raw_input_contents``
    (``form="raw"``, as tritonclient sends it) or in ``contents`` (``form="contents"``)."""
    req = kpb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    tensors: list[tuple[str, str, object]] = []
    if text is not None:
        tensors.append(("text_input", "BYTES", text.encode()))
    if stream is not None:
        tensors.append(("stream", "BOOL", stream))
    if sampling is not None:
        tensors.append(("sampling_parameters", "BYTES", json.dumps(sampling).encode()))
    tensors += [(name, "BOOL", value) for name, value in flags.items()]
    for name, datatype, value in tensors:
        tensor = req.inputs.add(name=name, datatype=datatype, shape=[1])
        if form == "raw":
            req.raw_input_contents.append(_length_prefixed(value) if datatype == "BYTES" else bytes([value]))
        elif datatype == "BYTES":
            tensor.contents.bytes_contents.append(value)
        else:
            tensor.contents.bool_contents.append(value)
    return req


def outputs(resp: kpb.ModelInferResponse) -> dict[str, object]:
    """Each output tensor decoded from ``raw_output_contents`` (independently of the door's code):
    BYTES -> list of str, UINT32 -> list of int; with its shape."""
    out = {}
    for tensor, raw in zip(resp.outputs, resp.raw_output_contents, strict=True):
        if tensor.datatype == "BYTES":
            values, pos = [], 0
            while pos < len(raw):
                (n,) = struct.unpack_from("<I", raw, pos)
                values.append(raw[pos + 4:pos + 4 + n].decode())
                pos += 4 + n
        else:
            assert tensor.datatype == "UINT32"
            values = list(struct.unpack(f"<{len(raw) // 4}I", raw))
        out[tensor.name] = (values, list(tensor.shape))
    return out


GREEDY_8 = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_server_health_metadata_and_the_health_service(stack, stub) -> None:
    assert stub.ServerLive(kpb.ServerLiveRequest()).live is True
    assert stub.ServerReady(kpb.ServerReadyRequest()).ready is True
    meta = stub.ServerMetadata(kpb.ServerMetadataRequest())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (meta.name, meta.version) == ("warmserve", version)
    assert list(meta.extensions) == ["model_configuration", "parameters"]
    with grpc.insecure_channel(stack.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_model_ready_metadata_and_config_describe_a_vllm_model(stack, stub) -> None:
    for name in (MODEL_DIR, str(stack.ckpt)):  # the served name, and the runner's --model source itself
        assert stub.ModelReady(kpb.ModelReadyRequest(name=name)).ready is True
    assert stub.ModelReady(kpb.ModelReadyRequest(name=MODEL_DIR, version="1")).ready is True
    meta = stub.ModelMetadata(kpb.ModelMetadataRequest(name=MODEL_DIR))
    assert (meta.name, list(meta.versions), meta.platform) == (MODEL_DIR, ["1"], "vllm")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == VLLM_INPUTS
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == VLLM_OUTPUTS
    config = stub.ModelConfig(kpb.ModelConfigRequest(name=MODEL_DIR)).config
    assert (config.name, config.backend, config.max_batch_size) == (MODEL_DIR, "vllm", 0)
    assert config.model_transaction_policy.decoupled is True
    dtype = {"BYTES": mpb.TYPE_STRING, "BOOL": mpb.TYPE_BOOL, "UINT32": mpb.TYPE_UINT32}
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        (n, dtype[d], s, n != "text_input") for n, d, s in VLLM_INPUTS]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        (n, dtype[d], s) for n, d, s in VLLM_OUTPUTS]
    index = stub.RepositoryIndex(kpb.RepositoryIndexRequest(ready=True))
    assert [(m.name, m.version, m.state) for m in index.models] == [(MODEL_DIR, "1", "READY")]


@pytest.mark.parametrize(("name", "version", "code"), [
    ("other-model", "", grpc.StatusCode.NOT_FOUND),
    ("", "", grpc.StatusCode.NOT_FOUND),
    (MODEL_DIR, "2", grpc.StatusCode.NOT_FOUND),
    (MODEL_DIR, "latest", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_another_model_or_version_is_refused(stub, name, version, code) -> None:
    # ModelReady answers ready=false for a model or version it does not serve, as Triton's
    # ModelIsReady does (so `if not client.is_model_ready(...)` works); a malformed version is
    # still INVALID_ARGUMENT.
    if code == grpc.StatusCode.NOT_FOUND:
        assert stub.ModelReady(kpb.ModelReadyRequest(name=name, version=version)).ready is False
    else:
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelReady(kpb.ModelReadyRequest(name=name, version=version))
        assert err.value.code() == code, err.value.details()
    for call in (lambda: stub.ModelMetadata(kpb.ModelMetadataRequest(name=name, version=version)),
                 lambda: stub.ModelConfig(kpb.ModelConfigRequest(name=name, version=version)),
                 lambda: stub.ModelInfer(infer_request(model=name, version=version, sampling=GREEDY_8), timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code, err.value.details()
        if code == grpc.StatusCode.NOT_FOUND:
            assert "is not found" in err.value.details()


#: The RPCs the door leaves UNIMPLEMENTED on purpose, with a request of each.
UNIMPLEMENTED = {
    "ModelStatistics": kpb.ModelStatisticsRequest(), "RepositoryModelLoad": kpb.RepositoryModelLoadRequest(),
    "RepositoryModelUnload": kpb.RepositoryModelUnloadRequest(),
    "SystemSharedMemoryStatus": kpb.SystemSharedMemoryStatusRequest(),
    "SystemSharedMemoryRegister": kpb.SystemSharedMemoryRegisterRequest(),
    "SystemSharedMemoryUnregister": kpb.SystemSharedMemoryUnregisterRequest(),
    "CudaSharedMemoryStatus": kpb.CudaSharedMemoryStatusRequest(),
    "CudaSharedMemoryRegister": kpb.CudaSharedMemoryRegisterRequest(),
    "CudaSharedMemoryUnregister": kpb.CudaSharedMemoryUnregisterRequest(),
    "TraceSetting": kpb.TraceSettingRequest(), "LogSettings": kpb.LogSettingsRequest(),
}


@pytest.mark.parametrize("rpc", sorted(UNIMPLEMENTED))
def test_the_rpcs_left_out_answer_unimplemented_naming_themselves(stub, rpc) -> None:
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, rpc)(UNIMPLEMENTED[rpc], timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.value.details() == f"warmserve does not implement inference.GRPCInferenceService/{rpc}"


@pytest.mark.parametrize("form", ["raw", "contents"])
def test_model_infer_returns_the_whole_answer_after_the_prompt(stub, reference, form) -> None:
    text, prompt_tokens = reference
    resp = stub.ModelInfer(infer_request(form=form, request_id="u-1", sampling=GREEDY_8, return_finish_reason=True,
                                         return_num_input_tokens=True, return_num_output_tokens=True), timeout=60)
    assert (resp.model_name, resp.model_version, resp.id) == (MODEL_DIR, "1", "u-1")
    # Not streaming and exclude_input_in_output not sent: the vLLM backend prepends the prompt.
    assert outputs(resp) == {"text_output": ([PROMPT + text], [1]), "finish_reason": (["length"], [1]),
                             "num_input_tokens": ([prompt_tokens], []), "num_output_tokens": ([8], [1])}
    assert "triton_final_response" not in resp.parameters  # only streamed responses carry it
    excluded = stub.ModelInfer(infer_request(form=form, sampling=GREEDY_8, exclude_input_in_output=True), timeout=60)
    assert outputs(excluded) == {"text_output": ([text], [1])}


def test_model_infer_takes_sampling_from_request_parameters_without_the_tensor(stub, reference) -> None:
    """The vLLM backend reads ``request.parameters()`` when no ``sampling_parameters`` tensor
    is sent; Triton's reserved keys are not sampling parameters."""
    req = infer_request(exclude_input_in_output=True)
    req.parameters["max_tokens"].int64_param = 4
    req.parameters["temperature"].string_param = "0"
    req.parameters["ignore_eos"].bool_param = True
    req.parameters["priority"].uint64_param = 1
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    words = reference[0].split(" ")
    assert outputs(stub.ModelInfer(req, timeout=60))["text_output"] == ([" ".join(words[:4])], [1])


def test_model_infer_asks_for_only_the_requested_outputs(stub) -> None:
    req = infer_request(sampling=GREEDY_8, return_finish_reason=True, return_num_output_tokens=True)
    req.outputs.add(name="finish_reason")
    assert outputs(stub.ModelInfer(req, timeout=60)) == {"finish_reason": (["length"], [1])}


def _stream(stub, requests, *, metadata=None, timeout=60):
    return list(stub.ModelStreamInfer(iter(requests), metadata=metadata, timeout=timeout))


def test_stream_infer_deltas_concatenate_to_the_generate_text(stub, reference) -> None:
    text, prompt_tokens = reference
    responses = _stream(stub, [infer_request(request_id="s-1", stream=True, sampling=GREEDY_8,
                                             return_finish_reason=True, return_num_input_tokens=True,
                                             return_num_output_tokens=True)])
    assert all(r.error_message == "" for r in responses)
    infer = [r.infer_response for r in responses]
    assert all(r.id == "s-1" and r.model_name == MODEL_DIR for r in infer)
    # One response per runner message (each word is one token and one delta; a message carries
    # several tokens when a hop fell behind), the last one flagged.
    n = len(infer)
    assert 1 <= n <= 8
    assert [r.parameters["triton_final_response"].bool_param for r in infer] == [False] * (n - 1) + [True]
    decoded = [outputs(r) for r in infer]
    assert "".join(d["text_output"][0][0] for d in decoded) == text
    assert [d["finish_reason"][0][0] for d in decoded] == ["None"] * (n - 1) + ["length"]
    assert sum(d["num_output_tokens"][0][0] for d in decoded) == 8
    # The prompt's token count is known from the runner's last message only.
    assert [d.get("num_input_tokens") for d in decoded] == [None] * (n - 1) + [([prompt_tokens], [])]


def test_stream_infer_without_stream_answers_once_with_the_prompt(stub, reference) -> None:
    responses = _stream(stub, [infer_request(request_id="s-2", form="contents", sampling=GREEDY_8)])
    (only,) = responses
    assert only.infer_response.parameters["triton_final_response"].bool_param is True
    assert outputs(only.infer_response) == {"text_output": ([PROMPT + reference[0]], [1])}


def test_requests_on_one_stream_run_together_and_are_told_apart_by_id(stack, stub) -> None:
    prompts = {"a": "w9 w1 w2 w3", "b": "w4", "c": PROMPT}
    expected = {rid: stack.greedy(p, 6)[0] for rid, p in prompts.items()}
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    responses = _stream(stub, [infer_request(p, request_id=rid, stream=True, sampling=sampling)
                               for rid, p in prompts.items()])
    got: dict[str, str] = {}
    finals = []
    for r in responses:
        assert r.error_message == ""
        got[r.infer_response.id] = got.get(r.infer_response.id, "") + outputs(r.infer_response)["text_output"][0][0]
        if r.infer_response.parameters["triton_final_response"].bool_param:
            finals.append(r.infer_response.id)
    assert got == expected
    assert sorted(finals) == ["a", "b", "c"]


@pytest.mark.parametrize(("request_", "code", "says"), [
    (infer_request(None, sampling=GREEDY_8), grpc.StatusCode.INVALID_ARGUMENT, "missing required input 'text_input'"),
    (infer_request(form="contents", sampling={"max_tokens": 4, "presence_penalty": 2.5}),
     grpc.StatusCode.INVALID_ARGUMENT, "'presence_penalty' must be in [-2, 2], got 2.5"),
    (infer_request(sampling={"max_tokens": 4, "frobnicate": 1}), grpc.StatusCode.INVALID_ARGUMENT, "'frobnicate'"),
    (infer_request(sampling={"max_tokens": 4, "temperature": "hot"}), grpc.StatusCode.INVALID_ARGUMENT,
     "'temperature'"),
    (infer_request(sampling={"max_tokens": 1.5}), grpc.StatusCode.INVALID_ARGUMENT, "'max_tokens'"),
    (infer_request(stream=True, sampling=GREEDY_8), grpc.StatusCode.INVALID_ARGUMENT, "ModelStreamInfer"),
    # max_tokens beyond what the 128-token context leaves: the runner's own INVALID_ARGUMENT.
    (infer_request(sampling={"max_tokens": 1000}), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
], ids=["no-text-input", "neutral-key-changed", "unknown-key", "ill-typed", "fractional",
        "stream-unary", "runner-refuses"])
def test_bad_requests_are_invalid_argument_naming_the_problem(stub, request_, code, says) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request_, timeout=60)
    assert err.value.code() == code
    assert says in err.value.details()


def test_malformed_tensors_are_invalid_argument(stub) -> None:
    bad_json = infer_request(sampling=None)
    bad_json.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    bad_json.raw_input_contents.append(_length_prefixed(b"{max_tokens: 4"))
    wrong_type = infer_request(sampling=GREEDY_8)
    wrong_type.inputs[0].datatype = "BOOL"
    truncated = infer_request(sampling=GREEDY_8)
    truncated.raw_input_contents[0] = truncated.raw_input_contents[0][:-2]
    two = infer_request(form="contents", sampling=GREEDY_8)
    two.inputs[0].contents.bytes_contents.append(b"w1")
    two.inputs[0].shape[:] = [2]
    unknown = infer_request(sampling=GREEDY_8, return_logprobs=True)
    mixed = infer_request(sampling=GREEDY_8)
    mixed.inputs[0].contents.bytes_contents.append(b"w1")
    cases = {"not valid JSON": bad_json, "data-type is 'BOOL', but model 'tiny-llama' expects 'BYTES'": wrong_type,
             "runs past the end": truncated, "exactly one element": two,
             "unexpected inference input 'return_logprobs'": unknown,
             "contents field must not be specified": mixed}
    for says, request in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, says
        assert says in err.value.details()


def test_stream_errors_come_in_band_and_the_stream_goes_on(stub, reference) -> None:
    bad = infer_request(None, request_id="bad", stream=True, sampling=GREEDY_8)
    streaming_without_exclusion = infer_request(request_id="bad2", stream=True, sampling=GREEDY_8,
                                                exclude_input_in_output=False)
    good = infer_request(request_id="good", stream=True, sampling=GREEDY_8)
    responses = _stream(stub, [bad, streaming_without_exclusion, good])
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    assert errors.keys() == {"bad", "bad2"}
    assert "missing required input 'text_input'" in errors["bad"]
    # The vLLM backend's own words for this one.
    assert errors["bad2"] == "When streaming, `exclude_input_in_output` = False is not allowed."
    text = "".join(outputs(r.infer_response)["text_output"][0][0] for r in responses if r.infer_response.id == "good")
    assert text == reference[0]


def test_triton_grpc_error_header_turns_a_stream_error_into_the_status(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _stream(stub, [infer_request(None, stream=True, sampling=GREEDY_8)],
                metadata=(("triton_grpc_error", "true"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "missing required input 'text_input'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _stream(stub, [infer_request(model="nope", stream=True, sampling=GREEDY_8)],
                metadata=(("triton_grpc_error", "true"),))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancelling_the_stream_cancels_the_runner_call_and_frees_its_blocks(stack, stub) -> None:
    assert stack.wait_idle()
    stack.slow_decode(0.05)
    try:
        call = stub.ModelStreamInfer(iter([infer_request(stream=True, sampling={"max_tokens": 100, "temperature": 0,
                                                                                "ignore_eos": True})]), timeout=60)
        first = [next(call), next(call)]
        assert all(not r.infer_response.parameters["triton_final_response"].bool_param for r in first)
        assert stack.engine.stats()["kv_blocks_used"] > 0
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert stack.wait_idle(), stack.engine.stats()
        assert stack.engine.generated_tokens_total < 200  # stopped well before the 100 tokens asked
    finally:
        stack.fast_decode()


def test_a_half_closed_stream_still_gets_its_answers(stub, reference) -> None:
    """Closing the request side (what tritonclient's ``stop_stream`` does) is not a cancel."""
    gate = threading.Event()

    def requests():
        yield infer_request(request_id="late", stream=True, sampling=GREEDY_8)
        gate.set()  # the iterator ends here: the client half-closes at once

    responses = _stream(stub, requests())
    assert gate.is_set()
    assert "".join(outputs(r.infer_response)["text_output"][0][0] for r in responses) == reference[0]


def test_no_runner_means_not_ready_and_unavailable() -> None:
    for served in ("", "named"):
        server = router_server(RouterConfig(served_model_name=served), ServerConfig(service="router", port=0))
        server.start()
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = kgrpc.GRPCInferenceServiceStub(channel)
                assert stub.ServerLive(kpb.ServerLiveRequest()).live is True
                assert stub.ServerReady(kpb.ServerReadyRequest()).ready is False
                assert stub.ModelReady(kpb.ModelReadyRequest(name=served or "anything")).ready is False
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(infer_request(model=served or "anything", sampling=GREEDY_8), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no runner is ready" in err.value.details()
                index = stub.RepositoryIndex(kpb.RepositoryIndexRequest())
                assert [(m.name, m.state) for m in index.models] == ([("named", "UNAVAILABLE")] if served else [])
        finally:
            server.stop()


def test_the_served_name_comes_from_a_registered_runners_source_or_the_config() -> None:
    runner = FakeRunner("fake-0", model="/models/SmolLM2.Q4_1.gguf")  # the router compares its ModelInfo
    servers = []
    try:
        for served, expected in (("", "SmolLM2.Q4_1"), ("my-model", "my-model")):
            server = router_server(RouterConfig(health_interval_s=0.1, served_model_name=served),
                                  ServerConfig(service="router", port=0))
            servers.append(server)
            server.start()
            with grpc.insecure_channel(server.address) as channel:
                router_pb2_grpc.RouterControlStub(channel).RegisterRunner(router_pb2.RegisterRunnerRequest(
                    runner_id="fake-0", address=runner.address, model="/models/SmolLM2.Q4_1.gguf", lease_seconds=60),
                    timeout=5)
                assert server.router.wait_ready(1, 10)
                stub = kgrpc.GRPCInferenceServiceStub(channel)
                assert stub.ModelMetadata(kpb.ModelMetadataRequest(name=expected)).name == expected
                assert stub.ModelReady(kpb.ModelReadyRequest(name="/models/SmolLM2.Q4_1.gguf")).ready is True
                # The fake runner echoes the prompt's characters, one token each.
                resp = stub.ModelInfer(infer_request("hey", model=expected, sampling={"max_tokens": 3},
                                                     exclude_input_in_output=True), timeout=10)
                assert outputs(resp)["text_output"] == (["hey"], [1])
    finally:
        for server in servers:
            server.stop()
        runner.stop()


def test_router_serve_takes_served_model_name() -> None:
    runner = FakeRunner("fake-0")
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "warmserve.cli", "router", "serve", "--port", str(port),
                             "--runner", runner.address, "--health-interval", "0.1", "--served-model-name", "smol"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while check_health(address, service="inference.GRPCInferenceService", timeout_s=0.5) != "SERVING":
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < end
            time.sleep(0.1)
        with grpc.insecure_channel(address) as channel:
            stub = kgrpc.GRPCInferenceServiceStub(channel)
            while not stub.ModelReady(kpb.ModelReadyRequest(name="smol")).ready:
                assert time.monotonic() < end
                time.sleep(0.1)
            assert stub.ModelMetadata(kpb.ModelMetadataRequest(name="smol")).name == "smol"
            assert stub.ModelReady(kpb.ModelReadyRequest(name="fake")).ready is True  # the runner's source
            assert stub.ModelReady(kpb.ModelReadyRequest(name="fake-model")).ready is False
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelMetadata(kpb.ModelMetadataRequest(name="fake-model"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
        runner.stop()


# -- conversions without a server -----------------------------------------------------------------

def test_sampling_parameters_map_to_warmserve_sampling_params() -> None:
    got = kserve_convert.sampling_from_json(json.dumps({
        "temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "top_k": -1, "seed": 7, "stop": "w9",
        "stop_token_ids": [4, "5"], "ignore_eos": "true", "n": 1, "repetition_penalty": "1.0", "logprobs": None,
        "min_tokens": 0}))
    want = generation_pb2.SamplingParams(temperature=0.1, top_p=0.95, max_tokens=100, top_k=0, seed=7, stop=["w9"],
                                         stop_token_ids=[4, 5], ignore_eos=True, repetition_penalty=1.0)
    assert got == want
    # the Triton vLLM backend's penalties, min_tokens and logit_bias (ids as integers or digit strings)
    got = kserve_convert.sampling_from_json(json.dumps({
        "presence_penalty": "0.5", "frequency_penalty": -1.5, "repetition_penalty": 1.25, "min_tokens": "3",
        "logit_bias": {"7": -100, "12": 2.5}}))
    assert got == generation_pb2.SamplingParams(presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.25,
                                                min_tokens=3, logit_bias={7: -100.0, 12: 2.5})
    assert kserve_convert.sampling_from_json('{"stop": ["a", "b"], "top_k": 5}') == generation_pb2.SamplingParams(
        stop=["a", "b"], top_k=5)
    unset = kserve_convert.sampling_from_json('{"max_tokens": null}')
    assert not unset.HasField("max_tokens")
    for bad, key in [('{"top_k": -2}', "top_k"), ('{"seed": -1}', "seed"), ('{"max_tokens": true}', "max_tokens"),
                     ('{"stop": [1]}', "stop"), ('{"ignore_eos": "yes"}', "ignore_eos"), ('{"n": 2}', "n"),
                     ('{"lora_name": "x"}', "lora_name"), ('{"temperature": "nan"}', "temperature"),
                     ('{"max_tokens": 4294967296}', "max_tokens"), ('{"best_of": 3}', "best_of"),
                     ('{"presence_penalty": -2.1}', "presence_penalty"), ('{"frequency_penalty": "x"}', "frequency_penalty"),
                     ('{"repetition_penalty": 0}', "repetition_penalty"), ('{"repetition_penalty": 2.5}', "repetition_penalty"),
                     ('{"min_tokens": -1}', "min_tokens"), ('{"logit_bias": [1]}', "logit_bias"),
                     ('{"logit_bias": {"a": 1}}', "logit_bias"), ('{"logit_bias": {"5": 100.5}}', r"logit_bias\[5\]"),
                     (json.dumps({"logit_bias": {str(i): 1 for i in range(301)}}), "logit_bias")]:
        with pytest.raises(InvalidArgument, match=f"'{key}'"):
            kserve_convert.sampling_from_json(bad)
    with pytest.raises(InvalidArgument, match="JSON object"):
        kserve_convert.sampling_from_json("[1, 2]")


def test_bytes_tensors_round_trip_and_truncation_is_refused() -> None:
    raw = _length_prefixed(b"", "h\u00e9".encode(), b"x" * 300)
    assert kserve_tensors.deserialize_bytes(raw, "t") == [b"", "h\u00e9".encode(), b"x" * 300]
    assert kserve_tensors.serialize_bytes([b"", b"ab"]) == b"\x00\x00\x00\x00\x02\x00\x00\x00ab"
    for cut in (raw[:2], raw[:-1]):
        with pytest.raises(InvalidArgument):
            kserve_tensors.deserialize_bytes(cut, "t")



@pytest.mark.parametrize("key", ["guided_decoding", "structured_outputs"])
def test_structured_output_keys_reach_the_runner(stub, key) -> None:
    """vLLM's ``guided_decoding`` / ``structured_outputs`` in ``sampling_parameters`` (as Triton's
    vLLM backend hands them to vLLM's ``SamplingParams``) reach the runner: this stack's word-level
    test tokenizer has no decoder llguidance can read, so the runner refuses the constraint with
    INVALID_ARGUMENT naming that (the constraint's own outputs: ``tests/runner/test_runner_structured.py``,
    and through this door on a byte-level tokenizer: ``tests/kserve/test_kserve_tritonclient.py``);
    a malformed one is refused by the door."""
    for sampling in ({key: {"choice": ["w3", "w17"]}}, {key: json.dumps({"regex": "w[0-9]"})}):
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(infer_request(sampling=sampling), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("structured output is not available for this model: its tokenizer")
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(infer_request(sampling={key: {"choice": "w3"}}), timeout=60)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                       f"'{key}.choice' must be a list of strings, got \"w3\"")
