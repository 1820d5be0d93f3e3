"""KServe v2 / Open Inference Protocol messages <-> warmserve ``Generation`` messages, shaped as
Triton Inference Server's vLLM backend shapes them (the door itself is :mod:`router_service.kserve`).

A client written for a vLLM model on Triton sends a ``ModelInferRequest`` with these input tensors
(the backend's ``src/model.py`` ``_auto_complete_inputs_and_outputs`` and ``src/utils/request.py``
``GenerateRequest._get_input_tensors``, github.com/triton-inference-server/vllm_backend):

==========================  =======  =====  ==================================================
input                       type     dims   meaning
==========================  =======  =====  ==================================================
``text_input``              BYTES    [1]    the prompt, UTF-8 (required)
``stream``                  BOOL     [1]    one response per text delta (default false)
``sampling_parameters``     BYTES    [1]    a JSON object of vLLM ``SamplingParams`` fields
``exclude_input_in_output`` BOOL     [1]    default: false unless streaming (the whole answer
                                            then starts with the prompt); false with stream is
                                            refused
``return_finish_reason``    BOOL     [1]    add output ``finish_reason``
``return_num_input_tokens`` BOOL     [1]    add output ``num_input_tokens``
``return_num_output_tokens`` BOOL    [1]    add output ``num_output_tokens``
==========================  =======  =====  ==================================================

and gets ``text_output`` (BYTES, shape ``[1]``), plus ``finish_reason`` (BYTES ``[1]``: ``stop``,
``length``, ``abort``; ``None`` on a streamed response that is not the last), ``num_input_tokens``
(UINT32, shape ``[]``, a 0-d tensor as the backend's ``np.asarray(n)``; when streaming, only on
the last response, since the runner reports the prompt's length when it finishes) and
``num_output_tokens`` (UINT32 ``[1]``: the tokens of that response) when asked for. Tensor data may come in
``raw_input_contents`` (what ``tritonclient`` sends: BYTES elements as a 4-byte little-endian
length then the bytes, BOOL as one byte each) or in ``contents.bytes_contents`` /
``contents.bool_contents``; outputs are always sent in ``raw_output_contents``, as Triton does.

The sampling keys and what they become (:func:`sampling_from_json`): ``max_tokens``, ``temperature``,
``top_p``, ``top_k`` (-1 = off, as vLLM), ``seed``, ``stop`` (a string or a list of strings),
``stop_token_ids``, ``ignore_eos`` go to :class:`~services.proto.generation_pb2.SamplingParams`; a
vLLM key warmserve has no use for is accepted only at its no-op value (``n`` 1,
``presence_penalty`` 0, ...: :data:`NEUTRAL_SAMPLING`); any other key, or a value of the wrong
type, is ``InvalidArgument`` naming the key. Numbers may be JSON numbers or strings (``"0.1"``,
``"100"``): the backend converts each value with the field's type, and its own sample client
sends strings. A key left out takes warmserve's default (the model's ``generation_config.json``,
else greedy and 64 tokens), not vLLM's ``SamplingParams`` defaults.

Every function here raises :class:`services.errors.InvalidArgument` for a malformed request.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from services.errors import InvalidArgument
from services.proto import generation_pb2
from services.proto.triton import grpc_service_pb2 as kserve_pb2
from services.proto.triton import model_config_pb2

#: The model's version, as a Triton model repository would name its only version directory.
MODEL_VERSION = "1"
#: ``ModelMetadata.platform`` and ``ModelConfig.backend`` of a vLLM model on Triton.
BACKEND = "vllm"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model: name, KServe datatype, dims (``-1`` = any), optional."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False


#: The inputs this door reads, in the vLLM backend's order (it also has ``image``,
#: ``return_cumulative_logprob``, ``return_logprobs`` and ``embedding_request``, which warmserve
#: does not serve: a request carrying one is refused naming it).
INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("stream", "BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True),
    TensorSpec("return_finish_reason", "BOOL", (1,), optional=True),
    TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True),
)
#: The outputs, named and typed as the vLLM backend's.
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
_INPUT_BY_NAME = {t.name: t for t in INPUTS}
_OUTPUT_NAMES = frozenset(t.name for t in OUTPUTS)
#: KServe datatype -> model_config ``DataType`` (``BYTES`` is ``TYPE_STRING`` in a model config).
_CONFIG_DTYPE = {"BYTES": model_config_pb2.TYPE_STRING, "BOOL": model_config_pb2.TYPE_BOOL,
                 "UINT32": model_config_pb2.TYPE_UINT32}

#: Request parameters Triton's gRPC frontend keeps for itself (tritonclient's
#: ``TRITON_RESERVED_REQUEST_PARAMS``, plus every ``triton_*`` key): never sampling parameters.
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "headers", "binary_data_output"})

#: vLLM sampling keys warmserve accepts only at the value that changes nothing (vLLM's default).
NEUTRAL_SAMPLING: Mapping[str, object] = {
    "n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "min_tokens": 0, "detokenize": True, "include_stop_str_in_output": False,
    "logprobs": None, "prompt_logprobs": None,
}
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38

#: warmserve finish reason -> the string vLLM reports (``str(CompletionOutput.finish_reason)``).
FINISH_REASON_NAMES = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_CANCELLED: "abort",
    generation_pb2.FINISH_REASON_ABORTED: "abort",
}


@dataclass
class InferInputs:
    """A request's inputs, decoded: the prompt and the flags, ``None`` where a flag was not sent."""

    text_input: str
    stream: bool | None = None
    sampling_parameters: str | None = None
    exclude_input_in_output: bool | None = None
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def request_label(request: kserve_pb2.ModelInferRequest) -> str:
    """``[request id: ID]`` (``<id_unknown>`` when empty), the prefix of Triton's error messages."""
    return f"[request id: {request.id or '<id_unknown>'}]"


