"""OpenAI requests to ``warmserve.v1.Generation`` requests, and ``GenerateResponse`` messages back
to OpenAI's choices, logprobs, finish reasons and usage.

Requests: a completion's prompt becomes ``GenerateRequest.text`` (raw text, no chat template,
with ``allow_special_tokens``: special-token text such as ``<|im_start|>`` is the control token,
as vLLM's completions endpoint tokenizes it) or ``token_ids``; chat messages become a
``ChatPrompt`` (the runner applies the model's chat template and keeps content plain text), each
message's content a string or its text parts joined with ``"\\n"`` (as vLLM joins them), role
``developer`` sent as ``system``. Sampling fields left out (or null) stay unset on the wire, so
the runner applies the model's defaults (its ``generation_config.json``); a completion's unset
``max_tokens`` is sent as ``default_max_tokens`` 16 (OpenAI's default), which the runner caps to
what the context leaves like its own default. ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` (token id strings -> bias) and vLLM's extra ``repetition_penalty`` and
``min_tokens`` are sent as the runner's fields (their ranges checked by
:mod:`openai_service.protocol`; token ids outside the vocabulary and a ``min_tokens`` above
``max_tokens`` by the runner, a 400 either way). ``n`` (1..:data:`~services.sampling_keys.MAX_N`
choices) is sent as ``SamplingParams.n``. Structured output: a chat's ``response_format``
(``json_object``, or ``json_schema`` with its ``schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs`` become
``SamplingParams.structured`` (:mod:`services.structured`; at most one per request); the runner
compiles it, and a schema or grammar it refuses is a 400 naming the field. Parameters warmserve
does not implement (``echo``, ``best_of`` other than 1, ``suffix``) are refused with an HTTP 400
naming them, as are an empty prompt, empty stop strings and unknown chat roles.

Responses: finish reasons STOP and LENGTH become ``"stop"`` and ``"length"``; a stream the
runner ended as ABORTED or CANCELLED is an error (HTTP 500, as vLLM answers a request whose
generation failed). Logprobs carry the runner's per-token texts (``TokenLogprob.token``, the
tokenizer's decoding of that one id) and its natural-log values, clipped at -9999.0 as vLLM
and OpenAI clip ``-inf``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from openai_service.errors import OpenAIError, bad_request
from openai_service.protocol import (
    CHAT_ROLES,
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
    Usage,
)
from openai_service.tools import ToolPlan, message_to_proto, plan, tools_to_proto
from services.errors import InvalidArgument
from services.proto import generation_pb2
from services.sampling_keys import sampling_from_dict
from services.structured import GUIDED_KEYS, spec_to_proto, structured_from_keys

#: The lowest logprob sent (``-inf`` is not JSON; vLLM and OpenAI send this instead).
MIN_LOGPROB = -9999.0
#: The exclusive end of token ids on the wire (``int32``).
_ID_END = 2**31

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}


def _refuse(value_set: bool, param: str, why: str = "is not supported by warmserve") -> None:
    if value_set:
        raise bad_request(f"{param} {why}", param=param)


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    """The checks every request shares; raises :class:`OpenAIError` (HTTP 400)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", param="stream_options")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    return stops


def sampling_to_proto(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                      logprobs: int, default_max_tokens: int | None = None) -> generation_pb2.SamplingParams:
    """The request's sampling fields; ``None`` ones stay unset (the model's defaults apply).
    ``max_tokens``: tokens to generate at most (``None``: ``default_max_tokens`` when given, else
    the model's default, either capped by the runner to what the context leaves); ``logprobs``:
    top-n per token for the runner (0: none). The vLLM keys go through
    :func:`services.sampling_keys.sampling_from_dict` (``top_k = -1`` means off, the runner's 0).
    Raises :class:`OpenAIError` (400) for an empty stop string."""
    keys = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "seed": req.seed, "stop": _stop_list(req.stop), "stop_token_ids": list(req.stop_token_ids or ()),
            "ignore_eos": req.ignore_eos, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
            "min_tokens": req.min_tokens, "logit_bias": req.logit_bias}
    try:
        out = sampling_from_dict(keys)
    except InvalidArgument as e:  # pydantic has checked the ranges already; a stray value is still a 400
        raise bad_request(str(e)) from None
    out.logprobs = logprobs
    out.n = req.n
    if default_max_tokens is not None:
        out.default_max_tokens = default_max_tokens
    keys = _structured_keys(req)
    try:
        spec = structured_from_keys(keys)
    except InvalidArgument as e:
        raise bad_request(str(e), param=structured_param(req)) from None
    if spec is not None:
        out.structured.CopyFrom(spec_to_proto(spec))
    return out


