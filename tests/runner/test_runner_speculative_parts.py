"""The parts of speculative decoding, each against a reference written from its definition:
the n-gram index (prompt lookup), draft verification (greedy prefix acceptance; speculative
sampling's output distribution), the verify staging buffers and the scheduler's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_service.block_manager import BlockManager
from runner_service.decode_buffers import DecodeBuffers
from runner_service.ngram import NgramDrafter, NgramIndex
from runner_service.sampler import Sampler, filter_logits
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import Scheduler
from runner_service.sequence import FinishReason, Sequence
from services.errors import InvalidArgument


def reference_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup from its definition: for n from n_max down to n_min, the latest start
    ``s < len - n`` with ``tokens[s:s+n] == tokens[-n:]``; its next ``k`` tokens."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 4), st.integers(1, 3),
       st.integers(0, 2), st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_ngram_index_proposes_what_a_brute_force_lookup_finds_as_the_sequence_grows(tokens, k, n_min, extra, cuts):
    n_max = n_min + extra
    index = NgramIndex(n_min, n_max)
    seen = 0
    for cut in cuts:  # the index is updated incrementally, a few tokens at a time
        seen = min(len(tokens), seen + cut)
        assert index.propose(tokens[:seen], k) == reference_lookup(tokens[:seen], k, n_min, n_max)


def test_ngram_index_prefers_the_longest_suffix_then_the_latest_occurrence():
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 6, 7, 2, 9, 6, 7]
    # suffix (6, 7): occurrences end at 2 and 5 -> latest is 5 -> continuation 2, 9, 6
    assert index.propose(tokens, 3) == [2, 9, 6]
    # a 3-gram (x, 6, 7) with x = 9 occurs nowhere before: falls back to the 2-gram
    assert NgramIndex(3, 3).propose(tokens, 3) == []
    assert index.propose(tokens, 0) == []
    with pytest.raises(ValueError):
        NgramIndex(0, 2)


def test_the_drafter_leaves_room_for_the_bonus_token_and_honours_the_opt_out():
    drafter = NgramDrafter(4, 1, 2)
    seq = Sequence("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3, temperature=0), 100)
    # 5 tokens, at most 5 + 3 = 8: a step may emit 3 more, so at most 2 drafts
    drafter.propose([seq])
    assert seq.draft_token_ids == [3, 1]
    seq.token_ids += [3, 1]  # 7 tokens: one left, no room to verify a draft
    drafter.propose([seq])
    assert seq.draft_token_ids == []
    out = Sequence("b", [1, 2, 3, 1, 2], SamplingParams(max_tokens=9, disable_speculative_decoding=True), 100)
    drafter.propose([out])
    assert out.draft_token_ids == []


def _logits(rows: list[list[list[float]]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_verification_accepts_the_longest_prefix_equal_to_the_argmax():
    V = 6
    # three rows, 4 positions: argmax at each position below
    targets = [[2, 3, 4, 5], [1, 1, 1, 1], [0, 5, 5, 5]]
    logits = torch.full((3, 4, V), -1.0)
    for i, row in enumerate(targets):
        for j, t in enumerate(row):
            logits[i, j, t] = 1.0
    drafts = [[2, 3, 0], [4], []]
    greedy = [SamplingParams(temperature=0, logprobs=2)] * 3
    out, lps = Sampler().verify(logits, drafts, greedy, [None] * 3)
    assert out == [[2, 3, 4], [1], [0]]  # all but the last draft, a corrected first, no drafts
    assert [lp.token_id for lp in lps[0]] == [2, 3, 4]
    expected = torch.log_softmax(logits[0, 1], -1)[3].item()
    assert math.isclose(lps[0][1].logprob, expected, rel_tol=1e-6)


def test_speculative_sampling_keeps_the_target_distribution():
    """Every emitted token is distributed as the filtered target p at its position, whatever
    the draft: checked by the first and second emitted tokens' frequencies over 6000 draws."""
    torch.manual_seed(0)
    V = 5
    logits = torch.randn(1, 3, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    p = [filter_logits(logits[0, j:j + 1], torch.tensor([0.8]), torch.tensor([4]), torch.tensor([0.95]))
         .softmax(-1)[0] for j in range(3)]
    draft = int(p[0].argsort()[-2])  # a plausible but not the likeliest draft
    second = int(p[1].argmax())
    g = torch.Generator().manual_seed(1)
    n = 6000
    first = torch.zeros(V)
    after = torch.zeros(V)
    accepted_first = 0
    for _ in range(n):
        out, _ = Sampler().verify(logits, [[draft, second]], [params], [g])
        first[out[0][0]] += 1
        if out[0][0] == draft:
            accepted_first += 1
            after[out[0][1]] += 1
    # first emitted token ~ p0 (binomial standard error per entry below 0.0065)
    assert torch.allclose(first / n, p[0], atol=0.025), (first / n, p[0])
    # given the first draft was taken, the second emitted token ~ p1
    assert torch.allclose(after / accepted_first, p[1], atol=0.04), (after / accepted_first, p[1])
    assert first[(p[0] == 0)].sum() == 0  # nothing outside top-k / top-p


def test_fill_verify_writes_the_grid_and_validates_before_touching_anything():
    buf = DecodeBuffers(4, 4, 4, 32, max_draft_tokens=3)
    n = buf.fill_verify([7, 8], [5, 2], [[3, 4], [9]], [[11, 12], []])
    assert n == 2
    ids, pos, slots, tables, lens = buf.verify_views()
    assert ids.tolist() == [[7, 11, 12], [8, 0, 0]]
    assert pos.tolist() == [[5, 6, 7], [2, 0, 0]]
    # position p of a row with blocks [3, 4] (block size 4): block (p // 4) * 4 + p % 4
    assert slots.tolist() == [[4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3], [9 * 4 + 2, 0, 0]]
    assert lens.tolist() == [8, 3]
    assert tables.tolist() == [[3, 4], [9, 0]]
    # the grids are contiguous prefixes of persistent storage (a compiled program's inputs, no copy)
    base = ids.data_ptr()
    assert ids.is_contiguous() and pos.is_contiguous() and slots.is_contiguous()
    buf.fill_verify([7, 8, 9], [5, 2, 1], [[3, 4], [9], [5]], [[11], [], [13]])
    wider = buf.verify_views()[0]
    assert wider.shape == (3, 2) and wider.data_ptr() == base and wider.tolist() == [[7, 11], [8, 0], [9, 13]]
    buf.fill_verify([7, 8], [5, 2], [[3, 4], [9]], [[11, 12], []])
    before = {k: t.clone() for k, t in buf._host.items()}
    for bad in ([[11, 12, 13, 14], []],    # more drafts than K
                [[11, 12, 13], []],        # positions 5 .. 8 pass the 2 blocks (8 slots)
                [[-1], []]):               # a negative draft id
        with pytest.raises(InvalidArgument):
            buf.fill_verify([7, 8], [5, 2], [[3, 4], [9]], bad)
        assert all(torch.equal(before[k], t) for k, t in buf._host.items())
    with pytest.raises(InvalidArgument):
        DecodeBuffers(4, 4, 4, 32).fill_verify([1], [0], [[1]], [[]])


def test_a_verify_step_advances_by_what_was_accepted_and_frees_every_block_at_the_end():
    bm = BlockManager(40, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 4, 64, eos_token_ids=(1,))
    seq = Sequence("s", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=0), 100)
    sched.add(seq)
    batch = sched.schedule()
    assert batch.is_prefill
    sched.postprocess(batch, [7])  # 7 tokens, 6 computed
    seq.draft_token_ids = [8, 5, 6]
    batch = sched.schedule()
    assert not batch.is_prefill and batch.is_speculative and batch.num_tokens == [4]
    assert len(seq.block_table) == bm.blocks_needed(7 + 3)  # slots for the three drafts
    sched.postprocess(batch, [[8, 5, 9]])  # two drafts accepted, then a correction
    assert seq.token_ids[6:] == [7, 8, 5, 9] and seq.num_computed_tokens == 9 and seq.draft_token_ids == []
    # the full blocks of accepted tokens are cached under their tokens
    assert bm.num_cached_blocks == 2
    seq.draft_token_ids = [2, 3]
    batch = sched.schedule()
    sched.postprocess(batch, [[2, 1]])  # EOS (1) after the first draft: STOP, nothing after it
    assert seq.finish_reason is FinishReason.STOP and seq.token_ids[-2:] == [2, 1]
    assert bm.num_used_blocks == 0
    with pytest.raises(ValueError):
        sched.postprocess(batch, [[2, 3, 4, 5]])