def _element_count(shape) -> int:
    count = 1
    for d in shape:
        if d < 0:
            raise InvalidArgument(f"a shape dimension is negative ({list(shape)})")
        count *= d
    return count


def deserialize_bytes(raw: bytes, what: str) -> list[bytes]:
    """Split Triton's serialized BYTES tensor (each element: 4-byte little-endian length, then
    that many bytes) into its elements. Raises ``InvalidArgument`` when ``raw`` is truncated."""
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidArgument(f"{what}: raw BYTES data ends inside an element's 4-byte length prefix")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise InvalidArgument(f"{what}: raw BYTES element of {n} bytes runs past the end of the data "
                                  f"({len(raw) - pos} bytes left)")
        out.append(raw[pos:pos + n])
        pos += n
    return out


def serialize_bytes(elements: list[bytes]) -> bytes:
    """The inverse of :func:`deserialize_bytes`."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _input_values(tensor: kserve_pb2.ModelInferRequest.InferInputTensor, raw: bytes | None,
                  model: str) -> list:
    """The elements of one input tensor (``bytes`` for BYTES, ``bool`` for BOOL), checked against
    its datatype and shape."""
    spec = _INPUT_BY_NAME[tensor.name]
    what = f"input '{tensor.name}'"
    if tensor.datatype != spec.datatype:
        raise InvalidArgument(f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
                              f"'{model}' expects '{spec.datatype}'")
    if "shared_memory_region" in tensor.parameters:
        raise InvalidArgument(f"{what}: shared memory inputs are not supported; send the data in the request")
    expected = _element_count(tensor.shape)
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidArgument(f"contents field must not be specified when using raw_input_contents for "
                                  f"'{tensor.name}' for model '{model}'")
        values: list = deserialize_bytes(raw, what) if spec.datatype == "BYTES" else [b != 0 for b in raw]
    else:
        contents = tensor.contents
        values = list(contents.bytes_contents if spec.datatype == "BYTES" else contents.bool_contents)
        if not values and contents.ListFields():
            field_name = "bytes_contents" if spec.datatype == "BYTES" else "bool_contents"
            raise InvalidArgument(f"{what} of datatype {spec.datatype} must carry its data in contents.{field_name} "
                                  f"or raw_input_contents, not in {contents.ListFields()[0][0].name}")
    if len(values) != expected:
        raise InvalidArgument(f"{what} has {len(values)} elements but its shape {list(tensor.shape)} says {expected}")
    if len(values) != 1:
        raise InvalidArgument(f"{what} must hold exactly one element (dims [1]), got shape {list(tensor.shape)}")
    return values


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def decode_inputs(request: kserve_pb2.ModelInferRequest, model: str) -> InferInputs:
    """The request's input tensors as :class:`InferInputs` (``model``: the served name, for
    messages). Raises ``InvalidArgument`` for an input the model does not have, one given twice,
    a wrong datatype, malformed data, more than one element, or a missing ``text_input``."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(f"{request_label(request)} raw_input_contents has {len(raw)} entries for "
                              f"{len(request.inputs)} inputs; send one per input, in order")
    values: dict[str, object] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name not in _INPUT_BY_NAME:
            raise InvalidArgument(f"{request_label(request)} unexpected inference input '{tensor.name}' for model "
                                  f"'{model}' (it takes {', '.join(repr(t.name) for t in INPUTS)})")
        if tensor.name in values:
            raise InvalidArgument(f"{request_label(request)} input '{tensor.name}' is given twice")
        values[tensor.name] = _input_values(tensor, raw[i] if raw else None, model)[0]
    if "text_input" not in values:
        got = ", ".join(repr(n) for n in values) or "none"
        raise InvalidArgument(f"{request_label(request)} missing required input 'text_input' for model '{model}' "
                              f"(got inputs: {got})")
    sampling = values.get("sampling_parameters")
    return InferInputs(
        text_input=_utf8(values["text_input"], "input 'text_input'"),
        stream=values.get("stream"),
        sampling_parameters=None if sampling is None else _utf8(sampling, "input 'sampling_parameters'"),
        exclude_input_in_output=values.get("exclude_input_in_output"),
        return_finish_reason=bool(values.get("return_finish_reason", False)),
        return_num_input_tokens=bool(values.get("return_num_input_tokens", False)),
        return_num_output_tokens=bool(values.get("return_num_output_tokens", False)))


