"""A simulated paged KV cache for block-manager and scheduler tests (test helper).

Each slot records the token history its K/V stand for (the tokens up to and including its
position), as a real model's K/V do. A step *writes* the slots of its chunk and *reads* every
position of its context through the sequence's block table, checking the history found there. A
block shared across different histories, or a write into a shared or cached block, fails here,
independently of how the block manager keys its cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from runner_service.block_manager import BlockManager
from runner_service.kv_cache import SCRATCH_BLOCK
from runner_service.sequence import Sequence


class SimKV:
    """Slot -> token history, over ``bm``'s blocks."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.writes = 0

    def step(self, seq: Sequence, start: int, n: int) -> None:
        """Compute ``seq``'s tokens ``[start, start + n)``: write their slots (each must be in a
        block this sequence alone holds, outside the prefix cache), then read positions
        ``[0, start + n)`` and check each holds this sequence's own history."""
        bs = self.bm.block_size
        for p in range(start, start + n):
            block = seq.block_table[p // bs]
            assert block != SCRATCH_BLOCK
            assert self.bm.ref_count(block) == 1, f"write into block {block} shared by {self.bm.ref_count(block)}"
            assert not self.bm.is_cached(block), f"write into cached block {block}"
            self.slots[(block, p % bs)] = tuple(seq.token_ids[:p + 1])
            self.writes += 1
        for p in range(start + n):
            got = self.slots.get((seq.block_table[p // bs], p % bs))
            assert got == tuple(seq.token_ids[:p + 1]), (
                f"{seq.request_id}: position {p} reads K/V of another history")


def check_accounting(bm: BlockManager, seqs: Iterable[Sequence]) -> None:
    """Ref counts equal the tables holding each block; used + free == usable; no scratch."""
    seqs = list(seqs)
    holders = Counter(b for s in seqs for b in s.block_table)
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), s
        assert s.num_computed_tokens <= len(s.block_table) * bm.block_size
    assert SCRATCH_BLOCK not in holders and bm.ref_count(SCRATCH_BLOCK) == 0
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [holders.get(b, 0) for b in range(bm.num_blocks)]
    assert bm.num_used_blocks == len(holders)
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_usable_blocks
    assert bm.num_evictable_blocks <= bm.num_cached_blocks <= bm.num_usable_blocks
    assert not bm.is_cached(SCRATCH_BLOCK)