def _structured_keys(req: CompletionRequest | ChatCompletionRequest) -> dict[str, object]:
    """The request's structured-output fields that are set (``response_format`` of type text is not)."""
    response_format = getattr(req, "response_format", None)
    keys = {"response_format": None if response_format is None or response_format.get("type", "text") == "text"
            else response_format}
    keys.update((k, getattr(req, k)) for k in (*GUIDED_KEYS, "structured_outputs"))
    return {k: v for k, v in keys.items() if v is not None}


def structured_param(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The field that sets the request's structured output (the first, when several do), the
    ``param`` of a 400 about it; ``None`` when none does."""
    return next(iter(_structured_keys(req)), None)


def _prompt(prompt: str | list) -> dict:
    """``{"text": ..., "allow_special_tokens": True}`` or ``{"token_ids": TokenIds}`` for a
    completion's ``prompt``; one prompt only (a list holding one text or one id list counts as
    one). Special-token text in a text prompt is the control token, as vLLM tokenizes it."""
    if not prompt:  # "", [], [""], [[]]: the same sentence whatever the form
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt, str):
        return {"text": prompt, "allow_special_tokens": True}
    if isinstance(prompt[0], str) or isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise bad_request(f"one prompt per request: warmserve does not batch prompts (got {len(prompt)})",
                              param="prompt")
        return _prompt(prompt[0])
    ids = list(prompt)
    if any(not 0 <= t < _ID_END for t in ids):
        raise bad_request("prompt token ids must be in [0, vocab_size)", param="prompt")
    return {"token_ids": generation_pb2.TokenIds(ids=ids)}


def completion_to_proto(req: CompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """A ``POST /v1/completions`` body as a ``GenerateRequest`` (raw text or token ids, no
    chat template). ``max_tokens`` left out or null stays unset, with ``default_max_tokens`` 16.
    Raises :class:`OpenAIError` (400) for what warmserve does not implement."""
    _check_common(req)
    _refuse(req.echo, "echo")
    _refuse(req.best_of not in (None, 1), "best_of", "must be 1 (or left out): warmserve does not rank choices "
            "(ask for n choices instead)")
    _refuse(bool(req.suffix), "suffix")
    sampling = sampling_to_proto(req, max_tokens=req.max_tokens, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
                                 logprobs=0 if req.logprobs is None else max(req.logprobs, 1))
    return generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling, **_prompt(req.prompt))


def _content(message_index: int, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{message_index}].content[{j}] has type {part.type!r}: only text parts "
                              "are supported", param="messages")
        texts.append(part.text)
    return "\n".join(texts)


def chat_tools(req: ChatCompletionRequest) -> tuple[list[generation_pb2.Tool], ToolPlan]:
    """The request's ``tools`` as protos and how its ``tool_choice`` is served
    (:mod:`openai_service.tools`); raises :class:`OpenAIError` (400) for bad ones."""
    tools = tools_to_proto(req.tools)
    return tools, plan(req.tool_choice, tools)


def chat_to_proto(req: ChatCompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """A ``POST /v1/chat/completions`` body as a ``GenerateRequest`` with a ``ChatPrompt``.
    ``max_completion_tokens`` or ``max_tokens``, both unset: the model's default, capped to what
    the context leaves. Raises :class:`OpenAIError` (400) for what warmserve does not implement,
    for ``top_logprobs`` without ``logprobs`` (as vLLM), for no messages, only empty ones or an
    unknown role (``param`` ``messages``), and for bad ``tools`` / ``tool_choice`` or a forced
    tool call beside another structured-output field. A named or required ``tool_choice``
    constrains the output to :class:`~openai_service.tools.ToolPlan`'s schema."""
    _check_common(req)
    tools, tool_plan = chat_tools(req)
    if tool_plan.constrained and structured_param(req) is not None:
        raise bad_request(f"tool_choice {tool_plan.mode!r} constrains the output to the tool's arguments; it cannot "
                          f"be combined with {structured_param(req)}", param="tool_choice")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}] has unknown role {m.role!r} (expected one of "
                              f"{', '.join(repr(r) for r in CHAT_ROLES)})", param="messages")
    messages = [message_to_proto("system" if m.role == "developer" else m.role, _content(i, m.content), m)
                for i, m in enumerate(req.messages)]
    if all(not m.content.strip() and not m.tool_calls for m in messages):
        raise bad_request("messages must not be empty: every message's content is empty", param="messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    sampling = sampling_to_proto(req, max_tokens=max_tokens,
                                 logprobs=max(req.top_logprobs or 0, 1) if req.logprobs else 0)
    if tool_plan.constrained:
        sampling.structured.json_schema = tool_plan.schema
    return generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling,
                                          chat=generation_pb2.ChatPrompt(messages=messages, tools=tools))


