"""``GenerationResult`` folds a stream's messages choice by choice."""

from __future__ import annotations

from services.generation_client import GenerationResult
from services.proto import generation_pb2 as pb


def test_interleaved_choices_stay_apart_with_their_own_usage() -> None:
    r = GenerationResult()
    stream = [pb.GenerateResponse(text="ca", token_ids=[1], index=0), pb.GenerateResponse(text="at", token_ids=[2], index=1),
              pb.GenerateResponse(text="t", token_ids=[3], index=2),
              pb.GenerateResponse(text="!", token_ids=[4], index=1, finish_reason=pb.FINISH_REASON_STOP,
                                  usage=pb.Usage(prompt_tokens=5, completion_tokens=2)),
              pb.GenerateResponse(text="", index=0, finish_reason=pb.FINISH_REASON_LENGTH,
                                  usage=pb.Usage(prompt_tokens=5, completion_tokens=1)),
              pb.GenerateResponse(text="", index=2, finish_reason=pb.FINISH_REASON_STOP,
                                  usage=pb.Usage(prompt_tokens=5, completion_tokens=1))]
    for m in stream:
        r.add(m)
    assert [(c.text, c.token_ids, c.finish_reason, c.completion_tokens) for c in r.choices] == [
        ("ca", [1], "LENGTH", 1), ("at!", [2, 4], "STOP", 2), ("t", [3], "STOP", 1)]
