"""Convert between the ``warmserve.v1.Generation`` messages and the runner's core objects: a
request's sampling settings and prompt in, the engine's outputs and start-up report out."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

from runner_service.engine import StartupReport
from runner_service.output_processor import RequestOutput
from runner_service.sampling_params import SamplingDefaults, SamplingParams
from services.errors import InvalidArgument
from services.proto import generation_pb2
from services.structured import spec_from_proto


def sampling_from_proto(sp: generation_pb2.SamplingParams) -> SamplingParams:
    """Map the proto's conventions and validate: ``max_tokens``, ``temperature``, ``top_k`` and
    ``top_p`` left unset stay ``None`` (the engine's defaults, :meth:`SamplingDefaults.resolve`);
    a field set is used as given, except ``max_tokens`` 0 (unset) and ``top_p`` 0 (1.0, off);
    ``repetition_penalty`` unset is ``None`` (off); ``n`` 0 is 1. Raises ``InvalidArgument``."""
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 0
    if max_tokens < 0:
        raise InvalidArgument(f"max_tokens must be >= 0 (0: the default), got {max_tokens}")
    temperature = sp.temperature if sp.HasField("temperature") else None
    top_p = sp.top_p if sp.HasField("top_p") else None
    if not all(math.isfinite(v) for v in (temperature, top_p) if v is not None):
        raise InvalidArgument("temperature and top_p must be finite numbers")
    return SamplingParams(
        max_tokens=max_tokens or None,
        temperature=temperature,
        top_k=sp.top_k if sp.HasField("top_k") else None,
        top_p=1.0 if top_p == 0 else top_p,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        logprobs=sp.logprobs,
        ignore_eos=sp.ignore_eos,
        default_max_tokens=sp.default_max_tokens if sp.HasField("default_max_tokens") else None,
        disable_speculative_decoding=sp.disable_speculative_decoding,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else None,
        logit_bias=dict(sp.logit_bias),
        min_tokens=sp.min_tokens,
        n=sp.n or 1,
        structured=spec_from_proto(sp.structured) if sp.HasField("structured") else None,
    )


def sampling_defaults_to_proto(defaults: SamplingDefaults) -> generation_pb2.SamplingParams:
    """``ModelInfoResponse.default_sampling``: the four defaults, every one set."""
    return generation_pb2.SamplingParams(max_tokens=defaults.max_tokens, temperature=defaults.temperature,
                                         top_k=defaults.top_k, top_p=defaults.top_p)


def message_from_proto(m: generation_pb2.ChatMessage) -> dict:
    """A ``ChatMessage`` as the tokenizer's message dict: ``role`` and ``content``, plus
    ``tool_calls`` (``[{"id", "name", "arguments"}]``), ``tool_call_id`` and ``name`` when set
    (:func:`runner_service.tokenizer.template_messages` shapes them for the template)."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def prompt_from_proto(request: generation_pb2.GenerateRequest) -> dict:
    """``text=`` / ``messages=`` / ``token_ids=`` keyword for :meth:`LLMEngine.add_request`."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return {"text": request.text, "allow_special_tokens": request.allow_special_tokens}
    if kind == "chat":
        out: dict = {"messages": [message_from_proto(m) for m in request.chat.messages]}
        if request.chat.tools:
            out["tools"] = [{"name": t.name, "description": t.description, "parameters": t.parameters}
                            for t in request.chat.tools]
        return out
    if kind == "token_ids":
        return {"token_ids": list(request.token_ids.ids)}
    raise InvalidArgument("the request has no prompt (set text, chat or token_ids)")


#: Single-token texts kept per tokenizer by :func:`token_text_decoder` (a vocabulary's worth).
_TOKEN_TEXT_CACHE = 1 << 18


def token_text_decoder(tokenizer) -> Callable[[int], str] | None:
    """The text of one token id alone, as the logprobs' ``token`` fields carry it: the
    tokenizer's decoding of ``[token_id]`` with special tokens kept (``"<|im_end|>"``, as vLLM
    and the OpenAI API show them), so a byte-level BPE piece keeps its leading space (``" the"``)
    and a piece that is part of a UTF-8 character decodes to U+FFFD. Cached per id (thread-safe).
    ``None`` for an engine without a tokenizer (the fields stay empty)."""
    if tokenizer is None:
        return None

    @lru_cache(maxsize=_TOKEN_TEXT_CACHE)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text


def output_to_proto(out: RequestOutput, runner_id: str,
                    token_text: Callable[[int], str] | None = None) -> generation_pb2.GenerateResponse:
    """One streamed engine output as a ``GenerateResponse`` (its choice in ``index``; usage only
    on a choice's final one: the prompt's tokens and that choice's completion tokens).
    ``token_text`` (:func:`token_text_decoder`) fills each logprob's ``token``, the sampled one's
    and every top-n one's; without it they stay empty. Logprobs are present only when the
    request asked for them, so the decoding costs nothing otherwise."""
    piece = token_text or (lambda _id: "")
    top_logprob = generation_pb2.TopLogprob
    msg = generation_pb2.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text,
                                          runner_id=runner_id, index=out.index)
    for lp in out.logprobs:
        msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, token=piece(lp.token_id),
                         top=[top_logprob(token_id=t, logprob=v, token=piece(t)) for t, v in lp.top])
    if out.finish_reason is not None:
        msg.finish_reason = int(out.finish_reason)
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
    return msg


def startup_report_to_proto(report: StartupReport) -> generation_pb2.StartupReport:
    """The engine's start-up report (phases and total, in seconds) as the ``StartupReport`` message."""
    return generation_pb2.StartupReport(
        phases=[generation_pb2.StartupPhase(name=p.name, seconds=p.seconds, detail=p.detail) for p in report.phases],
        total_seconds=report.total_seconds)
