"""``n`` choices through the OpenAI door, the router and a tiny runner (tests/openai/conftest.py's
``door``): non-streamed choices in index order, streamed chunks naming their choice, each
choice finishing once, usage counting the prompt once and every choice's completion; choice i
is the request with seed s + i; ``n`` out of range and ``best_of`` are 400s; the router relays
the index."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from services.generation_client import GenerationClient, text_request
from services.proto import generation_pb2 as pb
from services.sampling_keys import MAX_N

PROMPT = "w5 w6 w7"  # 3 tokens
MODEL = "tiny-llama"
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 4, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(door):
    c = openai.OpenAI(base_url=door.url, api_key="unused", max_retries=0)
    yield c
    c.close()


def _streamed(chunks) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Per choice: its text and its finish reasons, and the usage chunks."""
    texts, reasons, usages = defaultdict(str), defaultdict(list), []
    for c in chunks:
        if not c.choices:
            usages.append(c.usage)
            continue
        (choice,) = c.choices
        texts[choice.index] += choice.text if hasattr(choice, "text") else (choice.delta.content or "")
        if choice.finish_reason:
            reasons[choice.index].append(choice.finish_reason)
    return dict(texts), dict(reasons), usages


def test_completions_n_3_non_streamed_and_streamed(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.text.split()) == 4 for c in whole.choices)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (3, 12, 15)
    for i, choice in enumerate(whole.choices):  # choice i is the request with seed 7 + i
        single = client.completions.create(model=MODEL, prompt=PROMPT, **{**SAMPLED, "seed": 7 + i})
        assert single.choices[0].text == choice.text

    texts, reasons, usages = _streamed(client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, stream=True, stream_options={"include_usage": True}, **SAMPLED))
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [(3, 12)]


def test_chat_n_2_non_streamed_and_streamed(client) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in whole.choices)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 8)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **SAMPLED))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks if c.choices[0].delta.role]
    assert roles == [(0, "assistant"), (1, "assistant")]
    texts, reasons, usages = _streamed(chunks)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: ["length"], 1: ["length"]} and usages == []


def test_n_out_of_range_and_best_of_are_400s(client) -> None:
    for n in (0, MAX_N + 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=2)
        assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=3, max_tokens=2)
    assert e.value.param == "best_of"


def test_the_router_relays_each_choices_index(door) -> None:
    request = text_request(PROMPT, pb.SamplingParams(max_tokens=3, temperature=1.0, seed=3, ignore_eos=True, n=3))
    with GenerationClient(door.router) as c:
        msgs = list(c.stream(request, timeout_s=60))
    assert {m.index for m in msgs} == {0, 1, 2}
    assert sorted(m.index for m in msgs if m.finish_reason) == [0, 1, 2]
    assert all(sum(len(m.token_ids) for m in msgs if m.index == i) == 3 for i in range(3))