def test_drafts_whose_blocks_do_not_fit_are_dropped_before_anyone_is_preempted():
    bm = BlockManager(3, 4, enable_prefix_caching=False)  # 2 usable blocks (block 0 is scratch)
    sched = Scheduler(bm, 4, 64)
    seq = Sequence("s", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 100)
    sched.add(seq)
    sched.postprocess(sched.schedule(), [8])  # 4 tokens: one block holds them
    seq.draft_token_ids = [1, 2, 3, 4, 5, 6]  # would need 10 tokens -> 3 blocks: only 2 exist
    batch = sched.schedule()
    assert batch.num_tokens == [1] and not batch.is_speculative and seq.draft_token_ids == []
    assert sched.num_preemptions == 0


def test_the_gate_explores_then_verifies_only_where_verify_steps_emit_tokens_faster():
    from runner_service.ngram import SpeculationGate

    gate = SpeculationGate(alpha=0.5, explore_every=4, max_explore_every=8)
    assert gate.allow(8)  # nothing measured: try a verify step
    gate.record("verify", 8, tokens=16, seconds=10.0)  # a first call: not counted
    assert gate.allow(8)
    gate.record("verify", 8, tokens=16, seconds=0.1)  # 160 tokens/s
    assert not gate.allow(8)  # no decode step measured yet: try one
    gate.record("decode", 8, tokens=8, seconds=10.0)
    gate.record("decode", 8, tokens=8, seconds=0.02)  # 400 tokens/s
    # explores after 4 declined steps, then after 8 (the cap), and 8 again
    assert [gate.allow(8) for _ in range(20)] == [False] * 3 + [True] + ([False] * 7 + [True]) * 2
    assert gate.allow(1)  # another bucket: measured apart
    gate.record("verify", 8, tokens=64, seconds=0.1)  # EMA: 160 + 0.5 * (640 - 160) = 400
    assert gate.allow(8)  # verify wins: the interval goes back to 4
    gate.record("verify", 8, tokens=8, seconds=0.1)  # EMA: 400 + 0.5 * (80 - 400) = 240
    assert [gate.allow(8) for _ in range(4)] == [False] * 3 + [True]
