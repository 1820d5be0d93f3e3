"""The OpenAI API's request and response bodies, as pydantic models (the shapes of OpenAI's API
reference, with vLLM's additions where warmserve has the feature).

Requests accept and ignore fields they do not know (as vLLM does; the app logs them), so a
newer client's extra fields do not fail a request. Field types are strict (pydantic's strict
mode: ``"16"`` is not an integer nor ``0`` a boolean; an integer is a number), as the schema
says and as OpenAI's API refuses them. Parameters warmserve does not implement are
declared, so that a value other than their default is refused with a sentence
(:mod:`openai_service.convert`) instead of being silently ignored. Range checks that pydantic
can state (``max_tokens >= 1``, ``0 <= top_logprobs <= 20``, the penalties' ranges, ``logit_bias``'s
keys, values and size, from :mod:`services.sampling_keys`' constants) live here; a failed one is an HTTP
400 in OpenAI's error shape (:mod:`openai_service.errors`).

The JSON schema of each request (``GET /openapi.json`` with ``--enable-docs``) states what the
door accepts, refusals included: fields that may hold only their default say so (``enum``,
``maxItems: 0``, ...), ``prompt`` and ``messages`` must not be empty, roles and content parts
are listed, and ``stream_options``/``top_logprobs`` need ``stream``/``logprobs`` (``if``/``then``).
These are schema annotations only: the door's own checks (:mod:`openai_service.convert`) keep
their sentences. A string anywhere in a body that UTF-8 cannot encode (a lone surrogate, from a
JSON ``"\ud800"`` escape or from bytes a lenient decoder let through) is refused as the body
is validated (error type ``invalid_unicode``), before anything would try to encode it.

Responses are built from these models and serialised with ``None`` kept (``"logprobs": null``,
``"finish_reason": null``), as OpenAI sends them; a chat chunk's ``delta`` leaves its unset
fields out, as vLLM and OpenAI do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from services.sampling_keys import (
    FLOAT32_MAX,
    LOGIT_BIAS_MAX,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    PENALTY_MAX,
    REPETITION_PENALTY_MAX,
)
from services.structured import MAX_CHOICES

#: Exclusive bound of the wire's 32-bit integers (token counts, token ids, top-k).
INT32_END = 2**31
#: The most top-n logprobs a request may ask for per token (the runner's limit, and vLLM's
#: default ``--max-logprobs``).
MAX_LOGPROBS = 20

#: A ``logit_bias`` key: a token id as OpenAI sends it, a string of decimal digits, no leading zero,
#: below 10**9 (within the wire's int32; no vocabulary comes near it).
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,8})$"

#: ``logit_bias``: token id -> bias, at most :data:`MAX_LOGIT_BIAS_ENTRIES` entries.
LogitBias = Annotated[dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)],
                           Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]],
                      Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
                      WithJsonSchema({"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                                      "propertyNames": {"pattern": TOKEN_ID_KEY},
                                      "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_MAX,
                                                               "maximum": LOGIT_BIAS_MAX}})]
#: ``presence_penalty``/``frequency_penalty``: in [-2, 2].
Penalty = Annotated[float, Field(ge=-PENALTY_MAX, le=PENALTY_MAX)]

#: What a completion's ``max_tokens`` left out (or null) means: OpenAI's default for
#: ``/v1/completions`` (and vLLM's), capped to what the context leaves after the prompt.
COMPLETION_DEFAULT_MAX_TOKENS = 16

FinishReason = Literal["stop", "length", "tool_calls"]

def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: An integer field of a request: strict (no strings, no booleans), but ``16.0`` is ``16``, as
#: JSON Schema counts an integral number as an integer.
Int = Annotated[int, BeforeValidator(_integral)]


def _int(**bounds: int) -> Any:
    """:data:`Int` within pydantic ``Field`` bounds (``ge``, ``lt``, ...); the bounds come before
    the validator so that they reach the JSON schema."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]

