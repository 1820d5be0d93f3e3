"""BlockManager: scratch block never handed out, all-or-nothing allocation, idempotent free."""

from __future__ import annotations

import pytest

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
