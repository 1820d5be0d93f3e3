"""The OpenAI-compatible door through the official ``openai`` Python client, unmodified, against
a runner and a router in this process (tests/openai/conftest.py): every answer is compared with
the same request sent through the Python ``GenerationClient`` to the router (text, finish
reason, usage, logprobs), and with what the word-level tokenizer implies (token ``i`` is the
word ``w{i}``, so a token's text is ``f"w{i}"`` and a text's tokens are its words)."""

from __future__ import annotations

import itertools
import json
import os
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection

import openai
import pytest
from fake_runner import FakeBehaviour, FakeRunner
from tokenizers import Tokenizer

from openai_service.config import OpenAIConfig
from openai_service.daemon import OpenAIServer
from openai_service.healthcheck import check_http_health
from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from services.bootstrap import ServerConfig, ServiceServer
from services.generation_client import GENERATION_SERVICE, GenerationClient, chat_request, text_request
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc

PROMPT = "w5 w6 w7"
MODEL = "tiny-llama"  # the checkpoint directory's name: the default served model name
#: A system message ending in a space: the tiny template concatenates contents, so the prompt
#: reads "w9 w8 w5 w6 w7" (5 tokens).
MESSAGES = [("system", "w9 w8 "), ("user", PROMPT)]
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@pytest.fixture(scope="module")
def client(door):
    c = openai.OpenAI(base_url=door.url, api_key="unused", max_retries=0)
    yield c
    c.close()


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def reference(door, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """The same request through the gRPC path (GenerationClient -> router -> runner)."""
    with GenerationClient(door.router) as c:
        return list(c.stream(request, timeout_s=60))


def text_of(messages) -> str:
    return "".join(m.text for m in messages)


def logprobs_of(messages) -> list[pb.TokenLogprob]:
    return [lp for m in messages for lp in m.logprobs]


def chat_messages(pairs) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


def http(door, method: str, path: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a raw HTTP request to the door (``path`` under /v1
    unless it starts with /health); ``headers`` replace the default JSON ``Content-Type``."""
    base = door.url.removesuffix("/v1")
    url = base + (path if path.startswith("/health") else "/v1" + path)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if headers is None else headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_models_list_names_the_served_model(door, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.owned_by == "warmserve" and card.object == "model"
    assert card.model_extra["root"] == door.model_source
    assert card.model_extra["max_model_len"] == door.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other-model")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert e.value.body["message"] == "The model `other-model` does not exist."


def test_completion_equals_the_grpc_path_with_and_without_stream(door, client) -> None:
    ref = reference(door, text_request(PROMPT, greedy(12)))
    text, final = text_of(ref), ref[-1]
    ids = [t for m in ref for t in m.token_ids]
    assert text == " ".join(f"w{i}" for i in ids) and ids  # the word-level tokenizer's decoding

    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")
    assert len(got.choices) == 1 and got.choices[0].text == text
    assert got.choices[0].finish_reason == FINISH[final.finish_reason]
    assert got.choices[0].logprobs is None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        final.usage.prompt_tokens, final.usage.completion_tokens,
        final.usage.prompt_tokens + final.usage.completion_tokens)
    assert got.usage.prompt_tokens == 3 and got.usage.completion_tokens == len(ids)

    # The same by the model's source, and as token ids.
    assert client.completions.create(model=door.model_source, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text == text
    assert client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12,
                                     temperature=0).choices[0].text == text

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == FINISH[final.finish_reason]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in plain) == text and all(c.choices for c in plain)


def test_chat_equals_the_grpc_path_for_the_same_chat_prompt(door, client) -> None:
    ref = reference(door, chat_request(MESSAGES, greedy(10)))
    text, final = text_of(ref), ref[-1]
    assert text

    got = client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=10, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == FINISH[final.finish_reason] and choice.logprobs is None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (final.usage.prompt_tokens,
                                                                      final.usage.completion_tokens)
    assert got.usage.prompt_tokens == 5

    # Content as text parts is joined with "\n" (vLLM): the same words, so the same answer; and
    # the developer role is a system message.
    parts = [{"role": "developer", "content": "w9 w8 "},
             {"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6 w7"}]}]
    ref_parts = reference(door, chat_request([("system", "w9 w8 "), ("user", "w5\nw6 w7")], greedy(10)))
    by_parts = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, temperature=0)
    assert by_parts.choices[0].message.content == text_of(ref_parts) == text

    chunks = list(client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == FINISH[final.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_stop_strings_and_token_limits(door, client) -> None:
    ref = reference(door, text_request(PROMPT, greedy(12, ignore_eos=True)))
    words = [f"w{t}" for m in ref for t in m.token_ids]
    text = text_of(ref)
    assert text == " ".join(words)
    k = next(i for i in range(2, len(words)) if not any(words[i] in w for w in words[:i]))
    expected = text[: text.index(words[k])]  # everything before the stop string, which is left out

    for stop in (words[k], ["w999", words[k]]):
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == k + 1  # the token that completed the stop string counts
    via_grpc = reference(door, text_request(PROMPT, greedy(12, ignore_eos=True, stop=[words[k]])))
    assert text_of(via_grpc) == expected and via_grpc[-1].usage.completion_tokens == k + 1

    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == " ".join(words[:3]) and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 3

    # max_completion_tokens wins over max_tokens (as in vLLM); either alone limits the answer.
    chat = client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=5,
                                          max_completion_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 2 and chat.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4


def test_completion_logprobs_equal_the_grpc_path(door, client) -> None:
    ref = logprobs_of(reference(door, text_request(PROMPT, greedy(6, ignore_eos=True, logprobs=3))))
    assert len(ref) == 6 and all(len(lp.top) == 3 for lp in ref)

    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert got.tokens == [f"w{lp.token_id}" for lp in ref] == [lp.token for lp in ref]
    assert got.token_logprobs == [lp.logprob for lp in ref]
    # greedy: the sampled token is the most likely, so each dict is exactly the top 3
    assert got.top_logprobs == [{f"w{t.token_id}": t.logprob for t in lp.top} for lp in ref]
    assert all(lp.top[0].token_id == lp.token_id for lp in ref)
    assert got.text_offset == list(itertools.accumulate([0] + [len(t) for t in got.tokens[:-1]]))
    assert all(v <= 0 for v in got.token_logprobs)

    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}))
    with_lp = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs is not None]
    assert [t for lp in with_lp for t in lp.tokens] == got.tokens
    assert [v for lp in with_lp for v in lp.token_logprobs] == got.token_logprobs
    assert [d for lp in with_lp for d in lp.top_logprobs] == got.top_logprobs
    assert [o for lp in with_lp for o in lp.text_offset] == got.text_offset

    # logprobs=0: the sampled token's entry only
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(got.tokens, got.token_logprobs, strict=True)]


def test_chat_logprobs_equal_the_grpc_path(door, client) -> None:
    ref = logprobs_of(reference(door, chat_request(MESSAGES, greedy(5, ignore_eos=True, logprobs=2))))
    got = client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [f"w{lp.token_id}" for lp in ref]
    assert [c.logprob for c in content] == [lp.logprob for lp in ref]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert [[(t.token, t.logprob, t.bytes) for t in c.top_logprobs] for c in content] == [
        [(f"w{t.token_id}", t.logprob, list(f"w{t.token_id}".encode())) for t in lp.top] for lp in ref]

    streamed = list(client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=5,
                                                   temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == content

    bare = client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=5, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert [(c.token, c.logprob, c.top_logprobs) for c in bare] == [(c.token, c.logprob, []) for c in content]

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), top_logprobs=2)
    assert e.value.param == "top_logprobs" and "`logprobs` must be set to true" in e.value.message


def test_n_out_of_range_is_a_400(client) -> None:  # n in range: tests/openai/test_openai_choices.py
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": chat_messages(MESSAGES)})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, n=17, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.param == "n" and e.value.type == "BadRequestError"


def test_a_prompt_over_the_context_length_is_a_400(door, client) -> None:
    long_prompt = " ".join(["w5"] * (door.max_model_len + 5))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, stream=stream)
        assert e.value.status_code == 400 and e.value.type == "BadRequestError" and e.value.code == "400"
        assert str(door.max_model_len) in e.value.message and "context" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:  # more tokens than the context leaves
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=door.max_model_len)
    assert "max_tokens" in e.value.message and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES),
                                       max_completion_tokens=door.max_model_len)
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    assert e.value.param == "messages" and "context" in e.value.message


def test_an_unset_max_tokens_is_16_for_completions_capped_to_what_the_context_leaves(door, client) -> None:
    """A completion's max_tokens left out or null is OpenAI's 16, capped like the model's own
    default: a prompt leaving fewer than 16 tokens gets what is left, not a 400."""
    left = 10
    long_prompt = " ".join(["w5"] * (door.max_model_len - left))
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=long_prompt, temperature=0, stream=stream,
                                        extra_body={"ignore_eos": True},
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(got)
            reason, got = [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1]
        else:
            reason = got.choices[0].finish_reason
        assert reason == "length" and got.usage.completion_tokens == left
        assert got.usage.prompt_tokens == door.max_model_len - left
    for max_tokens in ({}, {"max_tokens": None}):  # left out, or null: the same
        status, _, doc = http(door, "POST", "/completions", {"model": MODEL, "prompt": long_prompt,
                                                             "ignore_eos": True, **max_tokens})
        assert status == 200, doc
        assert doc["choices"][0]["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == left
        status, _, doc = http(door, "POST", "/completions", {"model": MODEL, "prompt": PROMPT, "ignore_eos": True,
                                                             **max_tokens})
        assert status == 200 and doc["usage"]["completion_tokens"] == 16  # room enough: 16, not the model's 64
    # Asked for explicitly, 16 is more than the context leaves: refused, naming the field.
    status, _, doc = http(door, "POST", "/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 16})
    assert status == 400 and doc["error"]["param"] == "max_tokens"
    assert f"at most {left} can be generated" in doc["error"]["message"]
    assert "leave max_tokens unset (the default, 16, is capped" in doc["error"]["message"]

    # Chat has no default of its own: the model's (64 here), capped the same way.
    default = door.engine.sampling_defaults.max_tokens
    for max_tokens in ({}, {"max_tokens": None, "max_completion_tokens": None}):
        status, _, doc = http(door, "POST", "/chat/completions", {
            "model": MODEL, "messages": chat_messages(MESSAGES), "ignore_eos": True, **max_tokens})
        assert status == 200 and doc["usage"]["completion_tokens"] == default
        status, _, doc = http(door, "POST", "/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "ignore_eos": True, **max_tokens})
        assert status == 200 and doc["usage"]["completion_tokens"] == left
        assert doc["choices"][0]["finish_reason"] == "length"


def test_special_token_text_is_the_control_token_in_a_completion_prompt_only(special_door) -> None:
    """As vLLM: a completion's text prompt is tokenized with special tokens, so ``<|im_start|>``
    is one control id; chat content stays plain text (the runner never lets it forge a turn).
    The counts come from the checkpoint's own tokenizer.json through ``tokenizers``."""
    text = "w5 <|im_start|>w6 w7<|im_end|>"
    tok = Tokenizer.from_file(os.path.join(special_door.model_source, "tokenizer.json"))
    with_specials = tok.encode(text).ids
    tok.encode_special_tokens = True  # special-token text as plain characters
    plain = tok.encode(text).ids
    assert len(with_specials) == 5 and len(plain) == 9  # the test means something
    with openai.OpenAI(base_url=special_door.url, api_key="unused", max_retries=0) as c:
        got = c.completions.create(model="tiny-llama-special", prompt=text, max_tokens=1, temperature=0)
        assert got.usage.prompt_tokens == len(with_specials)
        streamed = list(c.completions.create(model="tiny-llama-special", prompt=text, max_tokens=1, stream=True,
                                             stream_options={"include_usage": True}))
        assert streamed[-1].usage.prompt_tokens == len(with_specials)
        chat = c.chat.completions.create(model="tiny-llama-special", messages=[{"role": "user", "content": text}],
                                         max_tokens=1, temperature=0)
        assert chat.usage.prompt_tokens == len(plain)


def test_an_unknown_model_is_a_404_model_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model" and "`gpt-4o`" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=chat_messages(MESSAGES), max_tokens=2, stream=True)


def test_invalid_bodies_are_400s_in_openai_error_shape(door) -> None:
    base = {"model": MODEL, "prompt": PROMPT}
    cases = [
        ({**base, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({**base, "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({**base, "top_p": 0}, "top_p", "greater than 0"),
        ({**base, "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"model": MODEL}, "prompt", "Field required"),
        ({**base, "stream_options": {"include_usage": True}}, "stream_options", "only be defined when `stream=True`"),
        ({**base, "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({**base, "logit_bias": {"7": -101}}, "logit_bias.7", "greater than or equal to -100"),
        ({**base, "logit_bias": {"100000": 1}}, "logit_bias", "logit_bias token id 100000 is outside the vocabulary"),
        ({**base, "max_tokens": 2, "min_tokens": 3}, "min_tokens", "min_tokens 3 is more than max_tokens 2"),
        ({**base, "echo": True}, "echo", "not supported"),
        ({**base, "prompt": ["w5", "w6"]}, "prompt", "one prompt per request"),
    ]
    for body, param, words in cases:
        status, _, doc = http(door, "POST", "/completions", body)
        assert status == 400, body
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
        assert doc["error"]["type"] == "BadRequestError" and doc["error"]["code"] == 400
        assert doc["error"]["param"] == param and words in doc["error"]["message"], (body, doc)
    status, _, doc = http(door, "POST", "/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert status == 400 and "only text parts" in doc["error"]["message"] and doc["error"]["param"] == "messages"
    status, _, doc = http(door, "POST", "/chat/completions", {"model": MODEL, "messages": [
        {"role": "function", "content": "w5"}]})
    assert status == 400 and "messages[0] has unknown role 'function'" in doc["error"]["message"]
    assert doc["error"]["param"] == "messages"
    for body, param, message in (
            ({**base, "prompt": ""}, "prompt", "prompt must not be empty"),
            ({**base, "prompt": []}, "prompt", "prompt must not be empty"),
            ({**base, "stop": ""}, "stop", "stop strings must not be empty"),
            ({**base, "prompt": [5, 200]}, "prompt", "token id 200 is outside the vocabulary")):
        status, _, doc = http(door, "POST", "/completions", body)
        assert (status, doc["error"]["param"]) == (400, param) and message in doc["error"]["message"], doc
    status, _, doc = http(door, "POST", "/chat/completions", {"model": MODEL, "messages": []})
    assert (status, doc["error"]["param"], doc["error"]["message"]) == (400, "messages", "messages must not be empty")

    # A body that is not a JSON object: one sentence, param null (not FastAPI's byte offset).
    status, _, doc = http(door, "POST", "/completions", b'{"prompt": "w5", }')
    assert (status, doc["error"]["param"], doc["error"]["type"]) == (400, None, "BadRequestError")
    assert doc["error"]["message"] == "the body is not valid JSON (at character 17: Expecting property name " \
                                      "enclosed in double quotes)"
    status, _, doc = http(door, "POST", "/completions", b"{not json")
    assert status == 400 and doc["error"]["message"].startswith("the body is not valid JSON (at character 1: ")
    payload = json.dumps(base).encode()
    for headers, got in (({}, "Content-Type: application/x-www-form-urlencoded"),  # urllib's default, curl -d's
                         ({"Content-Type": "text/plain"}, "Content-Type: text/plain")):
        status, _, doc = http(door, "POST", "/completions", payload, headers=headers)
        assert (status, doc["error"]["param"]) == (400, None), doc
        assert doc["error"]["message"] == ("the body must be a JSON object (Content-Type: application/json); "
                                           f"the request has {got}")
    conn = HTTPConnection(door.server.address, timeout=30)  # no Content-Type at all
    try:
        conn.request("POST", "/v1/completions", body=payload)
        resp = conn.getresponse()
        status, doc = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert (status, doc["error"]["message"]) == (400, "the body must be a JSON object (Content-Type: "
                                                      "application/json); the request has no Content-Type")
    status, _, doc = http(door, "POST", "/completions", b'["w5"]')
    assert (status, doc["error"]["message"]) == (400, "the body must be a JSON object, not a JSON array")
    status, _, doc = http(door, "POST", "/completions", b"")
    assert status == 400 and doc["error"]["message"].startswith("the request has no body")
    status, _, doc = http(door, "POST", "/completions", b"null")
    assert (status, doc["error"]["message"]) == (400, "the body must be a JSON object, not JSON null")
    status, _, doc = http(door, "POST", "/completions", payload, headers={"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, doc
    status, _, doc = http(door, "GET", "/nowhere")
    assert status == 404 and doc["error"]["type"] == "NotFoundError"
    # an unknown field is ignored, as vLLM ignores it
    status, _, doc = http(door, "POST", "/completions", {**base, "max_tokens": 2, "frobnicate": True})
    assert status == 200 and doc["usage"]["completion_tokens"] <= 2


class _AbortingRunner(generation_pb2_grpc.GenerationServicer):
    """A runner whose engine fails after one token: it ends the stream FINISH_REASON_ABORTED."""

    def Generate(self, request, context):
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[65], text="A", runner_id="bad")
        yield pb.GenerateResponse(request_id=request.request_id, finish_reason=pb.FINISH_REASON_ABORTED,
                                  runner_id="bad", usage=pb.Usage(prompt_tokens=3, completion_tokens=1))

    def ModelInfo(self, request, context):
        return pb.ModelInfoResponse(runner_id="bad", model="fake", family="fake", vocab_size=256, max_num_seqs=4)


def _sse(door, path: str, body: dict) -> tuple[int, list]:
    """(status, events) of a streamed request: each ``data:`` payload, JSON-decoded except [DONE]."""
    req = urllib.request.Request(door.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        lines = [ln.decode().removeprefix("data: ").strip() for ln in resp if ln.startswith(b"data: ")]
        return resp.status, [ln if ln == "[DONE]" else json.loads(ln) for ln in lines]


@pytest.mark.parametrize("failure", ["runner unavailable", "runner aborted"])
def test_a_runner_failure_mid_request_has_the_documented_status(failure) -> None:
    """UNAVAILABLE (the runner went away mid-stream) is 503, as before the first token: another
    try may land on a healthy runner; a runner that ends the request ABORTED (its engine failed)
    is 500, vLLM's status for a GenerationError. Streamed, the in-band error event carries the
    same code after the chunks already sent."""
    if failure == "runner unavailable":
        runner = FakeRunner("fake-0", FakeBehaviour(fail_after=2))
        status, kind = 503, "ServiceUnavailableError"
    else:
        runner = ServiceServer(ServerConfig(service="bad", port=0), [
            (generation_pb2_grpc.add_GenerationServicer_to_server, _AbortingRunner(), GENERATION_SERVICE)])
        runner.start()
        status, kind = 500, "InternalServerError"
    door = OpenAIServer(OpenAIConfig(router=runner.address, port=0))  # the door in front of a runner
    try:
        door.start()
        code, _, doc = http(door, "POST", "/completions", {"prompt": "w5 w6 w7"})
        assert (code, doc["error"]["type"], doc["error"]["code"]) == (status, kind, status), doc
        code, events = _sse(door, "/completions", {"prompt": "w5 w6 w7", "stream": True})
        assert code == 200 and events[-1] == "[DONE]"
        assert events[0]["choices"][0]["text"] and "error" not in events[0]
        error = events[-2]["error"]
        assert (error["type"], error["code"]) == (kind, status), events
    finally:
        door.stop()
        runner.stop()


def _wait_idle(door, baseline: pb.ModelInfoResponse, timeout_s: float = 15.0) -> pb.ModelInfoResponse:
    """Poll the runner's ModelInfo (through the router) until nothing runs or waits and its KV
    blocks in use are back to ``baseline``'s."""
    end = time.monotonic() + timeout_s
    with GenerationClient(door.router) as c:
        while True:
            info = c.model_info()
            if (info.running, info.waiting, info.kv_blocks_used) == (0, 0, baseline.kv_blocks_used):
                return info
            assert time.monotonic() < end, f"still busy: {info.running} running, {info.kv_blocks_used} blocks"
            time.sleep(0.02)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_client_that_disconnects_mid_stream_cancels_the_runner_request(door, client, endpoint) -> None:
    max_tokens = 1000  # about a second and a half of generation here: far more than the test reads
    with GenerationClient(door.router) as c:
        baseline = c.model_info()
    assert (baseline.running, baseline.waiting) == (0, 0)
    generated_before = door.engine.stats()["generated_tokens_total"]
    if endpoint == "completions":
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
    else:
        stream = client.chat.completions.create(model=MODEL, messages=chat_messages(MESSAGES), max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    read = list(itertools.islice(stream, 4))
    assert len(read) == 4 and all(c.choices[0].finish_reason is None for c in read)
    with GenerationClient(door.router) as c:
        busy = c.model_info()
    assert busy.running == 1 and busy.kv_blocks_used > baseline.kv_blocks_used  # the request holds blocks now
    stream.close()  # drop the connection mid-stream
    _wait_idle(door, baseline)
    generated = door.engine.stats()["generated_tokens_total"] - generated_before
    assert 3 <= generated < max_tokens  # cancelled, not run to its end


def test_a_client_that_gives_up_on_a_non_streamed_request_cancels_it(door, client) -> None:
    with GenerationClient(door.router) as c:
        baseline = c.model_info()
    generated_before = door.engine.stats()["generated_tokens_total"]
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.4).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000,
                                                            temperature=0, extra_body={"ignore_eos": True})
    _wait_idle(door, baseline)
    assert door.engine.stats()["generated_tokens_total"] - generated_before < 1000


def test_health_follows_the_routers_ready_runners(door) -> None:
    status, headers, doc = http(door, "GET", "/health")
    assert status == 200 and doc["status"] == "ok" and doc["runner_id"] == "runner-0"
    assert headers["warmserve-pid"] == str(os.getpid())
    address = door.server.address
    assert check_http_health(address) == "SERVING"
    assert check_http_health(address, pid=os.getpid()) == "SERVING"
    assert check_http_health(address, pid=os.getpid() + 1) == f"FOREIGN: pid {os.getpid()}"

    empty = RouterServer(RouterConfig(health_interval_s=0.2), ServerConfig(service="router", port=0))
    empty.start()
    lonely = OpenAIServer(OpenAIConfig(router=empty.address, port=0))
    try:
        lonely.start()
        assert check_http_health(lonely.address) == "NOT_SERVING"
        with openai.OpenAI(base_url=lonely.url, api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                c.models.list()
            assert e.value.status_code == 503 and "no runner is ready" in e.value.message
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert e.value.status_code == 503 and e.value.type == "ServiceUnavailableError"
    finally:
        lonely.stop()
        empty.stop()
    assert check_http_health(lonely.address, timeout_s=0.5).startswith("UNREACHABLE")
