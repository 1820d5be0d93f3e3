"""Consecutive ``GenerateResponse`` messages of one stream as one (token coalescing).

A hop of the token path (runner, router, door) that falls behind its upstream sends what has
accumulated as one message instead of one per token: :func:`merge_responses` is the merge,
every door's output is the same either way (same text, token ids, logprobs, finish reason and
usage; only the number of messages or chunks shrinks). Nothing here waits: a hop merges only
what it already holds, so no token is held back for a later one. A request with several choices
(``SamplingParams.n``) streams them interleaved, each message naming its choice (``index``):
messages are merged choice by choice (:func:`merge_by_choice`), never across choices.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.proto import generation_pb2


def merge_responses(msgs: Sequence[generation_pb2.GenerateResponse]) -> generation_pb2.GenerateResponse:
    """``msgs`` (consecutive messages of one choice of one stream, at least one) as one message:
    token ids, text and logprobs concatenated in order; ``request_id`` and ``runner_id`` of the
    first that has one; the finish reason and usage of the last that has them (the final
    message's). One message is returned as it is (not copied). Raises ``ValueError`` for an
    empty ``msgs`` or messages of different choices (``index``)."""
    if not msgs:
        raise ValueError("merge_responses needs at least one message")
    if len(msgs) == 1:
        return msgs[0]
    index = msgs[0].index
    if any(m.index != index for m in msgs):
        raise ValueError("merge_responses: messages of different choices are never merged")
    out = generation_pb2.GenerateResponse(text="".join(m.text for m in msgs), index=index)
    for m in msgs:
        out.token_ids.extend(m.token_ids)
        out.logprobs.extend(m.logprobs)
        if m.request_id and not out.request_id:
            out.request_id = m.request_id
        if m.runner_id and not out.runner_id:
            out.runner_id = m.runner_id
        if m.finish_reason:
            out.finish_reason = m.finish_reason
        if m.HasField("usage"):
            out.usage.CopyFrom(m.usage)
    return out


def merge_by_choice(msgs: Sequence[generation_pb2.GenerateResponse]) -> list[generation_pb2.GenerateResponse]:
    """``msgs`` (consecutive messages of one stream) merged choice by choice
    (:func:`merge_responses`): one message per choice present, in the order the choices first
    appear (each choice's own messages stay in order)."""
    by_index: dict[int, list[generation_pb2.GenerateResponse]] = {}
    for m in msgs:
        by_index.setdefault(m.index, []).append(m)
    return [merge_responses(group) for group in by_index.values()]