#: Chat roles a request may use (``developer`` is sent as ``system``; the runner takes the rest).
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
#: Most functions one request may declare in ``tools`` (OpenAI's limit).
MAX_TOOLS = 128


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_text(body: Any) -> str | None:
    """Where in a parsed JSON ``body`` a string (value or field name) holds a lone surrogate,
    as a dotted path (``messages[0].content``), ``None`` when every string is valid Unicode.
    Iterative, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return where or "the body"
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not _encodable(key):
                    return f"a field name in {where}" if where else "a field name"
                name = str(key)[:64]
                stack.append((item, f"{where}.{name}" if where else name))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def _if_then(field: str, when: dict, then_field: str, then: dict) -> dict:
    """A JSON-schema ``if``/``then``: when ``field`` is present and matches ``when``,
    ``then_field`` must be present and match ``then``."""
    return {"if": {"properties": {field: when}, "required": [field]},
            "then": {"properties": {then_field: then}, "required": [then_field]}}


#: One entry of ``tools``: a function (``openai_service.tools`` checks the same).
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}

#: ``stream_options`` is refused unless ``stream`` is true.
_STREAM_OPTIONS_NEED_STREAM = _if_then("stream_options", {"type": "object"}, "stream", {"const": True})


#: A prompt token id in the schema (the wire's int32; the runner checks the vocabulary).
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT32_END - 1}
#: A message whose content has a character that is not whitespace (the door refuses a chat
#: whose every message is empty or blank).
_SOME_TEXT = {"required": ["content"], "properties": {"content": {"anyOf": [
    {"type": "string", "pattern": "\\S"},
    {"type": "array", "contains": {"required": ["text"], "properties": {"text": {"type": "string", "pattern": "\\S"}}}}]}}}


class _Request(BaseModel):
    """Base of request bodies: unknown fields are kept aside (``model_extra``), not refused;
    a string UTF-8 cannot encode is a validation error (type ``invalid_unicode``, ``ctx``
    ``where``: its path, ``param``: its top-level field)."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = unencodable_text(data)
        if where is not None:
            param = where.split(".")[0].split("[")[0] if not where.startswith(("a field name", "the body")) else None
            raise PydanticCustomError(
                "invalid_unicode", "{where} is not valid Unicode text: it holds a lone surrogate, which UTF-8 "
                "cannot encode", {"where": where, "param": param})
        return data


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk (``choices: []``) with the usage."""

    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool | None = False


#: The schema of a structured-output constraint's pieces (what the door and the runner accept;
#: the runner also refuses a schema or grammar that does not compile, which no schema can say).
_NONEMPTY = {"type": "string", "minLength": 1}
_CHOICES = {"type": "array", "items": _NONEMPTY, "minItems": 1, "maxItems": MAX_CHOICES}
_NULL = {"type": "null"}
#: vLLM's constraint keys of ``structured_outputs`` when set (a null one is not).
_VLLM_SET = {"json": {"type": "object"}, "regex": {"type": "string"}, "choice": {"type": "array"},
             "grammar": {"type": "string"}, "json_object": {"const": True}}


def _at_most_one(set_when: dict[str, dict]) -> dict:
    """A JSON-schema clause: no two of the properties set (each as ``set_when`` says)."""
    keys = list(set_when)
    return {"not": {"anyOf": [{"required": [a, b], "properties": {a: set_when[a], b: set_when[b]}}
                              for i, a in enumerate(keys) for b in keys[i + 1:]]}}


_STRUCTURED_OUTPUTS = {
    "type": "object", "additionalProperties": False, **_at_most_one(_VLLM_SET),
    "properties": {"json": {"anyOf": [{"type": "object"}, _NULL]}, "regex": {"anyOf": [_NONEMPTY, _NULL]},
                   "choice": {"anyOf": [_CHOICES, _NULL]}, "grammar": {"anyOf": [_NONEMPTY, _NULL]},
                   "json_object": {"anyOf": [{"type": "boolean"}, _NULL]}, "whitespace_pattern": _NULL,
                   "backend": {}, "disable_fallback": {}, "disable_any_whitespace": {},
                   "disable_additional_properties": {}}}
_RESPONSE_FORMAT = {"type": "object", "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
                    **_if_then("type", {"const": "json_schema"}, "json_schema", {
                        "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}})}
#: Each structured-output field when it sets a constraint (not null; ``response_format`` not text).
_CONSTRAINT_SET = {"guided_json": {"type": "object"}, "guided_regex": {"type": "string"},
                   "guided_choice": {"type": "array"}, "guided_grammar": {"type": "string"},
                   "structured_outputs": {"type": "object", "anyOf": [{"required": [k], "properties": {k: v}}
                                                                       for k, v in _VLLM_SET.items()]},
                   "response_format": {"type": "object", "required": ["type"],
                                       "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}


def _at_most_one_constraint(fields: tuple[str, ...]) -> dict:
    """A JSON-schema clause: no two of ``fields`` set a constraint."""
    return _at_most_one({f: _CONSTRAINT_SET[f] for f in fields})


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions. Token counts are tokens. ``n``:
    choices to generate, 1..:data:`~services.sampling_keys.MAX_N`."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM, _at_most_one_constraint(_GUIDED)]})

    model: str | None = None
    n: _int(ge=1, le=MAX_N) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}},
        {"type": "null"}]})] = None
    temperature: Annotated[float, Field(ge=0, le=FLOAT32_MAX)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: _int(ge=0, lt=2**64) | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # vLLM's sampling extras that the runner implements.
    top_k: _int(ge=-1, lt=INT32_END) | None = None
    ignore_eos: bool = False
    stop_token_ids: list[_int(ge=0, lt=INT32_END)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=REPETITION_PENALTY_MAX)] | None = None
    min_tokens: _int(ge=0, lt=INT32_END) | None = None
    # vLLM's structured-output extras (at most one constraint per request, ``response_format``
    # included; see services.structured): a JSON schema (object or JSON text), a regex, strings
    # to choose one of, a grammar (Lark or GBNF), or vLLM's newer ``structured_outputs`` object
    # ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}).
    guided_json: Annotated[dict[str, Any] | str | None, WithJsonSchema({"anyOf": [
        {"type": "object"}, {"type": "null"}]})] = None
    guided_regex: Annotated[str | None, WithJsonSchema({"anyOf": [_NONEMPTY, {"type": "null"}]})] = None
    guided_choice: Annotated[list[str] | None, WithJsonSchema({"anyOf": [_CHOICES, {"type": "null"}]})] = None
    guided_grammar: Annotated[str | None, WithJsonSchema({"anyOf": [_NONEMPTY, {"type": "null"}]})] = None
    structured_outputs: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [
        _STRUCTURED_OUTPUTS, {"type": "null"}]})] = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: one text, or one prompt's token ids (a list of
    texts or of id lists is accepted when it holds one prompt). ``max_tokens`` left out or null
    is :data:`COMPLETION_DEFAULT_MAX_TOKENS` (16, OpenAI's default), capped to what the context
    leaves (the runner caps it: ``SamplingParams.default_max_tokens``). ``logprobs``: top-n per
    token, 0..20 (0: the sampled token's)."""

    prompt: Annotated[str | list[str] | list[Int] | list[list[Int]], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_ID, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1}, "minItems": 1,
         "maxItems": 1}]})]
    max_tokens: _int(ge=1, lt=INT32_END) | None = None
    logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = Field(False, json_schema_extra={"enum": [False]})
    best_of: Int | None = Field(None, json_schema_extra={"enum": [1, None]})
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})