def requested_outputs(request: kserve_pb2.ModelInferRequest, model: str) -> frozenset[str] | None:
    """The output names the request asks for (``None``: all it produces). Raises
    ``InvalidArgument`` for an output the model does not have."""
    names = [o.name for o in request.outputs]
    for name in names:
        if name not in _OUTPUT_NAMES:
            raise InvalidArgument(f"{request_label(request)} unexpected inference output '{name}' for model '{model}'")
    return frozenset(names) if names else None


def prepend_input(inputs: InferInputs, *, stream: bool) -> bool:
    """Whether the answer starts with the prompt, as the vLLM backend decides it: not
    ``exclude_input_in_output`` when that is sent, else only when not streaming. Raises
    ``InvalidArgument`` for ``exclude_input_in_output`` false while streaming (the backend's
    "When streaming, `exclude_input_in_output` = False is not allowed.")."""
    if inputs.exclude_input_in_output is not None:
        prepend = not inputs.exclude_input_in_output
    else:
        prepend = not stream
    if prepend and stream:
        raise InvalidArgument("When streaming, `exclude_input_in_output` = False is not allowed.")
    return prepend


# -- sampling parameters ------------------------------------------------------------------------

def _int(key: str, value: object) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"sampling parameter '{key}' must be an integer, got {json.dumps(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidArgument(f"sampling parameter '{key}' must be an integer, got {json.dumps(value)}")


def _float(key: str, value: object) -> float:
    out: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            out = None
    if out is None or not math.isfinite(out) or abs(out) > _FLOAT32_MAX:
        raise InvalidArgument(f"sampling parameter '{key}' must be a finite number, got {json.dumps(value)}")
    return out


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidArgument(f"sampling parameter '{key}' must be true or false, got {json.dumps(value)}")


