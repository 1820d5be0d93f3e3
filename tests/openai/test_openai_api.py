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

import openai
import pytest

from openai_service.config import OpenAIConfig
from openai_service.daemon import OpenAIServer
from openai_service.healthcheck import check_http_health
from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from services.bootstrap import ServerConfig
from services.generation_client import GenerationClient, chat_request, text_request
from services.proto import generation_pb2 as pb

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


def http(door, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a raw HTTP request to the door (``path`` under /v1
    unless it starts with /health)."""
    base = door.url.removesuffix("/v1")
    url = base + (path if path.startswith("/health") else "/v1" + path)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
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


def test_n_other_than_1_is_a_400(client) -> None:
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": chat_messages(MESSAGES)})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, n=2, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.param == "n" and e.value.type == "BadRequestError"
        assert "n must be 1" in e.value.message and "got n=2" in e.value.message


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
    assert "max_tokens" in e.value.message


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
        ({**base, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
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
        {"role": "tool", "content": "w5"}]})
    assert status == 400 and "unknown role 'tool'" in doc["error"]["message"]  # the runner's sentence
    status, _, doc = http(door, "POST", "/completions", b"{not json")
    assert status == 400 and doc["error"]["type"] == "BadRequestError"
    status, _, doc = http(door, "GET", "/nowhere")
    assert status == 404 and doc["error"]["type"] == "NotFoundError"
    # an unknown field is ignored, as vLLM ignores it
    status, _, doc = http(door, "POST", "/completions", {**base, "max_tokens": 2, "frobnicate": True})
    assert status == 200 and doc["usage"]["completion_tokens"] <= 2


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