def finish_reason(resp: generation_pb2.GenerateResponse) -> str | None:
    """``"stop"``/``"length"`` for the final message, ``None`` for the others. Raises
    :class:`OpenAIError` (500) when the runner ended the request ABORTED (it failed while
    generating) or CANCELLED."""
    if not resp.finish_reason:
        return None
    name = FINISH_REASONS.get(resp.finish_reason)
    if name is not None:
        return name
    what = generation_pb2.FinishReason.Name(resp.finish_reason).removeprefix("FINISH_REASON_")
    raise OpenAIError(500, f"the runner ended the request {what} after {resp.usage.completion_tokens} tokens "
                           "without finishing it (see its log)")


def usage(*finals: generation_pb2.GenerateResponse) -> Usage:
    """The usage of a request from its choices' final messages (at least one), as the runner
    counted them (tokens): the prompt's tokens once (every choice has the same prompt), the
    completion tokens summed over the choices, as OpenAI counts ``n`` choices."""
    prompt = finals[0].usage.prompt_tokens
    completion = sum(f.usage.completion_tokens for f in finals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _clip(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class CompletionLogprobsBuilder:
    """Legacy completions logprobs, one call of :meth:`add` per message; ``text_offset``
    counts on across calls, so a stream's chunks and the whole answer agree. ``top_n``: the
    alternatives asked for (0: only the sampled token's entry)."""

    def __init__(self, top_n: int) -> None:
        self.top_n = top_n
        self.offset = 0

    def add(self, logprobs: Iterable[generation_pb2.TokenLogprob],
            into: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """Append these tokens' entries to ``into`` (a new object when ``None``); returns it."""
        out = into if into is not None else CompletionLogprobs()
        for lp in logprobs:
            top: dict[str, float] = {}
            for alt in lp.top[: self.top_n]:
                top.setdefault(alt.token, _clip(alt.logprob))
            top.setdefault(lp.token, _clip(lp.logprob))  # the sampled token is always there (up to n + 1)
            out.tokens.append(lp.token)
            out.token_logprobs.append(_clip(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(lp.token)
        return out


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: Sequence[generation_pb2.TokenLogprob], top_n: int) -> list[ChatLogprob]:
    """``choices[].logprobs.content`` entries for these tokens: text, logprob, UTF-8 bytes and
    the ``top_n`` most likely alternatives (most likely first)."""
    return [ChatLogprob(token=lp.token, logprob=_clip(lp.logprob), bytes=_utf8(lp.token),
                        top_logprobs=[TopLogprob(token=t.token, logprob=_clip(t.logprob), bytes=_utf8(t.token))
                                      for t in lp.top[:top_n]])
            for lp in logprobs]
