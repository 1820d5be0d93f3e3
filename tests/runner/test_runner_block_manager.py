"""BlockManager: scratch block never handed out, all-or-nothing allocation, idempotent free; the
prefix cache: hash-chain keys, hits on full blocks only, LRU eviction, exact ref counts and free
counts, and no sharing across different token histories even when keys collide (checked by a
simulated KV cache, :mod:`kv_sim`)."""

from __future__ import annotations

import hashlib
import random

import pytest
from kv_sim import SimKV, check_accounting

from runner_service import block_manager
from runner_service.block_manager import BlockManager
from runner_service.kv_cache import SCRATCH_BLOCK
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import Sequence
from services.errors import InvalidArgument, ResourceExhausted


def _seq(n=1):
    return Sequence("r", list(range(n)), SamplingParams(max_tokens=4), 1024)


def test_blocks_needed_is_ceiling_division():
    bm = BlockManager(10, 16)
    assert [bm.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_scratch_block_is_never_allocated_and_all_others_are():
    bm = BlockManager(9, 4)
    s = _seq()
    bm.allocate(s, 8 * 4)
    assert sorted(s.block_table) == list(range(1, 9))
    assert SCRATCH_BLOCK not in s.block_table
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 8 and bm.num_usable_blocks == 8


def test_allocation_grows_incrementally_and_fails_without_side_effects():
    bm = BlockManager(5, 4)
    a, b = _seq(), _seq()
    bm.allocate(a, 5)          # 2 blocks
    assert len(a.block_table) == 2
    bm.allocate(a, 8)          # still 2
    assert len(a.block_table) == 2
    bm.allocate(a, 9)          # 3
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(b, 5)
    with pytest.raises(ResourceExhausted):
        bm.allocate(b, 5)
    assert b.block_table == [] and bm.num_free_blocks == 1


def test_free_returns_blocks_once():
    bm = BlockManager(5, 4)
    a = _seq()
    bm.allocate(a, 16)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 4


def test_rejects_pools_without_a_usable_block():
    with pytest.raises(InvalidArgument):
        BlockManager(1, 16)


# -- prefix caching -----------------------------------------------------------------------------


def _tseq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), 1024)


def _compute(bm, seq, sim=None):
    """Prefill ``seq`` as the scheduler would: cached prefix first, then compute the rest and
    register the blocks it filled."""
    bm.allocate_cached_prefix(seq)
    start = seq.num_computed_tokens
    bm.allocate(seq, seq.num_tokens)
    if sim is not None:
        sim.step(seq, start, seq.num_tokens - start)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def _chain(blocks):
    """Independent reference of the key formula: SHA-256 over the parent key and int64 LE ids."""
    keys, parent = [], b""
    for block in blocks:
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block)).digest()
        keys.append(parent)
    return keys


def test_full_blocks_are_keyed_by_a_hash_chain_of_their_tokens():
    bm = BlockManager(10, 4)
    a = _compute(bm, _tseq(range(10)))
    assert a.block_hashes == _chain([[0, 1, 2, 3], [4, 5, 6, 7]])  # the partial third block is not keyed
    assert [bm.is_cached(b) for b in a.block_table] == [True, True, False]
    assert bm.num_cached_blocks == 2


def test_a_shared_prefix_hits_its_full_blocks_and_computation_starts_after_them():
    bm = BlockManager(20, 4)
    sim = SimKV(bm)
    a = _compute(bm, _tseq([5, 6, 7, 8, 9, 10, 11, 12, 13, 14]), sim)
    b = _tseq([5, 6, 7, 8, 9, 10, 11, 12, 99, 98, 97])
    assert bm.allocate_cached_prefix(b) == 8
    assert b.num_computed_tokens == 8 and b.block_table == a.block_table[:2]
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    bm.allocate(b, b.num_tokens)
    sim.step(b, 8, 3)  # b's own third block; the shared two read a's K/V, which is b's history too
    assert b.block_table[2] not in a.block_table
    check_accounting(bm, [a, b])
    # a different first block shares nothing, even though later blocks repeat a's tokens
    c = _tseq([1, 2, 3, 4, 9, 10, 11, 12, 13])
    assert bm.allocate_cached_prefix(c) == 0 and c.block_table == [] and c.num_computed_tokens == 0


def test_at_least_the_last_token_is_computed_so_a_block_aligned_full_hit_recomputes_its_last_block():
    bm = BlockManager(20, 4)
    a = _compute(bm, _tseq(range(8)))
    same = _tseq(range(8))
    assert bm.allocate_cached_prefix(same) == 4  # not 8: the last block is computed again
    assert same.num_uncomputed_tokens == 4 and same.block_table == a.block_table[:1]
    longer = _tseq(range(9))
    assert bm.allocate_cached_prefix(longer) == 8 and longer.num_uncomputed_tokens == 1
    short = _tseq(range(4))
    assert bm.allocate_cached_prefix(short) == 0


