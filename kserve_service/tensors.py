"""KServe v2 request tensors decoded and checked, and Triton's serialized BYTES tensors, as Triton
Inference Server's vLLM backend shapes them (the door itself is :mod:`kserve_service.servicer`).

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

The ``sampling_parameters`` keys: :mod:`services.sampling_keys` (read by :mod:`kserve_service.convert`).

Every function here raises :class:`services.errors.InvalidArgument` for a malformed request.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kserve_service.model import INPUT_BY_NAME, INPUTS, OUTPUT_NAMES
from services.errors import InvalidArgument
from services.proto.triton import grpc_service_pb2 as kserve_pb2


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
    spec = INPUT_BY_NAME[tensor.name]
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
        raise InvalidArgument(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})", reason="unicode") from None


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
        if tensor.name not in INPUT_BY_NAME:
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
        if name not in OUTPUT_NAMES:
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
