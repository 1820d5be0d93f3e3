"""One KServe inference: a request checked into a :class:`Plan`, then the runner's messages turned
into ``ModelInferResponse`` messages (``docs/architecture.md`` §10). Used by the unary
``ModelInfer`` (:mod:`kserve_service.servicer`) and by each request of a ``ModelStreamInfer``
(:mod:`kserve_service.stream`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kserve_service.convert import generate_request, infer_response, sampling_from_request
from kserve_service.names import ModelNames
from kserve_service.tensors import InferInputs, decode_inputs, prepend_input, requested_outputs
from router_service.relay import RelayStream
from services.errors import Internal
from services.proto import generation_pb2
from services.proto.triton import grpc_service_pb2 as kserve_pb2


@dataclass(frozen=True)
class Plan:
    """One validated inference request, ready to run."""

    request: kserve_pb2.ModelInferRequest
    model: str
    inputs: InferInputs
    wanted: frozenset[str] | None
    stream: bool
    prepend: bool
    generate: generation_pb2.GenerateRequest


def plan(names: ModelNames, request: kserve_pb2.ModelInferRequest) -> Plan:
    """``request`` decoded and checked against the model ``names`` resolve. Raises
    ``WarmserveError``: ``NotFound``/``Unavailable`` from ``names``, ``InvalidArgument`` for a
    malformed request."""
    model = names.resolve(request.model_name, request.model_version)
    inputs = decode_inputs(request, model)
    wanted = requested_outputs(request, model)
    stream = bool(inputs.stream)
    prepend = prepend_input(inputs, stream=stream)
    sampling = sampling_from_request(inputs, request)
    return Plan(request, model, inputs, wanted, stream, prepend, generate_request(inputs, sampling))


def responses(plan: Plan, relay: RelayStream, *, stream_rpc: bool) -> Iterator[kserve_pb2.ModelInferResponse]:
    """The responses of one request (one per text delta when ``plan.stream``, else one with
    the whole answer); ``stream_rpc`` adds ``triton_final_response``. Raises
    ``WarmserveError`` from the relay, ``Internal`` for a generation that failed inside the
    runner or a runner stream that ended without a finish reason."""
    parts: list[str] = []
    tokens = 0  # tokens since the last response sent
    for msg in relay:
        tokens += len(msg.token_ids)
        final = msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
        if msg.finish_reason == generation_pb2.FINISH_REASON_ABORTED:
            raise Internal(f"generation failed inside runner {msg.runner_id or relay.runner_id} after "
                           f"{relay.tokens_relayed} tokens")
        if plan.stream:
            if not msg.text and not final:
                continue
            yield infer_response(plan.request, plan.model, text=msg.text, inputs=plan.inputs, wanted=plan.wanted,
                                 finish_reason=msg.finish_reason if final else None,
                                 prompt_tokens=msg.usage.prompt_tokens if final else None,
                                 output_tokens=tokens, final_flag=final)
            tokens = 0
        else:
            parts.append(msg.text)
        if final:
            if not plan.stream:
                text = (plan.inputs.text_input if plan.prepend else "") + "".join(parts)
                yield infer_response(plan.request, plan.model, text=text, inputs=plan.inputs, wanted=plan.wanted,
                                     finish_reason=msg.finish_reason, prompt_tokens=msg.usage.prompt_tokens,
                                     output_tokens=tokens, final_flag=True if stream_rpc else None)
            return
    raise Internal(f"runner {relay.runner_id}'s stream ended without a finish reason")
