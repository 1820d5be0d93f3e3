"""Scheduler: chunked prefill within the token budget, max_num_seqs, preemption by
free-then-recompute, prefix-cache hits for new and preempted sequences, and no deadlock or leak
under a tiny KV cache (simulated model: every sampling sequence appends one token; a simulated
KV cache, :mod:`kv_sim`, checks every position a step reads holds its own history)."""

from __future__ import annotations

import random

import pytest
from kv_sim import SimKV, check_accounting

from runner_service import block_manager
from runner_service.block_manager import BlockManager
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import Scheduler
from runner_service.sequence import FinishReason, Sequence, SequenceStatus
from services.errors import ResourceExhausted


def _seq(rid, prompt_len, max_tokens, max_model_len=1024):
    return Sequence(rid, [7] * prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0), max_model_len)


def _step(sched, finished, sim=None, next_token=lambda seq: 3):
    """One simulated engine step (the model computes each chunk in ``sim`` when given); returns
    the batch."""
    batch = sched.schedule()
    assert batch, "no progress"
    if sim is not None:
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_tokens, strict=True):
            sim.step(seq, start, n)
    for seq in sched.on_step_done(batch):
        seq.token_ids.append(next_token(seq))
        if seq.num_tokens >= seq.max_total_tokens:
            sched.finish(seq, FinishReason.LENGTH)
            finished.append(seq)
    return batch


def _check_invariants(bm, sched):
    check_accounting(bm, [*sched.running, *sched.waiting])
    assert len(sched.running) + sum(1 for s in sched.waiting if s.block_table) <= sched.max_num_seqs
    for s in sched.running:
        assert s.num_computed_tokens == s.num_tokens - 1 or s.num_computed_tokens == s.num_tokens


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    s = _seq("a", 10, 2)
    sched.add(s)
    sizes = []
    for _ in range(3):
        batch = sched.schedule()
        assert batch.is_prefill and batch.seqs == [s]
        sizes.append(batch.num_tokens[0])
        sampled = sched.on_step_done(batch)
        assert sampled == ([s] if s.num_computed_tokens == 10 else [])
    assert sizes == [4, 4, 2]
    assert s.status is SequenceStatus.RUNNING and len(s.block_table) == 3


def test_prefill_batches_several_prompts_and_respects_max_num_seqs():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(f"s{i}", 5, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == seqs[:2] and batch.num_tokens == [5, 5]
    sched.on_step_done(batch)
    for s in seqs[:2]:
        s.token_ids.append(1)
    batch = sched.schedule()  # the third must wait for a free slot: a decode step runs instead
    assert not batch.is_prefill and batch.seqs == seqs[:2] and batch.starts == [5, 5]


def test_decode_preempts_the_youngest_and_recomputes_it():
    bm = BlockManager(5, 4)  # 4 usable blocks = 16 tokens
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old, young = _seq("old", 7, 8), _seq("young", 7, 8)
    sched.add(old)
    sched.add(young)
    finished = []
    _step(sched, finished)  # prefill both: 2 blocks each, all 4 used
    assert bm.num_free_blocks == 0
    batch = _step(sched, finished)  # decode positions 7: still inside block 2 of each
    assert not batch.is_prefill
    batch = _step(sched, finished)  # position 8 needs a third block: young is preempted
    assert batch.seqs == [old]
    assert young.status is SequenceStatus.WAITING and young.block_table == []
    assert young.num_computed_tokens == 0 and young.num_preemptions == 1
    assert sched.waiting[0] is young
    while sched.has_work():
        _step(sched, finished)
        _check_invariants(bm, sched)
    assert [s.request_id for s in finished] == ["old", "young"]
    assert young.num_completion_tokens == 8 and old.num_completion_tokens == 8
    assert bm.num_free_blocks == 4


@pytest.mark.parametrize("caching", ["off", "sha256", "constant-hash"])
@pytest.mark.parametrize("seed", range(4))
def test_tiny_cache_many_requests_all_complete_without_leaks(seed, caching, monkeypatch):
    if caching == "constant-hash":  # every key collides: blocks must still never be mixed up
        monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids: b"k")
    rng = random.Random(seed)
    bm = BlockManager(13, 4, enable_prefix_caching=caching != "off")  # 12 usable blocks = 48 tokens
    sim = SimKV(bm)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=rng.choice([5, 16, 64]))
    # Prompts share prefixes (a few bases, cut anywhere) so that blocks are shared and evicted.
    bases = [[rng.randint(2, 4) for _ in range(30)] for _ in range(3)]
    seqs = []
    for i in range(40):
        prompt = rng.choice(bases)[:rng.randint(0, 28)] + [rng.randint(2, 9) for _ in range(rng.randint(1, 4))]
        seqs.append(Sequence(f"r{i}", prompt[:30], SamplingParams(max_tokens=rng.randint(1, 17), temperature=0),
                             1024))
    finished = []
    steps = 0

    def next_token(seq):  # a deterministic "model": the next token depends on the history
        return 2 + sum(seq.token_ids) % 3

    for s in seqs:
        sched.check_fits(s)
        sched.add(s)
        if rng.random() < 0.3:
            _step(sched, finished, sim, next_token)
            steps += 1
    while sched.has_work():
        _step(sched, finished, sim, next_token)
        _check_invariants(bm, sched)
        steps += 1
        assert steps < 20000
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.num_tokens == s.max_total_tokens for s in seqs)
    assert bm.num_free_blocks == 12 and bm.num_used_blocks == 0
    assert sched.num_preemptions > 0
    if caching == "sha256":
        assert bm.prefix_hit_tokens > 0 and bm.prefix_queried_tokens >= bm.prefix_hit_tokens
    if caching == "off":
        assert bm.prefix_queried_tokens == 0 and bm.num_cached_blocks == 0
    if caching == "constant-hash":
        assert bm.num_cached_blocks <= 1


