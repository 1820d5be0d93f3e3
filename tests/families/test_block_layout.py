"""Block-table layouts (model_families/block_layout.py): the paged one and DeepSeek V4's ring,
with expected values worked out by hand from the definitions in the module docstring."""

from __future__ import annotations

import pytest
import torch

from model_families.block_layout import BlockLayout, RingLayout
from runner_service.block_manager import BlockManager
from runner_service.decode_buffers import DecodeBuffers
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import Sequence
from services.errors import InvalidArgument

#: 4-token blocks, a ring of 2 blocks (8 token slots), compressed pools at rates 4 and 8.
RING = RingLayout(4, 2, (4, 8), max_model_len=256)


def test_paged_layout():
    paged = BlockLayout(16)
    assert [paged.blocks_needed(n) for n in (0, 1, 16, 17, 33)] == [0, 1, 1, 2, 3]
    assert paged.slot([7, 3, 9], 17) == 3 * 16 + 1
    assert paged.max_tokens(3) == 48
    assert paged.slots(torch.tensor([7, 3]), torch.tensor([0, 15, 16])).tolist() == [112, 127, 48]


@pytest.mark.parametrize("tokens, blocks", [
    (0, 0), (1, 1), (4, 1), (5, 2), (8, 2),   # the ring fills: ceil(n / 4) up to 2 blocks
    (35, 2),                                  # 8 CSA entries still fit 2 blocks of 4 entries
    (36, 3), (51, 3), (52, 4),                # 9 and 12 entries: 3 blocks; 13: 4
])
def test_ring_blocks_needed(tokens, blocks):
    assert RING.blocks_needed(tokens) == blocks


def test_ring_slots_wrap_and_max_tokens_inverts_blocks_needed():
    table = [5, 9, 2]
    # positions 0..7 fill blocks 5 and 9; position 8 reuses block 5's first row, 13 block 9's second
    assert [RING.slot(table, p) for p in (0, 3, 4, 7, 8, 13)] == [20, 23, 36, 39, 20, 37]
    assert RING.slots(torch.tensor(table), torch.tensor([0, 8, 13])).tolist() == [20, 20, 37]
    assert [RING.max_tokens(b) for b in (0, 1, 2, 3, 64)] == [0, 4, 35, 51, 256]
    for blocks in range(1, 16):  # 16 blocks hold the whole 256-token context
        n = RING.max_tokens(blocks)
        assert RING.blocks_needed(n) <= blocks < RING.blocks_needed(n + 1)
    assert RING.blocks_needed(256) == 16 and RING.max_tokens(16) == 256
    assert RING.describe() == {"kind": "ring", "block_size": 4, "ring_blocks": 2, "rates": [4, 8]}
    with pytest.raises(InvalidArgument):
        RingLayout(4, 0, (4,), 64)


def test_block_manager_and_decode_buffers_follow_the_ring():
    """A 40-token sequence holds 3 blocks (10 CSA entries) instead of the paged 10; the decode
    buffers put its last token in the ring slot and refuse a position its blocks cannot hold."""
    bm = BlockManager(16, 4, enable_prefix_caching=False, layout=RING)
    seq = Sequence("a", list(range(40)), SamplingParams(max_tokens=8), 256)
    bm.allocate(seq, 40)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    assert bm.tokens_that_fit(seq) == RING.max_tokens(3 + 12)
    buffers = DecodeBuffers(4, RING.blocks_needed(256), 4, 16, layout=RING)
    buffers.fill([7], [39], [seq.block_table])
    table = seq.block_table
    assert buffers.slot_mapping[0].item() == table[(39 // 4) % 2] * 4 + 39 % 4
    with pytest.raises(InvalidArgument, match="outside its"):
        buffers.fill([7], [52], [seq.block_table])  # 13 CSA entries need a 4th block
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 15