def test_freed_cached_blocks_stay_free_and_reusable_until_evicted_lru_tail_first():
    bm = BlockManager(7, 2)  # 6 usable blocks
    a = _compute(bm, _tseq([1, 2, 3, 4]))     # 2 full blocks, cached
    b = _compute(bm, _tseq([5, 6]))           # 1 full block, cached
    a_blocks, b_block = list(a.block_table), b.block_table[0]
    bm.free(a)                                # released tail first: a[1] is older than a[0]
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6
    assert bm.num_cached_blocks == 3 and bm.num_evictable_blocks == 3
    filler = _tseq([9] * 7)
    bm.allocate(filler, 7)                    # 4 blocks: 3 truly free first, then 1 eviction
    assert bm.num_evictions == 1 and a_blocks[1] in filler.block_table
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2
    again = _tseq([1, 2, 3, 4, 0])
    assert bm.allocate_cached_prefix(again) == 2 and again.block_table == a_blocks[:1]  # the prefix survived
    assert bm.num_free_blocks == 1            # taking an evictable block back makes it used
    bm.free(again)                            # a[0] is now the most recently used
    bm.allocate(filler, 9)                    # one more block: evicts b's (older than a[0])
    assert b_block in filler.block_table and bm.num_cached_blocks == 1
    assert bm.allocate_cached_prefix(_tseq([5, 6, 0])) == 0
    check_accounting(bm, [filler])


def test_ref_counts_and_counts_stay_exact_when_sharers_leave_in_any_order():
    bm = BlockManager(9, 4)
    a = _compute(bm, _tseq(range(9)))
    b, c = _tseq(range(10)), _tseq(range(11))
    assert bm.allocate_cached_prefix(b) == 8 and bm.allocate_cached_prefix(c) == 8
    bm.allocate(b, 10)
    bm.allocate(c, 11)
    check_accounting(bm, [a, b, c])
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 3
    bm.free(b)
    check_accounting(bm, [a, c])
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 4
    bm.free(a)
    assert bm.num_used_blocks == 3 and bm.ref_count(c.block_table[0]) == 1
    bm.free(c)
    bm.free(c)
    check_accounting(bm, [])
    assert bm.num_free_blocks == 8 and bm.num_evictable_blocks == 2


def test_same_history_computed_twice_is_cached_once():
    bm = BlockManager(9, 4)
    a, b = _tseq(range(6), "a"), _tseq(range(6), "b")
    for s in (a, b):  # prefilled in one step: neither finds the other
        bm.allocate(s, 6)
        s.num_computed_tokens = 6
    for s in (a, b):
        bm.cache_full_blocks(s)
    assert bm.is_cached(a.block_table[0]) and not bm.is_cached(b.block_table[0])
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 1 and bm.num_free_blocks == 8


def test_a_forced_hash_collision_never_shares_blocks_across_histories(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids: b"same")
    bm = BlockManager(20, 4)
    sim = SimKV(bm)
    a = _compute(bm, _tseq([1, 2, 3, 4, 5, 6, 7, 8, 9]), sim)
    assert bm.num_cached_blocks == 1  # the second block collides with the first: not cached
    other = _compute(bm, _tseq([9, 9, 9, 9, 5, 6, 7, 8, 9]), sim)
    assert not set(other.block_table) & set(a.block_table)
    same = _tseq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.allocate_cached_prefix(same) == 4 and same.block_table == a.block_table[:1]
    check_accounting(bm, [a, other, same])