def _in_range(key: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(f"sampling parameter '{key}' must be in [{low}, {high}], got {value}")
    return value


def sampling_from_dict(params: Mapping[str, object]) -> generation_pb2.SamplingParams:
    """warmserve ``SamplingParams`` from vLLM sampling keys (see the module docstring); a key
    whose value is ``None`` (JSON ``null``) is left unset. Raises ``InvalidArgument`` naming the
    key for an unknown key, a value of the wrong type or out of range, ``lora_name``, or a
    :data:`NEUTRAL_SAMPLING` key at another value."""
    out = generation_pb2.SamplingParams()
    for key, value in params.items():
        if value is None and key in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                     "stop_token_ids", "ignore_eos", *NEUTRAL_SAMPLING):
            continue
        if key == "max_tokens":
            out.max_tokens = _in_range(key, _int(key, value), 1, _INT32_MAX)
        elif key == "temperature":
            out.temperature = _float(key, value)
        elif key == "top_p":
            out.top_p = _float(key, value)
        elif key == "top_k":
            top_k = _int(key, value)
            out.top_k = 0 if top_k == -1 else _in_range(key, top_k, 0, _INT32_MAX)  # vLLM: -1 = off
        elif key == "seed":
            out.seed = _in_range(key, _int(key, value), 0, 2**64 - 1)
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InvalidArgument(f"sampling parameter 'stop' must be a string or a list of strings, "
                                      f"got {json.dumps(value)}")
            out.stop.extend(stops)
        elif key == "stop_token_ids":
            if not isinstance(value, list):
                raise InvalidArgument(f"sampling parameter 'stop_token_ids' must be a list of integers, "
                                      f"got {json.dumps(value)}")
            out.stop_token_ids.extend(_in_range(key, _int(key, v), 0, _INT32_MAX) for v in value)
        elif key == "ignore_eos":
            out.ignore_eos = _bool(key, value)
        elif key == "lora_name":
            raise InvalidArgument("sampling parameter 'lora_name': LoRA adapters are not supported")
        elif key in NEUTRAL_SAMPLING:
            _check_neutral(key, value)
        else:
            raise InvalidArgument(f"unknown sampling parameter '{key}' (supported: max_tokens, temperature, top_p, "
                                  f"top_k, seed, stop, stop_token_ids, ignore_eos, and at their defaults "
                                  f"{', '.join(NEUTRAL_SAMPLING)})")
    return out


def _check_neutral(key: str, value: object) -> None:
    neutral = NEUTRAL_SAMPLING[key]
    if neutral is None:
        same = False
    elif isinstance(neutral, bool):
        same = _bool(key, value) == neutral
    elif isinstance(neutral, int):
        same = _int(key, value) == neutral
    else:
        same = _float(key, value) == neutral
    if not same:
        raise InvalidArgument(f"sampling parameter '{key}' = {json.dumps(value)} is not supported "
                              f"(only its default, {json.dumps(neutral)})")


def sampling_from_json(text: str) -> generation_pb2.SamplingParams:
    """:func:`sampling_from_dict` of the ``sampling_parameters`` tensor's JSON text. Raises
    ``InvalidArgument`` for text that is not a JSON object, and as :func:`sampling_from_dict`."""
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"input 'sampling_parameters' is not valid JSON: {e}") from None
    if not isinstance(params, dict):
        raise InvalidArgument(f"input 'sampling_parameters' must be a JSON object, got {type(params).__name__}")
    return sampling_from_dict(params)


def parameter_value(param: kserve_pb2.InferParameter) -> object:
    """The Python value of one ``InferParameter`` (``None`` when none of its fields is set)."""
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def sampling_from_request(inputs: InferInputs, request: kserve_pb2.ModelInferRequest) -> generation_pb2.SamplingParams:
    """The request's sampling parameters: the ``sampling_parameters`` tensor when sent, else the
    request's ``parameters`` map less Triton's reserved keys (the vLLM backend reads
    ``request.parameters()`` then). Raises ``InvalidArgument`` as :func:`sampling_from_dict`."""
    if inputs.sampling_parameters is not None:
        return sampling_from_json(inputs.sampling_parameters)
    params = {k: parameter_value(v) for k, v in request.parameters.items()
              if k not in RESERVED_PARAMETERS and not k.startswith("triton_")}
    return sampling_from_dict(params)


