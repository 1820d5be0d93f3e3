"""The OpenAI door's stream encoding, without a server: a chunk with text only is rendered from a
template (the same bytes as pydantic's rendering of the whole chunk), and the messages that
arrive while the door is busy are sent as one chunk per choice, the first never waiting for a
second, and never merged across the choices of a request with several."""

from __future__ import annotations

import asyncio
import json

import pytest

from openai_service.app import _Call, _events, _text_event
from openai_service.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    DeltaMessage,
)
from services.deltas import merge_by_choice, merge_responses
from services.proto import generation_pb2 as pb

TEXTS = ["", "plain", 'a "quote" and a \\ backslash', "\n\t\r\b\f", "\x00\x01\x1f\x7f", "é ü 中文 🎉",
         "\u2028\u2029", "</script>", "@@warmserve-chunk-text@@", "  leading and trailing  "]


def _completion_chunk(choices, **kw) -> Completion:
    return Completion(id="cmpl-1", created=7, model="m", choices=choices, **kw)


def _completion_choice(msg: pb.GenerateResponse, reason: str | None) -> CompletionChoice:
    return CompletionChoice(text=msg.text, logprobs=None, finish_reason=reason)


def _chat_chunk(choices, **kw) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=choices, **kw)


def _chat_choice(msg: pb.GenerateResponse, reason: str | None) -> ChatChunkChoice:
    return ChatChunkChoice(delta=DeltaMessage(content=msg.text), finish_reason=reason)


@pytest.mark.parametrize("chunk, choice", [(_completion_chunk, _completion_choice), (_chat_chunk, _chat_choice)])
@pytest.mark.parametrize("skip", [None, {"usage"}])
def test_a_text_chunk_from_the_template_is_pydantics_bytes(chunk, choice, skip) -> None:
    def render(text: str) -> str:
        return chunk([choice(pb.GenerateResponse(text=text), None)]).model_dump_json(exclude=skip)

    fast = _text_event(render)
    assert fast is not None
    for text in TEXTS:
        assert fast(text) == f"data: {render(text)}\n\n"
        assert json.loads(fast(text)[6:])["choices"][0]["text" if chunk is _completion_chunk else "delta"] in (
            text, {"content": text})


def test_no_template_when_the_mark_is_not_there_once() -> None:
    assert _text_event(lambda text: json.dumps({"a": text, "b": text})) is None
    assert _text_event(lambda text: json.dumps({"a": "other"})) is None


class _FedCall(_Call):
    """A ``Generate`` call whose messages the test hands over (``None``: the end)."""

    def __init__(self) -> None:
        self.fed: asyncio.Queue[pb.GenerateResponse | None] = asyncio.Queue()
        self.taken = 0

    async def next(self) -> pb.GenerateResponse | None:
        msg = await self.fed.get()
        self.taken += msg is not None
        return msg


def _messages() -> list[pb.GenerateResponse]:
    """Five messages of a stream: four tokens (one without text yet), then the final one."""
    return [pb.GenerateResponse(request_id="r", runner_id="runner-0", token_ids=[10], text="a"),
            pb.GenerateResponse(request_id="r", runner_id="runner-0", token_ids=[11], text=""),
            pb.GenerateResponse(request_id="r", runner_id="runner-0", token_ids=[12], text="bc"),
            pb.GenerateResponse(request_id="r", runner_id="runner-0", token_ids=[13], text="d"),
            pb.GenerateResponse(request_id="r", runner_id="runner-0", finish_reason=pb.FINISH_REASON_LENGTH,
                                usage=pb.Usage(prompt_tokens=3, completion_tokens=4))]


async def _stream(chunk, choice, *, behind: bool, opening=None) -> list[str]:
    """The events of :func:`_messages` through :func:`_events`; ``behind``: after the first
    event the consumer lets everything else arrive before it asks for the next."""
    msgs = _messages()
    call = _FedCall()
    events = _events(call, msgs[0], chunk=chunk, choice=choice, include_usage=True, opening=opening)
    out = [await anext(events)]
    if opening is not None:
        out.append(await anext(events))
    assert call.taken == 0  # the first token's chunk went out before a second message existed
    for msg in msgs[1:]:
        call.fed.put_nowait(msg)
        if not behind and (msg.text or msg.finish_reason):
            out.append(await anext(events))  # read before the next message arrives
    call.fed.put_nowait(None)
    out += [e async for e in events]
    return out