def test_block_tokens_equal_after_a_different_history_are_not_shared(monkeypatch):
    # A "hash chain" that forgets the parent: block 2 of both histories gets the same key, so only
    # the stored parent identity tells them apart.
    monkeypatch.setattr(block_manager, "hash_block",
                        lambda parent, token_ids: hashlib.sha256(repr(list(token_ids)).encode()).digest())
    bm = BlockManager(20, 4)
    sim = SimKV(bm)
    a = _compute(bm, _tseq([1, 2, 3, 4, 5, 6, 7, 8, 0]), sim)
    b = _compute(bm, _tseq([9, 9, 9, 9, 5, 6, 7, 8, 0]), sim)
    d = _tseq([9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert bm.allocate_cached_prefix(d) == 4 and d.block_table == b.block_table[:1]
    bm.allocate(d, 9)
    sim.step(d, 4, 5)
    assert d.block_table[1] != a.block_table[1]
    check_accounting(bm, [a, b, d])


def test_prefix_caching_off_never_caches():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    a = _compute(bm, _tseq(range(9)))
    assert bm.num_cached_blocks == 0
    b = _tseq(range(9))
    assert bm.allocate_cached_prefix(b) == 0 and b.block_table == []
    bm.free(a)
    assert bm.num_free_blocks == 9 and bm.num_evictable_blocks == 0


def test_reset_prefix_cache_drops_every_entry_and_keeps_counts():
    bm = BlockManager(10, 4)
    a = _compute(bm, _tseq(range(9)))
    b = _compute(bm, _tseq([7] * 9))
    bm.free(b)
    assert bm.reset_prefix_cache() == 4
    assert bm.num_cached_blocks == 0 and bm.num_evictable_blocks == 0
    check_accounting(bm, [a])
    assert bm.allocate_cached_prefix(_tseq(range(9))) == 0
    a.token_ids += [1, 2, 3]
    a.num_computed_tokens = 12
    bm.allocate(a, 12)
    bm.cache_full_blocks(a)  # a's chain was dropped: its later blocks are not cached either
    assert bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 9


@pytest.mark.parametrize("hashing", ["sha256", "constant", "parent-blind"])
@pytest.mark.parametrize("seed", range(4))
def test_random_alloc_free_preempt_keeps_counts_exact_and_never_shares_wrong_blocks(seed, hashing, monkeypatch):
    if hashing == "constant":
        monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids: b"k")
    elif hashing == "parent-blind":
        monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids: bytes(token_ids))
    rng = random.Random(seed)
    bm = BlockManager(25, rng.choice([2, 3, 4]))
    sim = SimKV(bm)
    bases = [[rng.randint(1, 3) for _ in range(24)] for _ in range(3)]
    live: list[Sequence] = []
    hits = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.15 or not live:  # a new request: a shared prefix (or a live history) plus a tail
            src = rng.choice(bases + [s.token_ids for s in live])
            tokens = src[:rng.randint(0, len(src))] + [rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
            live.append(_tseq(tokens[:40], f"s{step}"))
        elif op < 0.25:  # finished or cancelled
            bm.free(live.pop(rng.randrange(len(live))))
        elif op < 0.33:  # preempted: blocks freed, recomputed later
            s = rng.choice(live)
            bm.free(s)
            s.num_computed_tokens = 0
        else:  # one prefill chunk or decode step
            s = rng.choice(live)
            if s.num_computed_tokens == s.num_tokens:
                if s.num_tokens >= 48:
                    bm.free(s)
                    live.remove(s)
                    continue
                s.token_ids.append(rng.randint(1, 3))  # the token sampled last step
            if not s.block_table:
                hit = bm.allocate_cached_prefix(s)
                hits += hit
                assert hit <= s.num_tokens - 1 and hit % bm.block_size == 0
            n = rng.randint(1, s.num_uncomputed_tokens)
            if not bm.can_allocate(s, s.num_computed_tokens + n):
                if s.num_computed_tokens == 0 or rng.random() < 0.5:
                    bm.free(s)
                    s.num_computed_tokens = 0
                continue
            bm.allocate(s, s.num_computed_tokens + n)
            sim.step(s, s.num_computed_tokens, n)
            s.num_computed_tokens += n
            bm.cache_full_blocks(s)
        check_accounting(bm, live)
        if hashing == "constant":
            assert bm.num_cached_blocks <= 1
    if hashing == "sha256":
        assert hits > 0 and bm.num_evictions > 0
    for s in live:
        bm.free(s)
    check_accounting(bm, [])
    assert bm.num_free_blocks == 24


def test_an_entry_whose_history_was_evicted_is_replaced_and_never_hit():
    bm = BlockManager(8, 2)  # 7 usable blocks
    x, y = _tseq([1, 2, 3], "x"), _tseq([1, 2, 3], "y")
    for s in (x, y):  # the same first block, computed by both in one step
        bm.allocate(s, 3)
        s.num_computed_tokens = 2
    for s in (x, y):
        bm.cache_full_blocks(s)
    assert bm.is_cached(x.block_table[0]) and not bm.is_cached(y.block_table[0])
    y.num_computed_tokens = 3
    y.token_ids.append(4)
    bm.allocate(y, 4)
    y.num_computed_tokens = 4
    bm.cache_full_blocks(y)  # y's second block is cached after x's first block (its twin)
    assert bm.is_cached(y.block_table[1]) and bm.num_cached_blocks == 2
    bm.free(x)  # x's block is evictable; a filler evicts it: y's cached block loses its history
    filler = _tseq([9] * 10)
    bm.allocate(filler, 10)
    assert bm.num_evictions == 1 and bm.num_cached_blocks == 1
    bm.free(filler)
    z = _compute(bm, _tseq([1, 2, 3, 4, 5]))
    assert z.block_table[1] != y.block_table[1]  # the unreachable entry was not hit...
    assert bm.is_cached(z.block_table[1]) and not bm.is_cached(y.block_table[1])  # ...but replaced
    check_accounting(bm, [y, z])
    w = _tseq([1, 2, 3, 4, 0])
    assert bm.allocate_cached_prefix(w) == 4 and w.block_table == z.block_table[:2]
    bm.free(y)
    check_accounting(bm, [z, w])
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == 4