def generate_request(inputs: InferInputs, sampling: generation_pb2.SamplingParams) -> generation_pb2.GenerateRequest:
    """The ``Generate`` call for a decoded request: the prompt as raw text (no chat template),
    with special-token text recognised as vLLM's tokenizer does (a client that renders its own
    chat template into ``text_input`` gets the control tokens it wrote)."""
    return generation_pb2.GenerateRequest(text=inputs.text_input, sampling=sampling, allow_special_tokens=True)


# -- responses ----------------------------------------------------------------------------------

def infer_response(request: kserve_pb2.ModelInferRequest, model: str, *, text: str, inputs: InferInputs,
                   wanted: frozenset[str] | None, finish_reason: int | None, prompt_tokens: int | None,
                   output_tokens: int, final_flag: bool | None) -> kserve_pb2.ModelInferResponse:
    """One ``ModelInferResponse`` as the vLLM backend builds it: ``text_output`` (``[1]``), and
    ``finish_reason`` / ``num_input_tokens`` / ``num_output_tokens`` when their ``return_*``
    input asked for them, restricted to ``wanted`` (``None``: all). ``finish_reason`` ``None``
    writes vLLM's ``"None"``; ``prompt_tokens`` ``None`` leaves ``num_input_tokens`` out (a
    streamed response before the last does not know it). ``final_flag`` (streaming only) sets
    the ``triton_final_response`` parameter, as Triton's gRPC frontend does on every response of
    a decoupled model."""
    resp = kserve_pb2.ModelInferResponse(model_name=model, model_version=MODEL_VERSION, id=request.id)

    def add(name: str, datatype: str, shape: list[int], raw: bytes) -> None:
        if wanted is None or name in wanted:
            resp.outputs.add(name=name, datatype=datatype, shape=shape)
            resp.raw_output_contents.append(raw)

    add("text_output", "BYTES", [1], serialize_bytes([text.encode("utf-8")]))
    if inputs.return_finish_reason:
        name = "None" if finish_reason is None else FINISH_REASON_NAMES.get(finish_reason, "abort")
        add("finish_reason", "BYTES", [1], serialize_bytes([name.encode()]))
    if inputs.return_num_input_tokens and prompt_tokens is not None:
        add("num_input_tokens", "UINT32", [], struct.pack("<I", prompt_tokens))
    if inputs.return_num_output_tokens:
        add("num_output_tokens", "UINT32", [1], struct.pack("<I", output_tokens))
    if final_flag is not None:
        resp.parameters["triton_final_response"].bool_param = final_flag
    return resp


def tensor_metadata(specs: tuple[TensorSpec, ...]) -> list[kserve_pb2.ModelMetadataResponse.TensorMetadata]:
    """``ModelMetadata`` entries for ``specs`` (no batch dimension: ``max_batch_size`` is 0)."""
    return [kserve_pb2.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=list(t.dims))
            for t in specs]


def model_config(name: str) -> model_config_pb2.ModelConfig:
    """The ``ModelConfig`` a Triton vLLM model reports after auto-complete: backend ``vllm``,
    ``max_batch_size`` 0 (the engine batches), a decoupled transaction policy (a request gets
    any number of responses), one model-kind instance, and this door's inputs and outputs."""
    return model_config_pb2.ModelConfig(
        name=name, backend=BACKEND, max_batch_size=0,
        version_policy=model_config_pb2.ModelVersionPolicy(latest=model_config_pb2.ModelVersionPolicy.Latest(
            num_versions=1)),
        input=[model_config_pb2.ModelInput(name=t.name, data_type=_CONFIG_DTYPE[t.datatype], dims=list(t.dims),
                                           optional=t.optional) for t in INPUTS],
        output=[model_config_pb2.ModelOutput(name=t.name, data_type=_CONFIG_DTYPE[t.datatype], dims=list(t.dims))
                for t in OUTPUTS],
        instance_group=[model_config_pb2.ModelInstanceGroup(name=f"{name}_0", kind=model_config_pb2.ModelInstanceGroup.KIND_MODEL,
                                                            count=1)],
        model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True))
