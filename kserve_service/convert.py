"""A decoded KServe request -> the ``Generate`` call, and runner messages -> ``ModelInferResponse``,
as Triton's vLLM backend shapes them (``docs/architecture.md`` §10; the tensors:
:mod:`kserve_service.tensors`; the sampling keys: :mod:`services.sampling_keys`).

A sampling key left out takes warmserve's default (the model's ``generation_config.json``, else
greedy and 64 tokens), not vLLM's ``SamplingParams`` defaults. Every function raises
:class:`services.errors.InvalidArgument` for a malformed request.
"""

from __future__ import annotations

import json
import struct

from kserve_service.model import MODEL_VERSION
from kserve_service.tensors import InferInputs, serialize_bytes
from services.errors import InvalidArgument
from services.proto import generation_pb2
from services.proto.triton import grpc_service_pb2 as kserve_pb2
from services.sampling_keys import sampling_from_dict
from services.structured import MAX_STRUCTURED_BYTES
from services.utf8 import utf8_size

#: Request parameters Triton's gRPC frontend keeps for itself (tritonclient's
#: ``TRITON_RESERVED_REQUEST_PARAMS``, plus every ``triton_*`` key): never sampling parameters.
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "headers", "binary_data_output"})

#: warmserve finish reason -> the string vLLM reports (``str(CompletionOutput.finish_reason)``).
FINISH_REASON_NAMES = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_CANCELLED: "abort",
    generation_pb2.FINISH_REASON_ABORTED: "abort",
}


#: The largest ``sampling_parameters`` JSON text, in UTF-8 bytes: every key at its limit (16 stop
#: strings of 256 bytes, each character \u-escaped: 24 KiB; 64 stop token ids; 300 ``logit_bias``
#: entries of about 36 bytes: 11 KiB) fits with room, and a structured-output constraint at its
#: limit, escaped (JSON escapes at most triple a UTF-8 byte count: a 2-byte character as \uXXXX).
#: 256 KiB.
MAX_SAMPLING_JSON_BYTES = (64 << 10) + 3 * MAX_STRUCTURED_BYTES


def sampling_from_json(text: str) -> generation_pb2.SamplingParams:
    """:func:`sampling_from_dict` of the ``sampling_parameters`` tensor's JSON text (at most
    :data:`MAX_SAMPLING_JSON_BYTES` of UTF-8). Raises ``InvalidArgument`` for longer text
    (reason ``sampling_bytes``), text that is not a JSON object (nesting deeper than the parser
    goes included: one sentence, never the parser's exception), and as :func:`sampling_from_dict`."""
    size = utf8_size(text, "input 'sampling_parameters'")
    if size > MAX_SAMPLING_JSON_BYTES:
        raise InvalidArgument(f"input 'sampling_parameters' is {size} bytes; at most {MAX_SAMPLING_JSON_BYTES} "
                              "are allowed", reason="sampling_bytes")
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"input 'sampling_parameters' is not valid JSON: {e}") from None
    except (RecursionError, ValueError):  # nesting too deep for the parser; a number too long to convert
        raise InvalidArgument("input 'sampling_parameters' is not a JSON object warmserve can read "
                              "(nested too deeply or a number too long)") from None
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
