"""The OpenAI API's request and response bodies, as pydantic models (the shapes of OpenAI's API
reference, with vLLM's additions where warmserve has the feature).

Requests accept and ignore fields they do not know (as vLLM does; the app logs them), so a
newer client's extra fields do not fail a request. Parameters warmserve does not implement are
declared, so that a value other than their default is refused with a sentence
(:mod:`openai_service.convert`) instead of being silently ignored. Range checks that pydantic
can state (``max_tokens >= 1``, ``0 <= top_logprobs <= 20``) live here; a failed one is an HTTP
400 in OpenAI's error shape (:mod:`openai_service.errors`).

Responses are built from these models and serialised with ``None`` kept (``"logprobs": null``,
``"finish_reason": null``), as OpenAI sends them; a chat chunk's ``delta`` leaves its unset
fields out, as vLLM and OpenAI do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from services.sampling_keys import FLOAT32_MAX

#: Exclusive bound of the wire's 32-bit integers (token counts, token ids, top-k).
INT32_END = 2**31
#: The most top-n logprobs a request may ask for per token (the runner's limit, and vLLM's
#: default ``--max-logprobs``).
MAX_LOGPROBS = 20

#: What a completion's ``max_tokens`` left out (or null) means: OpenAI's default for
#: ``/v1/completions`` (and vLLM's), capped to what the context leaves after the prompt.
COMPLETION_DEFAULT_MAX_TOKENS = 16

FinishReason = Literal["stop", "length"]


class _Request(BaseModel):
    """Base of request bodies: unknown fields are kept aside (``model_extra``), not refused."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk (``choices: []``) with the usage."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions. Token counts are tokens."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=FLOAT32_MAX)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extras that the runner implements.
    top_k: Annotated[int, Field(ge=-1, lt=INT32_END)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT32_END)]] | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: one text, or one prompt's token ids (a list of
    texts or of id lists is accepted when it holds one prompt). ``max_tokens`` left out or null
    is :data:`COMPLETION_DEFAULT_MAX_TOKENS` (16, OpenAI's default), capped to what the context
    leaves (the runner caps it: ``SamplingParams.default_max_tokens``). ``logprobs``: top-n per
    token, 0..20 (0: the sampled token's)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1, lt=INT32_END)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message: ``role`` and ``content`` (text, a list of text parts, or null)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens`` (both
    unset: the model's default, capped to what the context leaves). ``logprobs``: whether to
    return the sampled tokens' logprobs; ``top_logprobs`` (0..20) adds that many alternatives
    per token and needs ``logprobs``."""

    messages: list[ChatMessage]
    max_tokens: Annotated[int, Field(ge=1, lt=INT32_END)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT32_END)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# --- responses -------------------------------------------------------------------------------------


class Usage(BaseModel):
    """Token counts of one request, exactly as the runner reported them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: one entry per generated token. ``top_logprobs[i]`` maps
    token text -> logprob for the top n and the sampled token (so up to n + 1 entries, as the
    OpenAI API and vLLM give); ``text_offset[i]`` is the sum of the lengths of the token texts
    before token ``i`` (vLLM's definition)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion choice (also a streamed chunk's choice, with a text delta)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A completions response, or one streamed chunk of it (``object`` is the same)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    """An alternative token: its text, logprob (natural log) and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    """A sampled token's logprob with its ``top_logprobs`` alternatives, most likely first."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat answer or chunk."""

    content: list[ChatLogprob] | None = None


class AssistantMessage(BaseModel):
    """The answer's message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    """One chat choice."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletion(BaseModel):
    """A chat completions response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """A chunk's ``delta``; fields left ``None`` are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed chat chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """``GET /v1/models`` entry. ``root`` is the model's source as the runner reports it;
    ``max_model_len`` its context length in tokens (vLLM's extra fields)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "warmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error object. ``type`` is vLLM's class-like name (``BadRequestError``, ...);
    ``code`` the HTTP status (vLLM), or OpenAI's string code where there is one
    (``model_not_found``); ``param`` the request field at fault, when known."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``: every error the door answers, streamed ones included."""

    error: ErrorInfo
