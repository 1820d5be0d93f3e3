"""The output processor over a token-level scheduler (SmolLM2's real tokenizer, no model): a stop
string ends a request even on the token that also reaches max_tokens, a stop token or EOS is
never detokenized, and the final delta carries the held-back text and the usage."""

from __future__ import annotations

import pytest

from runner_service.block_manager import BlockManager
from runner_service.output_processor import OutputProcessor, RequestStream
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import Scheduler
from runner_service.sequence import FinishReason, Sequence
from runner_service.tokenizer import Tokenizer

TEXT = "Héllo wörld! says 🙂 ok"


@pytest.fixture(scope="module")
def tok(smollm2_sidecar):
    return Tokenizer.from_dir(smollm2_sidecar)


def _generate(tok, params, tokens, eos=()):
    """Feed ``tokens`` one step each as the sampled tokens, as the engine does; returns the deltas."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=eos)
    output = OutputProcessor(tok)
    seq = Sequence("r", [1, 2, 3], params, 1024)
    stream = RequestStream("r", 3, lambda _rid: None)
    output.add(seq, stream)
    sched.add(seq)
    for token in tokens:
        batch = sched.schedule()
        sched.postprocess(batch, [token])
        (out,) = output.process([seq], [None])
        if out.finish_reason is None:
            output.publish(seq, out)
        else:
            sched.finish(seq, out.finish_reason)
            output.finish(seq, out.finish_reason, out)
            break
    assert sched.block_manager.num_used_blocks == 0
    return list(stream)


def test_a_stop_string_on_the_last_allowed_token_is_stop_not_length(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas = _generate(tok, SamplingParams(max_tokens=len(ids), stop=(" ok",)), ids)
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert "".join(d.text for d in deltas) == TEXT.removesuffix(" ok")
    assert deltas[-1].completion_tokens == len(ids) and sum(len(d.token_ids) for d in deltas) == len(ids)
    plain = _generate(tok, SamplingParams(max_tokens=len(ids)), ids)
    assert plain[-1].finish_reason is FinishReason.LENGTH and "".join(d.text for d in plain) == TEXT


def test_a_stop_token_or_eos_is_returned_as_an_id_but_not_as_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    end = tok.encode(" zebra", add_special_tokens=False)  # a plain token: its text would show if decoded
    assert len(end) == 1 and end[0] not in ids
    for params, eos in ((SamplingParams(max_tokens=50, stop_token_ids=tuple(end)), ()),
                        (SamplingParams(max_tokens=50), end)):
        deltas = _generate(tok, params, [*ids, *end, *ids], eos)
        assert deltas[-1].finish_reason is FinishReason.STOP
        assert [t for d in deltas for t in d.token_ids] == [*ids, *end]
        assert "".join(d.text for d in deltas) == TEXT
