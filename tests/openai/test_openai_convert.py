"""The door's conversions without a network: OpenAI bodies to ``GenerateRequest``, runner
messages to finish reasons and logprobs, gRPC statuses and validation errors to OpenAI errors."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from pydantic import ValidationError

from openai_service.convert import (
    CompletionLogprobsBuilder,
    chat_logprobs,
    chat_to_proto,
    completion_to_proto,
    finish_reason,
    usage,
)
from openai_service.errors import OpenAIError, from_rpc_error, from_validation_error, model_not_found
from openai_service.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    DeltaMessage,
)
from services.proto import generation_pb2 as pb
from services.sampling_keys import MAX_N


def completion(**kw) -> pb.GenerateRequest:
    return completion_to_proto(CompletionRequest(**{"prompt": "w1 w2", **kw}), "cmpl-1")


def chat(**kw) -> pb.GenerateRequest:
    return chat_to_proto(ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **kw}), "chat-1")


def test_unset_sampling_fields_stay_unset_and_a_completion_defaults_to_16_tokens() -> None:
    req = completion()
    assert req.request_id == "cmpl-1" and req.WhichOneof("prompt") == "text" and req.text == "w1 w2"
    s = req.sampling
    # max_tokens stays unset, so the runner caps the default to what the context leaves; the
    # default is OpenAI's for completions, 16, instead of the model's.
    assert not s.HasField("max_tokens") and s.HasField("default_max_tokens") and s.default_max_tokens == 16
    assert not any(s.HasField(f) for f in ("temperature", "top_p", "top_k", "seed"))
    assert (list(s.stop), s.logprobs, s.ignore_eos) == ([], 0, False)
    assert completion(max_tokens=None).sampling == s  # null is the same as left out
    given = completion(max_tokens=5).sampling
    assert (given.max_tokens, given.default_max_tokens) == (5, 16)  # a value given wins (the default is unused)
    c = chat().sampling
    assert not any(c.HasField(f) for f in ("max_tokens", "default_max_tokens", "temperature", "top_p", "top_k",
                                           "seed"))
    assert chat(max_tokens=None, max_completion_tokens=None).sampling == c


def test_a_completion_text_prompt_may_name_special_tokens_but_chat_content_may_not() -> None:
    req = completion(prompt="<|im_start|>user")
    assert req.text == "<|im_start|>user" and req.allow_special_tokens  # as vLLM's completions endpoint
    assert not completion(prompt=[1, 2]).allow_special_tokens  # ids are ids
    assert not chat(messages=[{"role": "user", "content": "<|im_start|>"}]).allow_special_tokens


def test_sampling_fields_reach_the_wire() -> None:
    s = completion(max_tokens=7, temperature=0.5, top_p=0.25, seed=2**63, stop="w9", top_k=-1, ignore_eos=True,
                   stop_token_ids=[4, 5], logprobs=3).sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop)) == (7, 0.5, 0.25, 2**63, ["w9"])
    assert (s.HasField("top_k"), s.top_k, s.ignore_eos, list(s.stop_token_ids), s.logprobs) == (True, 0, True, [4, 5], 3)
    assert list(completion(stop=["a", "b"]).sampling.stop) == ["a", "b"]
    assert completion(logprobs=0).sampling.logprobs == 1  # the sampled token's logprob needs one from the runner
    assert completion(top_k=40).sampling.top_k == 40


def test_completion_prompt_forms() -> None:
    assert completion(prompt=["w3"]).text == "w3"
    ids = completion(prompt=[1, 2, 3])
    assert ids.WhichOneof("prompt") == "token_ids" and list(ids.token_ids.ids) == [1, 2, 3]
    assert list(completion(prompt=[[4, 5]]).token_ids.ids) == [4, 5]
    for prompt, words in ((["a", "b"], "one prompt per request"), ([[1], [2]], "one prompt per request"),
                          ([2**31], "token ids must be in")):
        with pytest.raises(OpenAIError) as e:
            completion(prompt=prompt)
        assert e.value.status == 400 and e.value.param == "prompt" and words in e.value.message
    for empty in ("", [], [""], [[]]):  # every form of an empty prompt: one sentence
        with pytest.raises(OpenAIError) as e:
            completion(prompt=empty)
        assert (e.value.status, e.value.param, e.value.message) == (400, "prompt", "prompt must not be empty")


def test_chat_messages_become_a_chat_prompt() -> None:
    req = chat_to_proto(ChatCompletionRequest(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None},
    ], max_tokens=9, max_completion_tokens=4, logprobs=True, top_logprobs=3), "c")
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "one\ntwo"),
                                                               ("assistant", "")]
    assert req.sampling.max_tokens == 4 and req.sampling.logprobs == 3
    assert chat(max_tokens=9).sampling.max_tokens == 9
    assert chat(logprobs=True).sampling.logprobs == 1 and chat(logprobs=False).sampling.logprobs == 0


@pytest.mark.parametrize(("make", "kw", "param", "words"), [
    (completion, {"stream_options": {"include_usage": True}}, "stream_options", "`stream=True`"),
    (completion, {"echo": True}, "echo", "not supported"),
    (completion, {"best_of": 2}, "best_of", "must be 1"),
    (completion, {"suffix": "x"}, "suffix", "not supported"),
    (chat, {"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    (chat, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "guided_regex": "a+"}, "tool_choice", "cannot be combined with guided_regex"),
    (chat, {"response_format": {"type": "xml"}}, "response_format", "type 'xml' is not supported"),
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    (chat, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
     "at most one structured-output constraint, got 2: response_format, guided_regex"),
    (completion, {"guided_json": "{not json"}, "guided_json", "'guided_json' is not valid JSON"),
    (completion, {"guided_choice": []}, "guided_choice", "lists no strings"),
    (completion, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "at most one"),
    (completion, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs",
     "'structured_outputs.structural_tag' is not supported"),
    (completion, {"guided_grammar": "x" * (64 * 1024 + 1)}, "guided_grammar", "at most 65536"),
    (chat, {"top_logprobs": 2}, "top_logprobs", "`logprobs` must be set to true"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text parts"),
    (completion, {"stop": ""}, "stop", "stop strings must not be empty"),
    (chat, {"stop": ["w1", ""]}, "stop", "stop strings must not be empty"),
    (chat, {"messages": [{"role": "user", "content": "hi"}, {"role": "function", "content": "x"}]}, "messages",
     "messages[1] has unknown role 'function' (expected one of 'system', 'user', 'assistant', 'developer', 'tool')"),
    (chat, {"messages": []}, "messages", "messages must not be empty"),
    (chat, {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": None}]}, "messages",
     "messages must not be empty: every message's content is empty"),
])
def test_what_warmserve_does_not_implement_is_a_400_naming_the_parameter(make, kw, param, words) -> None:
    with pytest.raises(OpenAIError) as e:
        make(**kw)
    assert (e.value.status, e.value.type, e.value.param, e.value.code) == (400, "BadRequestError", param, 400)
    assert words in e.value.message


def test_penalties_logit_bias_and_min_tokens_reach_the_wire() -> None:
    for make in (completion, chat):
        got = make(presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.2, min_tokens=3,
                   logit_bias={"50256": -100, "0": 2.5}).sampling
        assert (got.presence_penalty, got.frequency_penalty, got.min_tokens) == (-2.0, 1.5, 3)
        assert got.HasField("repetition_penalty") and got.repetition_penalty == pytest.approx(1.2)
        assert dict(got.logit_bias) == {50256: -100.0, 0: 2.5}
    unset = completion().sampling
    assert not unset.HasField("repetition_penalty") and not unset.logit_bias and unset.presence_penalty == 0


@pytest.mark.parametrize(("kw", "param"), [
    ({"presence_penalty": 2.01}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x"), ({"logit_bias": {"05": 1}}, "logit_bias.05"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
])
def test_penalty_and_logit_bias_values_out_of_range_are_a_400_naming_the_field(kw, param) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt="w1", **kw)
    err = from_validation_error(e.value.errors())
    assert (err.status, err.param) == (400, param)


def test_n_is_sent_as_the_choices_to_generate() -> None:
    assert completion().sampling.n == 1
    assert completion(n=3).sampling.n == 3 and chat(n=MAX_N).sampling.n == MAX_N


def test_defaults_of_refused_parameters_pass() -> None:
    completion(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, echo=False, best_of=1, suffix="")
    chat(tools=[], tool_choice="none", response_format={"type": "text"}, stream=True,
         stream_options={"include_usage": False})


def test_structured_output_fields_reach_the_wire() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    assert json.loads(chat(response_format=rf).sampling.structured.json_schema) == schema
    assert chat(response_format={"type": "json_object"}).sampling.structured.json_object
    assert not chat(response_format={"type": "text"}).sampling.HasField("structured")
    assert json.loads(completion(guided_json=schema).sampling.structured.json_schema) == schema
    assert json.loads(chat(guided_json=json.dumps(schema)).sampling.structured.json_schema) == schema
    assert completion(guided_regex="[0-9]+").sampling.structured.regex == "[0-9]+"
    assert list(chat(guided_choice=["yes", "no"]).sampling.structured.choice.choices) == ["yes", "no"]
    assert completion(guided_grammar='root ::= "a"').sampling.structured.grammar == 'root ::= "a"'
    so = completion(structured_outputs={"choice": ["x"], "disable_any_whitespace": True}).sampling.structured
    assert list(so.choice.choices) == ["x"]
    assert completion(structured_outputs={"json_object": True}).sampling.structured.json_object
    assert not completion(structured_outputs={"json_object": False}).sampling.HasField("structured")
    assert not completion().sampling.HasField("structured")


def test_finish_reasons_and_usage() -> None:
    assert finish_reason(pb.GenerateResponse()) is None
    assert finish_reason(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP)) == "stop"
    assert finish_reason(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH)) == "length"
    for reason, name in ((pb.FINISH_REASON_ABORTED, "ABORTED"), (pb.FINISH_REASON_CANCELLED, "CANCELLED")):
        with pytest.raises(OpenAIError) as e:
            finish_reason(pb.GenerateResponse(finish_reason=reason, usage=pb.Usage(completion_tokens=4)))
        assert e.value.status == 500 and e.value.type == "InternalServerError"
        assert f"ended the request {name} after 4 tokens" in e.value.message
    u = usage(pb.GenerateResponse(usage=pb.Usage(prompt_tokens=7, completion_tokens=5)))
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (7, 5, 12)
    u = usage(*(pb.GenerateResponse(index=i, usage=pb.Usage(prompt_tokens=7, completion_tokens=c))
                for i, c in enumerate((5, 2, 4))))
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (7, 11, 18)  # the prompt once


def _lp(token: str, logprob: float, top: list[tuple[str, float]]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token=token, logprob=logprob, top=[pb.TopLogprob(token=t, logprob=v) for t, v in top])


def test_completion_logprobs_add_the_sampled_token_and_count_offsets_across_chunks() -> None:
    builder = CompletionLogprobsBuilder(top_n=2)
    first = builder.add([_lp("ab", -0.5, [("ab", -0.5), ("c", -1.0), ("d", -3.0)])])
    second = builder.add([_lp(" xyz", -2.0, [("q", -0.25), ("r", -1.5)]), _lp("é", -math.inf, [])])
    assert (first.tokens, first.token_logprobs, first.text_offset) == (["ab"], [-0.5], [0])
    assert first.top_logprobs == [{"ab": -0.5, "c": -1.0}]  # top 2 of the 3 sent
    assert second.tokens == [" xyz", "é"] and second.text_offset == [2, 6]
    # a sampled token outside the top n is added (n + 1 entries); -inf becomes -9999.0
    assert second.top_logprobs == [{"q": -0.25, "r": -1.5, " xyz": -2.0}, {"é": -9999.0}]
    assert second.token_logprobs == [-2.0, -9999.0]


def test_chat_logprobs_carry_bytes_and_the_top_n() -> None:
    out = chat_logprobs([_lp("é", -0.125, [("é", -0.125), ("e", -2.5), ("f", -4.0)])], top_n=2)
    assert [(e.token, e.logprob, e.bytes) for e in out] == [("é", -0.125, [0xC3, 0xA9])]
    assert [(t.token, t.logprob, t.bytes) for t in out[0].top_logprobs] == [("é", -0.125, [0xC3, 0xA9]),
                                                                          ("e", -2.5, [0x65])]
    assert chat_logprobs([_lp("x", -1.0, [("x", -1.0)])], top_n=0)[0].top_logprobs == []


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(("code", "status", "kind"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "BadRequestError"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 400, "BadRequestError"),
    (grpc.StatusCode.NOT_FOUND, 404, "NotFoundError"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "AuthenticationError"),
    (grpc.StatusCode.UNAVAILABLE, 503, "ServiceUnavailableError"),
    (grpc.StatusCode.FAILED_PRECONDITION, 503, "ServiceUnavailableError"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "GatewayTimeoutError"),
    (grpc.StatusCode.INTERNAL, 500, "InternalServerError"),
])
def test_grpc_statuses_map_to_http_statuses(code, status, kind) -> None:
    err = from_rpc_error(_RpcError(code, "the sentence"))
    assert (err.status, err.type, err.code) == (status, kind, status)
    assert err.message == ("the sentence" if status != 500 else "INTERNAL: the sentence")
    assert err.body() == {"error": {"message": err.message, "type": kind, "param": None, "code": status}}


@pytest.mark.parametrize(("details", "fields", "param"), [
    ("max_tokens 40 is more than the context leaves: ...", {"prompt": "prompt", "max_tokens": "max_tokens"},
     "max_tokens"),
    ("max_tokens 40 is more than the context leaves: ...", {"prompt": "messages",
                                                              "max_tokens": "max_completion_tokens"},
     "max_completion_tokens"),
    ("the prompt has 2000 tokens but the context holds 1024", {"prompt": "messages"}, "messages"),
    ("token id 99 is outside the vocabulary [0, 96)", {"prompt": "prompt"}, "prompt"),
    ("stop token id 99 is outside the vocabulary [0, 96)", {"prompt": "prompt"}, "stop_token_ids"),
    ("the chat template rejected the messages: x", {"prompt": "messages"}, "messages"),
    ("the structured output's regex is not valid or is over a limit: x", {"structured": "guided_regex"},
     "guided_regex"),
    ("unknown routing policy 99", {"prompt": "prompt"}, None),
    ("max_tokens 40 is more than the context leaves", None, None),
])
def test_a_runner_sentence_about_a_field_names_it_as_param(details, fields, param) -> None:
    err = from_rpc_error(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, details), fields)
    assert (err.status, err.message, err.param) == (400, details, param)
    assert from_rpc_error(_RpcError(grpc.StatusCode.UNAVAILABLE, details), fields).param is None


def test_model_not_found_and_validation_errors() -> None:
    assert model_not_found("x").body() == {"error": {"message": "The model `x` does not exist.",
                                                     "type": "NotFoundError", "param": "model",
                                                     "code": "model_not_found"}}
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt=5, max_tokens=0)
    err = from_validation_error(e.value.errors())
    assert err.status == 400 and err.param == "prompt"
    assert "max_tokens: Input should be greater than or equal to 1" in err.message
    assert err.message.startswith("invalid request: prompt: ")


@pytest.mark.parametrize(("error", "content_type", "message"), [
    ({"type": "json_invalid", "loc": ("body", 16), "msg": "JSON decode error", "input": {},
      "ctx": {"error": "Expecting value"}}, "application/json",
     "the body is not valid JSON (at character 16: Expecting value)"),
    ({"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary",
      "input": b'{"prompt": "x"}'}, "application/x-www-form-urlencoded",
     "the body must be a JSON object (Content-Type: application/json); the request has Content-Type: "
     "application/x-www-form-urlencoded"),
    ({"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary",
      "input": b"{}"}, None,
     "the body must be a JSON object (Content-Type: application/json); the request has no Content-Type"),
    ({"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary",
      "input": [1, 2]}, "application/json", "the body must be a JSON object, not a JSON array"),
    ({"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary",
      "input": None}, "application/json", "the body must be a JSON object, not JSON null"),
    ({"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}, "application/json",
     "the request has no body: send a JSON object (Content-Type: application/json)"),
])
def test_a_body_that_is_not_a_json_object_gets_one_sentence(error, content_type, message) -> None:
    err = from_validation_error([error], content_type)
    assert (err.status, err.message, err.param, err.type) == (400, message, None, "BadRequestError")


def test_a_chunk_delta_leaves_unset_fields_out() -> None:
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChatChunkChoice(delta=DeltaMessage(content="x"))])
    doc = chunk.model_dump()
    assert doc["choices"][0]["delta"] == {"content": "x"}
    assert doc["choices"][0]["finish_reason"] is None and doc["choices"][0]["logprobs"] is None