def _parsed(events: list[str]) -> list[dict]:
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_door_that_falls_behind_sends_the_same_content_in_fewer_chunks(kind) -> None:
    chunk, choice, opening = ((_completion_chunk, _completion_choice, None) if kind == "completion" else
                              (_chat_chunk, _chat_choice, lambda i: ChatChunkChoice(
                                  index=i, delta=DeltaMessage(role="assistant", content=""))))
    fast = _parsed(asyncio.run(_stream(chunk, choice, behind=False, opening=opening)))
    slow = _parsed(asyncio.run(_stream(chunk, choice, behind=True, opening=opening)))

    def text(c: dict) -> str:
        choice = c["choices"][0]
        return choice["text"] if kind == "completion" else choice["delta"].get("content", "")

    for chunks in (fast, slow):
        streamed = [c for c in chunks if c["choices"]]
        assert "".join(text(c) for c in streamed) == "abcd"
        assert [c["choices"][0]["finish_reason"] for c in streamed][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in streamed[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        assert {c["id"] for c in chunks} == {"cmpl-1" if kind == "completion" else "chatcmpl-1"}
    skip = 0 if kind == "completion" else 1  # the chat stream opens with the role's chunk
    # Fast: one chunk per message with text, then the final one; behind: the first alone, then
    # everything that arrived meanwhile, final message included, as one chunk.
    assert [text(c) for c in fast[skip:-1]] == ["a", "bc", "d", ""]
    assert [text(c) for c in slow[skip:-1]] == ["a", "bcd"]
    assert slow[skip] == fast[skip]


def test_merged_messages_keep_every_field() -> None:
    msgs = _messages()
    merged = merge_responses(msgs)
    assert list(merged.token_ids) == [10, 11, 12, 13] and merged.text == "abcd"
    assert merged.finish_reason == pb.FINISH_REASON_LENGTH
    assert (merged.usage.prompt_tokens, merged.usage.completion_tokens) == (3, 4)
    assert (merged.request_id, merged.runner_id) == ("r", "runner-0")
    assert not merge_responses(msgs[:2]).HasField("usage")
    assert merge_responses(msgs[:1]) is msgs[0]
    lps = [pb.GenerateResponse(token_ids=[i], logprobs=[pb.TokenLogprob(token_id=i, logprob=-i)]) for i in (1, 2)]
    assert [(lp.token_id, lp.logprob) for lp in merge_responses(lps).logprobs] == [(1, -1.0), (2, -2.0)]
    with pytest.raises(ValueError):
        merge_responses([])


def test_messages_of_different_choices_are_never_merged() -> None:
    def msg(index, text, final=False):
        return pb.GenerateResponse(request_id="r", index=index, token_ids=[len(text)], text=text,
                                   finish_reason=pb.FINISH_REASON_LENGTH if final else 0,
                                   usage=pb.Usage(prompt_tokens=3, completion_tokens=2) if final else None)

    with pytest.raises(ValueError, match="different choices"):
        merge_responses([msg(0, "a"), msg(1, "b")])
    merged = merge_by_choice([msg(1, "x"), msg(0, "a"), msg(1, "y", True), msg(0, "b")])
    assert [(m.index, m.text, m.finish_reason) for m in merged] == [(1, "xy", pb.FINISH_REASON_LENGTH), (0, "ab", 0)]

    # A door that fell behind a two-choice stream: one chunk per choice, each with its index.
    msgs = [msg(0, "a"), msg(1, "x"), msg(0, "b"), msg(1, "y"), msg(1, "", True), msg(0, "c"), msg(0, "", True)]

    async def run() -> list[str]:
        call = _FedCall()
        events = _events(call, msgs[0], chunk=_completion_chunk, include_usage=True, n=2,
                         choice=lambda m, r: CompletionChoice(index=m.index, text=m.text, finish_reason=r))
        out = [await anext(events)]
        for m in msgs[1:]:
            call.fed.put_nowait(m)
        call.fed.put_nowait(None)
        return out + [e async for e in events]

    chunks = _parsed(asyncio.run(run()))
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
            for c in chunks[:-1]] == [(0, "a", None), (1, "xy", "length"), (0, "bc", "length")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
