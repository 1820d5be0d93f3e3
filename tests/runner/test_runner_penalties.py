"""Penalties, ``logit_bias`` and ``min_tokens`` checked against their definitions (vLLM's,
written out here token by token): the processing on random logits over several incremental
steps, the slots' life cycle, the validation sentences, and the engine on a tiny random Llama
(no repeated token under a presence penalty, a forced token, ``min_tokens`` against a forced
EOS, raw logprobs, slots given back after finish and abort, no drafts for penalized requests)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from runner_tiny import kv_bytes, random_prompt, tiny_args, tiny_config
from runner_tiny import run_requests as _run

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.penalties import PenaltyState
from runner_service.sampling_params import SamplingDefaults, SamplingParams
from runner_service.sequence import FinishReason, Sequence, SequenceStatus
from services.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 1
ARGS = tiny_args(vocab=64, eos=(EOS,))
WEIGHTS = LLAMA.random_weights(ARGS, seed=5)
NEG_INF = float("-inf")


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams,
              eos: tuple[int, ...]) -> list[float]:
    """vLLM's processing of one row, from its definition (min_tokens, logit_bias, repetition,
    frequency, presence), one token at a time."""
    out = list(logits)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[t] = NEG_INF
    for t, b in dict(p.logit_bias).items():
        out[t] += b
    r = 1.0 if p.repetition_penalty is None else p.repetition_penalty
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        n = output.count(t)
        out[t] -= p.frequency_penalty * n
        if n > 0:
            out[t] -= p.presence_penalty
    return out


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams(max_tokens=50)  # nothing to process
    return SamplingParams(
        max_tokens=50,
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([None, 1.0, rng.uniform(0.1, 2)]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(4))},
        min_tokens=rng.choice([0, 0, rng.randrange(1, 8)]),
        stop_token_ids=tuple(rng.sample(range(vocab), rng.randrange(3))),
        ignore_eos=rng.random() < 0.3)


@pytest.mark.parametrize("positions", [0, 3])
def test_processing_matches_the_definition_over_incremental_steps(positions):
    """Random rows and params, six steps of appended tokens (one or several a step, as a verify
    step appends), the state kept across steps; ``positions`` > 0: a verify step's logits, where
    every position of a row is processed as its first."""
    rng = random.Random(positions)
    V, n = 40, 7
    state = PenaltyState(max_num_seqs=n, vocab_size=V, eos_token_ids=(3, 5))
    seqs = [Sequence(str(i), [rng.randrange(V) for _ in range(rng.randrange(1, 12))], _random_params(rng, V), 200)
            for i in range(n)]
    gen = torch.Generator().manual_seed(positions)
    for _ in range(6):
        shape = (n, positions, V) if positions else (n, V)
        logits = torch.randn(shape, generator=gen) * 4
        raw = logits.clone()
        got = state.process_verify(logits, seqs) if positions else state.process(logits, seqs)
        assert torch.equal(logits, raw)  # the raw logits stay as they were
        for i, seq in enumerate(seqs):
            rows = [logits[i, j] for j in range(positions)] if positions else [logits[i]]
            outs = [got[i, j] for j in range(positions)] if positions else [got[i]]
            for row, out in zip(rows, outs, strict=True):
                want = reference(row.tolist(), seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids,
                                 seq.params, (3, 5))
                torch.testing.assert_close(out, torch.tensor(want), rtol=1e-6, atol=1e-5)
        for seq in seqs:
            seq.token_ids += [rng.randrange(V) for _ in range(rng.randrange(1, 4))]
    penalized = sum(s.params.penalized for s in seqs)
    assert state.num_free_slots == n - penalized
    for seq in seqs:
        state.release(seq)
    assert state.num_free_slots == n


def test_a_batch_without_processing_is_not_touched_and_takes_no_slot():
    state = PenaltyState(max_num_seqs=2, vocab_size=8)
    logits = torch.randn(2, 8)
    seqs = [Sequence("a", [1, 2], SamplingParams(max_tokens=4), 100),
            Sequence("b", [3], SamplingParams(max_tokens=4, temperature=0.5), 100)]
    assert state.process(logits, seqs) is logits
    assert state.counts is None and state.num_free_slots == 2
    bias_only = Sequence("c", [3], SamplingParams(max_tokens=4, logit_bias={2: 1.5}, min_tokens=2), 100)
    out = state.process(logits, [seqs[0], bias_only])
    assert out[1, 2] == logits[1, 2] + 1.5 and torch.equal(out[0], logits[0])
    assert state.counts is None and state.num_free_slots == 2  # bias and min_tokens need no state


def test_a_preempted_holder_gives_its_slot_to_a_resident_sequence_and_is_refilled_on_return():
    V = 10
    state = PenaltyState(max_num_seqs=1, vocab_size=V)
    params = SamplingParams(max_tokens=20, frequency_penalty=1.0, repetition_penalty=2.0)
    a, b = Sequence("a", [2, 3], params, 100), Sequence("b", [4], params, 100)
    a.token_ids += [5, 5, 6]
    a.status = SequenceStatus.RUNNING
    a.block_table = [0]
    state.process(torch.zeros(1, V), [a])
    with pytest.raises(RuntimeError, match="no penalty slot free"):  # a is resident: its slot is not taken
        state.process(torch.zeros(1, V), [b])
    a.status, a.block_table = SequenceStatus.WAITING, []  # preempted: no blocks
    state.process(torch.zeros(1, V), [b])
    assert state.slot(a) is None and state.slot(b) == 0
    assert state.counts[0].tolist() == [0] * V and state.prompt_mask[0].nonzero().flatten().tolist() == [4]
    state.release(b)
    logits = torch.ones(1, V)
    out = state.process(logits, [a])  # back: its row rebuilt from its tokens
    assert state.counts[0].tolist() == [0, 0, 0, 0, 0, 2, 1, 0, 0, 0]
    torch.testing.assert_close(out[0], torch.tensor(reference([1.0] * V, [2, 3], [5, 5, 6], params, ())))


@pytest.mark.parametrize(("kw", "sentence"), [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\] \(0 turns it off\), got 2.5"),
    ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": math.nan}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 2\] \(1 or unset turns it off\), got 0.0"),
    ({"repetition_penalty": 2.5}, r"repetition_penalty must be in \(0, 2\]"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias has 301 entries; at most 300 are allowed"),
    ({"logit_bias": {7: 100.5}}, r"logit_bias of token 7 must be a finite number in \[-100, 100\], got 100.5"),
    ({"logit_bias": {7: math.inf}}, "logit_bias of token 7 must be a finite number"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens 9 is more than max_tokens 8"),
])
def test_bad_values_are_refused_with_a_sentence(kw, sentence):
    with pytest.raises(InvalidArgument, match=sentence):
        SamplingParams(**kw)


def test_limits_are_accepted_and_min_tokens_is_checked_against_the_resolved_max_tokens():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=2, min_tokens=3,
                       logit_bias={i: (-100.0 if i % 2 else 100.0) for i in range(300)})
    assert len(p.logit_bias) == 300 and p.penalized and not p.may_speculate
    assert SamplingParams(logit_bias={3: 1.0}).may_speculate  # bias alone is speculated
    assert not SamplingParams(repetition_penalty=1.0).penalized
    with pytest.raises(InvalidArgument, match=r"min_tokens 7 is more than max_tokens 6 \(unset: the default 16, "
                                              r"capped to the 6 tokens the context leaves\)"):
        SamplingDefaults(max_tokens=16).resolve(SamplingParams(max_tokens=None, min_tokens=7), 250, 256)


# -- the engine ----------------------------------------------------------------------------------


def _engine(**cfg):
    return LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, 200), **cfg))


def _prompt(n, seed):
    return random_prompt(n, seed, ARGS.vocab_size)


def test_engine_steps_process_the_raw_logits_as_defined_and_greedy_never_repeats_under_presence():
    """The engine's raw logits each step, processed by the definition here, give the tokens it
    chose; with the largest presence and frequency penalties greedy never repeats a token."""
    eng = _engine()
    seen = []
    sampler = eng.sampler

    def spy(logits, params, generators, raw=None):
        seen.append(((logits if raw is None else raw).clone(), logits.clone()))
        return sampler(logits, params, generators, raw=raw)

    eng.sampler = spy
    prompt = _prompt(6, 1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0,
                            repetition_penalty=1.3)
    plain, out = _run(eng, [(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)), (prompt, params)])
    assert len(set(plain.token_ids)) < 40  # the model alone repeats
    assert len(set(out.token_ids)) == 40  # never under the penalties
    assert len(seen) == 40
    for step, (raw, processed) in enumerate(seen):
        want = reference(raw[1].tolist(), prompt, out.token_ids[:step], params, (EOS,))
        torch.testing.assert_close(processed[1], torch.tensor(want), rtol=1e-6, atol=1e-5)
        assert int(torch.tensor(want).argmax()) == out.token_ids[step]
        assert torch.equal(processed[0], raw[0])  # the plain row is untouched
    assert eng.penalties.num_free_slots == eng.config.max_num_seqs


def test_logit_bias_forces_a_token_and_logprobs_stay_raw():
    eng = _engine()
    prompt = _prompt(5, 2)
    plain = _run(eng, [(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=20))])[0]
    forced_token, raw_logprob = plain.logprobs[0].top[6]  # the 7th most likely first token
    for temperature in (0, 1.0):
        out = _run(eng, [(prompt, SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True,
                                                 logit_bias={forced_token: 100.0}, logprobs=1))])[0]
        assert out.token_ids == [forced_token] * 8
        assert out.logprobs[0].logprob == pytest.approx(raw_logprob, abs=1e-5)  # raw, not ~0
    bias_down = SamplingParams(max_tokens=1, temperature=0, logit_bias={plain.token_ids[0]: -100.0})
    assert _run(eng, [(prompt, bias_down)])[0].token_ids == [plain.logprobs[0].top[1][0]]


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached():
    eng = _engine()
    prompt = _prompt(5, 3)
    force_eos = {EOS: 100.0}
    out = _run(eng, [(prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias=force_eos))])[0]
    assert out.token_ids == [EOS] and out.finish_reason is FinishReason.STOP
    out = _run(eng, [(prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias=force_eos, min_tokens=4))])[0]
    assert out.finish_reason is FinishReason.STOP and len(out.token_ids) == 5
    assert EOS not in out.token_ids[:4] and out.token_ids[4] == EOS
    # a stop token id likewise; with ignore_eos only the stop ids are masked, EOS is just a token
    stop = 7
    out = _run(eng, [(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=1, stop_token_ids=(stop,),
                                             logit_bias={stop: 100.0}, min_tokens=3))])[0]
    assert out.finish_reason is FinishReason.STOP and out.token_ids[3] == stop and stop not in out.token_ids[:3]
    out = _run(eng, [(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=force_eos,
                                             min_tokens=3))])[0]
    assert out.token_ids == [EOS] * 6 and out.finish_reason is FinishReason.LENGTH


def test_bad_logit_bias_ids_and_min_tokens_are_refused_before_anything_is_queued():
    eng = _engine()
    with pytest.raises(InvalidArgument, match=r"logit_bias token id 64 is outside the vocabulary \[0, 64\)"):
        eng.add_request(SamplingParams(max_tokens=4, logit_bias={3: 1.0, 64: 1.0}), token_ids=[5, 6])
    with pytest.raises(InvalidArgument, match="logit_bias token id -1 is outside"):
        eng.add_request(SamplingParams(max_tokens=4, logit_bias={-1: 1.0}), token_ids=[5, 6])
    with pytest.raises(InvalidArgument, match=r"min_tokens 300 is more than max_tokens 64 \(unset: the default, 64\)"):
        eng.add_request(SamplingParams(min_tokens=300, max_tokens=None), token_ids=[5, 6])
    assert eng.stats()["waiting"] == 0


def test_slots_are_given_back_after_finish_and_abort():
    eng = _engine(max_num_seqs=4)
    pen = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, presence_penalty=0.5)
    streams = [eng.add_request(pen, token_ids=_prompt(4, i)) for i in range(3)]
    eng.step()  # prefill: every row samples once and takes a slot
    assert eng.penalties.num_free_slots == 1
    eng.abort(streams[1].request_id)
    eng.step()
    assert eng.penalties.num_free_slots == 2
    assert streams[1].result(timeout=0).finish_reason is FinishReason.CANCELLED
    eng.run_until_done()
    assert eng.penalties.num_free_slots == 4
    assert [s.result(timeout=0).completion_tokens for s in (streams[0], streams[2])] == [30, 30]


def test_a_penalized_request_is_never_drafted_and_bias_alone_is_verified_exactly():
    spec = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    span = _prompt(5, 4)
    prompt = span * 3  # copy-heavy: prompt lookup drafts
    pen = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.5, min_tokens=2)
    bias = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logit_bias={span[0]: 3.0, span[2]: -2.0})
    plain = _run(_engine(), [(prompt, pen), (prompt, bias)])
    eng = _engine(**spec)
    assert _run(eng, [(prompt, pen)])[0].token_ids == plain[0].token_ids
    assert eng.stats()["spec_decode_num_drafts"] == 0
    assert _run(eng, [(prompt, bias)])[0].token_ids == plain[1].token_ids
    assert eng.stats()["spec_decode_num_drafts"] > 0