def _text_parts_only(schema: dict) -> None:
    schema["properties"]["type"]["enum"] = ["text"]
    schema["properties"]["text"] = {"type": "string", "title": "Text"}
    schema["required"] = ["type", "text"]


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported
    (anything else is refused by :mod:`openai_service.convert`, as the schema says)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_text_parts_only)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message: ``role`` and ``content`` (text, a list of text parts, or null)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens`` (both
    unset: the model's default, capped to what the context leaves). ``logprobs``: whether to
    return the sampled tokens' logprobs; ``top_logprobs`` (0..20) adds that many alternatives
    per token and needs ``logprobs``."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM,
        _if_then("top_logprobs", {"type": "integer", "minimum": 1}, "logprobs", {"const": True}),
        _at_most_one_constraint((*_GUIDED, "response_format"))]})

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1, "contains": _SOME_TEXT})
    max_tokens: _int(ge=1, lt=INT32_END) | None = None
    max_completion_tokens: _int(ge=1, lt=INT32_END) | None = None
    logprobs: bool | None = False
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    # Functions the model may call and how (openai_service.tools): "none", "auto" (the default
    # with tools), "required", or {"type": "function", "function": {"name": ...}}.
    tools: list[Any] | None = Field(None, json_schema_extra={"maxItems": MAX_TOOLS, "items": _TOOL})
    # The schema lists the choices every tool list takes; "required" and a named function are
    # accepted too, when the tools allow them (a 400 names tool_choice otherwise).
    tool_choice: Any = Field(None, json_schema_extra={"anyOf": [{"enum": ["none", "auto"]}, {"type": "null"}]})
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [
        _RESPONSE_FORMAT, {"type": "null"}]})] = None


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
    """The answer's message: text ``content``, or ``tool_calls`` (``[{"id", "type": "function",
    "function": {"name", "arguments"}}]``, arguments JSON text) with ``content`` ``None``."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


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
    tool_calls: list[dict[str, Any]] | None = None  # [{"index", "id"?, "type"?, "function": {...}}]

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


class Health(BaseModel):
    """``GET /health`` when the router has a READY runner: that runner's id."""

    status: Literal["ok"] = "ok"
    runner_id: str


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