def test_a_cached_prefix_is_skipped_and_its_chunk_starts_after_the_hit():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = Sequence("first", list(range(10, 30)), SamplingParams(max_tokens=2), 1024)
    sched.add(first)
    _step(sched, [])
    second = Sequence("second", list(range(10, 26)) + [1, 2, 3], SamplingParams(max_tokens=2), 1024)
    sched.add(second)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [second] and batch.starts == [16] and batch.num_tokens == [3]
    assert second.block_table[:4] == first.block_table[:4]
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (20 + 19, 16)


def test_a_preempted_sequence_recomputes_only_what_the_cache_lost():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    s = Sequence("s", list(range(10, 19)), SamplingParams(max_tokens=10), 1024)
    sched.add(s)
    for _ in range(5):  # prefill 9 tokens, then 4 decode steps: 13 tokens, 12 of them computed
        _step(sched, [])
    assert s.num_tokens == 14 and s.num_computed_tokens == 13
    sched.preempt(s)
    assert s.block_table == [] and s.num_computed_tokens == 0 and bm.num_used_blocks == 0
    batch = sched.schedule()
    assert batch.starts == [12] and batch.num_tokens == [2]  # blocks 0-2 (12 tokens) were still cached


def test_partial_prefills_holding_blocks_do_not_deadlock():
    bm = BlockManager(7, 4)  # 6 usable blocks
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    head, other = _seq("head", 20, 2), _seq("other", 20, 2)
    sched.add(head)
    sched.add(other)
    bm.allocate(other, 16)  # 'other' holds 4 blocks as if partly prefilled; head needs 5 of 6
    finished = []
    while sched.has_work():
        _step(sched, finished)
    assert {s.request_id for s in finished} == {"head", "other"}
    assert other.num_preemptions >= 1 and head.num_preemptions == 0
    assert bm.num_free_blocks == 6


def test_request_that_can_never_fit_is_rejected():
    sched = Scheduler(BlockManager(5, 4), max_num_seqs=4, max_num_batched_tokens=64)
    sched.check_fits(_seq("ok", 10, 7))  # 16 tokens of K/V at most = 4 blocks
    with pytest.raises(ResourceExhausted, match="KV blocks"):
        sched.check_fits(_seq("big", 10, 8))


def test_finish_frees_waiting_and_running_sequences():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    a, b = _seq("a", 3, 5), _seq("b", 9, 5)
    sched.add(a)
    sched.add(b)
    sched.on_step_done(sched.schedule())  # a prefilled (3), b got 1 token of its prompt
    assert a.status is SequenceStatus.RUNNING and b.block_table
    sched.finish(a, FinishReason.CANCELLED)
    sched.finish(b, FinishReason.CANCELLED)
    sched.finish(b, FinishReason.CANCELLED)
    assert not sched.has_work() and bm.num_free_blocks == 15
    assert a.finish_reason is FinishReason.CANCELLED


def test_a_prefill_backlog_alternates_with_decode_steps():
    """Five 8-token prompts behind a budget of 8 tokens: once a running sequence had no part in
    the last prefill step, a decode step of every running sequence comes next, so a running
    sequence waits at most one prefill step for its next token, not the whole backlog; with
    nothing running, prefill steps follow each other."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    seqs = [Sequence(f"s{i}", list(range(10 * i, 10 * i + 8)), SamplingParams(max_tokens=20), 1024)
            for i in range(5)]  # distinct prompts: no prefix-cache hits
    for s in seqs:
        sched.add(s)
    kinds = []
    for _ in range(9):
        batch = _step(sched, [])
        kinds.append(("P" if batch.is_prefill else "D") + "".join(s.request_id[1] for s in batch.seqs))
    assert kinds == ["P0", "P1", "D01", "P2", "D012", "P3", "D0123", "P4", "D01234"]
    assert [s.num_completion_tokens for s in seqs] == [5, 5, 4, 3, 2]
    assert bm.num_used_blocks == sum(len(s.block_table) for s in seqs)
    late = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    late.add(_seq("late", 20, 2))  # a 20-token prompt, nothing running: three prefill steps in a row
    assert [_step(late, []).is_prefill for _ in range(3)] == [True, True, True]
