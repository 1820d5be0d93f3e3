"""Persistent decode buffers and the block-table cache (the host path of a decode step)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.block_layout import BlockLayout, RingLayout
from model_families.llama import FAMILY as LLAMA
from runner_service.decode_buffers import DecodeBuffers
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from services.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "logits_indices")


def _snapshot(buf):
    return {n: getattr(buf, n).clone() for n in NAMES}


def test_active_prefix_fill_and_padding_rows_point_at_scratch():
    buf = DecodeBuffers(max_num_seqs=4, max_blocks_per_seq=3, block_size=4, num_blocks=10)
    n = buf.fill([11, 12], [5, 0], [[3, 7], [9]])
    assert n == 2
    assert buf.input_ids.tolist() == [11, 12, 0, 0]
    assert buf.positions.tolist() == [5, 0, 0, 0]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert buf.slot_mapping.tolist() == [7 * 4 + 1, 9 * 4 + 0, 0, 0]
    assert buf.seq_lens.tolist() == [6, 1, 1, 1]
    assert buf.block_tables.tolist() == [[3, 7, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert buf.logits_indices.tolist() == [0, 1, 2, 3]
    buf.fill([13], [2], [[4]])  # row 1 leaves: it becomes padding again
    assert buf.input_ids.tolist() == [13, 0, 0, 0]
    assert buf.block_tables.tolist() == [[4, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert buf.slot_mapping.tolist() == [4 * 4 + 2, 0, 0, 0]


def test_block_table_rows_rebuilt_only_when_their_block_ids_change():
    buf = DecodeBuffers(max_num_seqs=4, max_blocks_per_seq=4, block_size=4, num_blocks=20)
    buf.fill([1, 2, 3], [0, 1, 2], [[1], [2], [3]])
    assert buf.row_builds == 3
    buf.fill([1, 2, 3], [1, 2, 3], [[1], [2], [3]])  # same blocks: nothing rebuilt
    assert buf.row_builds == 3
    buf.fill([1, 2, 3], [4, 3, 3], [[1, 5], [2], [3]])  # row 0 grew a block
    assert buf.row_builds == 4
    for _ in range(10):
        buf.fill([1, 2, 3], [4, 3, 3], [[1, 5], [2], [3]])
    assert buf.row_builds == 4
    buf.fill([1, 2], [4, 3], [[1, 5], [2]])  # row 2 becomes padding: one rebuild
    assert buf.row_builds == 5
    buf.fill([1, 2], [4, 3], [[1, 5], [2]])
    assert buf.row_builds == 5


def test_out_of_range_rows_are_rejected_before_any_buffer_is_touched():
    buf = DecodeBuffers(max_num_seqs=2, max_blocks_per_seq=2, block_size=4, num_blocks=6)
    buf.fill([5], [1], [[2]])
    before, builds = _snapshot(buf), buf.row_builds
    bad_calls = [
        ([1, 2, 3], [0, 0, 0], [[1], [2], [3]]),     # more rows than max_num_seqs
        ([1], [0], [[1, 2, 3]]),                     # more blocks than max_blocks_per_seq
        ([1, 2], [0, 0], [[1], [6]]),                # block id >= num_blocks
        ([1], [0], [[0]]),                           # the scratch block is not a sequence's block
        ([1, 2], [0, 4], [[1], [2]]),                # position outside the row's blocks
        ([1, 2], [0], [[1], [2]]),                   # ragged inputs
    ]
    for tokens, positions, tables in bad_calls:
        with pytest.raises(InvalidArgument):
            buf.fill(tokens, positions, tables)
        after = _snapshot(buf)
        assert all(torch.equal(before[n], after[n]) for n in NAMES)
        assert buf.row_builds == builds
    with pytest.raises(InvalidArgument):
        buf.views(3, 1)
    with pytest.raises(InvalidArgument):
        buf.views(1, 3)


def test_reset_and_close_clear_buffers_and_cache_together():
    buf = DecodeBuffers(max_num_seqs=2, max_blocks_per_seq=2, block_size=4, num_blocks=6)
    buf.fill([5, 6], [1, 2], [[2], [3]])
    buf.reset()
    assert buf.num_active == 0 and buf.input_ids.tolist() == [0, 0]
    assert buf.block_tables.tolist() == [[0, 0], [0, 0]]
    builds = buf.row_builds
    buf.fill([5, 6], [1, 2], [[2], [3]])  # the cache was cleared: both rows are rebuilt
    assert buf.row_builds == builds + 2
    buf.close()
    assert buf.num_active == 0
    buf.reset()
    assert buf.fill([7], [0], [[1]]) == 1 and buf.input_ids.tolist() == [7, 0]


def test_engine_decode_reuses_buffers_for_100_steps_and_rebuilds_only_changed_rows():
    args = tiny_args()
    eng = LLMEngine(args, LLAMA.random_weights(args), tiny_config(kv_cache_bytes=kv_bytes(args, 200)))
    runner = eng.runner
    seen = []  # (batch, data_ptrs of the inputs) per decode call

    def spy(*inputs):
        seen.append((inputs[0].shape[0], tuple(t.data_ptr() for t in inputs)))
        return runner.decode_step(*inputs)

    runner.decode = spy
    ptrs = {n: getattr(runner.buffers, n).data_ptr() for n in NAMES}
    params = SamplingParams(max_tokens=102, temperature=0, ignore_eos=True)
    streams = [eng.add_request(params, token_ids=list(range(2, 2 + n))) for n in (3, 6)]
    eng.step()  # prefill both
    builds_before = runner.buffers.row_builds
    blocks_seen = [len(s.block_table) for s in eng.scheduler.running]
    expected_builds = 0
    for _ in range(100):
        eng.step()
        now = [len(s.block_table) for s in eng.scheduler.running]
        expected_builds += sum(1 for a, b in zip(now, blocks_seen, strict=True) if a != b)
        blocks_seen = now
    assert len(seen) == 100
    # Every decode saw the same storage for its five inputs (same batch bucket: 2 rows).
    assert {s for s in seen} == {seen[0]}
    assert {n: getattr(runner.buffers, n).data_ptr() for n in NAMES} == ptrs
    # First decode builds both rows; afterwards only rows whose sequence grew a block.
    assert runner.buffers.row_builds - builds_before == 2 + expected_builds
    # Prompt p holds ceil(p / 4) blocks after prefill and ceil((p + 100) / 4) after 100 decodes.
    assert expected_builds == (26 - 1) + (27 - 2)
    eng.run_until_done()
    assert all(s.result(timeout=0).completion_tokens == 102 for s in streams)
    eng.close()


#: 4-token blocks, a ring of 2 blocks (8 token slots), compressed pools at rates 4 and 8.
RING = RingLayout(4, 2, (4, 8), max_model_len=256)


def test_layout_row_and_vectorised_slots_from_first_principles():
    paged = BlockLayout(4)
    # paged: row 0, position 5 is block column 5 // 4 = 1 (block 3), row 1 of that block -> 3 * 4 + 1;
    # row 1, position 2 is column 0 (block 5) -> 5 * 4 + 2
    tables = np.array([[7, 3, 0], [5, 0, 0]], dtype=np.int64)
    assert paged.slots_np(tables, np.array([5, 2], dtype=np.int64)).tolist() == [13, 22]
    assert paged.row_slots([[7, 3], [5]], [5, 2]) == [13, 22]
    # ring of 2 blocks: position 13 is column (13 // 4) % 2 = 1 (block 9) -> 9 * 4 + 1; position 8
    # wraps to column (8 // 4) % 2 = 0 (block 6) -> 6 * 4 + 0
    tables = np.array([[5, 9, 2], [6, 1, 0]], dtype=np.int64)
    assert RING.slots_np(tables, np.array([13, 8], dtype=np.int64)).tolist() == [37, 24]
    assert RING.row_slots([[5, 9, 2], [6, 1]], [13, 8]) == [37, 24]
    # one row serves many positions: 0..3 in block 5, 4..7 in block 9, 8 wraps to block 5
    assert RING.slots_np(tables[:1], np.arange(9)).tolist() == [20, 21, 22, 23, 36, 37, 38, 39, 20]
    # the ring's slots repeat every ring_blocks * block_size = 8 positions; paged slots never do
    assert paged.slot_period is None and RING.slot_period == 8
    assert [RING.slot([5, 9], p) for p in range(8)] == [RING.slot([5, 9], p + 8) for p in range(8)]


@pytest.mark.parametrize("layout", [BlockLayout(4), RING], ids=["paged", "ring"])
def test_fill_matches_the_layout_over_random_steps(layout):
    """Sequences join, leave, grow blocks and swap rows; every step's buffers equal what the
    layout says from the block lists (batches cross the Python / numpy slot threshold)."""
    rng = random.Random(0)
    max_rows, max_blocks = 48, layout.blocks_needed(256)
    buf = DecodeBuffers(max_rows, max_blocks, 4, num_blocks=1 << 16, layout=layout)
    next_block = iter(range(1, 1 << 16))
    seqs = []  # [length, blocks]
    for step in range(300):
        if rng.random() < 0.1 and seqs:
            seqs.pop(rng.randrange(len(seqs)))
        while len(seqs) < max_rows and (not seqs or rng.random() < 0.15):
            length = rng.randrange(1, 200)
            seqs.append([length, [next(next_block) for _ in range(layout.blocks_needed(length))]])
        if rng.random() < 0.05:
            rng.shuffle(seqs)
        for s in seqs:
            s[0] += 1
            if s[0] > 255:
                s[0] = 1
                s[1] = [next(next_block)]
            while len(s[1]) < layout.blocks_needed(s[0]):
                s[1].append(next(next_block))
        n = len(seqs)
        tokens, positions = [step + i for i in range(n)], [s[0] - 1 for s in seqs]
        assert buf.fill(tokens, positions, [s[1] for s in seqs]) == n
        assert buf.input_ids.tolist() == tokens + [0] * (max_rows - n)
        assert buf.positions.tolist() == positions + [0] * (max_rows - n)
        assert buf.seq_lens.tolist() == [p + 1 for p in positions] + [1] * (max_rows - n)
        expected = [layout.slot(s[1], p) for s, p in zip(seqs, positions, strict=True)]
        assert buf.slot_mapping.tolist() == expected + [0] * (max_rows - n)
        assert buf.block_tables.tolist() == [s[1] + [0] * (max_blocks - len(s[1])) for s in seqs] + (
            [[0] * max_blocks] * (max_rows - n))


def test_a_position_past_a_capped_limit_is_still_checked_against_the_blocks():
    """RING.max_tokens(16) is capped at max_model_len (256), yet 16 blocks hold position 256
    (257 tokens: 64 CSA entries = 16 blocks); position 260 (65 entries) needs a 17th."""
    buf = DecodeBuffers(2, 17, 4, num_blocks=64, layout=RING)
    blocks = list(range(1, 17))
    assert RING.max_tokens(16) == 256 and RING.blocks_needed(257) == 16 and RING.blocks_needed(261) == 17
    buf.fill([1], [256], [blocks])
    assert buf.slot_mapping[0].item() == RING.slot(blocks, 256)
    with pytest.raises(InvalidArgument, match="outside its"):
        buf.fill([1], [260], [blocks])


def test_a_rejected_changed_row_leaves_buffers_and_cache_as_they_were():
    buf = DecodeBuffers(max_num_seqs=3, max_blocks_per_seq=3, block_size=4, num_blocks=10)
    buf.fill([5, 6], [1, 2], [[2], [3]])
    before, builds = _snapshot(buf), buf.row_builds
    for tables, positions in [([[2], [3, 10]], [1, 2]),    # row 1 changes to a bad block id
                              ([[2], [4]], [1, 4]),        # row 1 changes, position past its block
                              ([[2, 7], [3]], [9, -1])]:   # row 0 changes, row 1 negative
        with pytest.raises(InvalidArgument):
            buf.fill([5, 6], positions, tables)
        after = _snapshot(buf)
        assert all(torch.equal(before[n], after[n]) for n in NAMES)
        assert buf.row_builds == builds
    with pytest.raises(InvalidArgument, match="outside its"):
        buf.fill([5, 6], [4, 2], [[2], [3]])  # the cached limit of row 0 (one block) still holds
    buf.fill([5, 6], [4, 2], [[2, 7], [3]])
    assert buf.slot_mapping.tolist() == [7 * 4 + 0, 3 * 4 + 2, 0] and buf.row_builds == builds + 1


def test_views_are_made_once_per_shape_and_allocation():
    buf = DecodeBuffers(max_num_seqs=4, max_blocks_per_seq=3, block_size=4, num_blocks=10)
    buf.fill([5, 6], [1, 2], [[2], [3]])
    views = buf.views(2, 1)
    assert all(a is b for a, b in zip(views, buf.views(2, 1), strict=True))
    assert [v.shape for v in buf.views(4, 3)] == [(4,), (4,), (4,), (4, 3), (4,)]
    buf.fill([7, 8], [3, 5], [[2], [3, 4]])  # the same views see the new step
    assert views[0].tolist() == [7, 8] and views[2].tolist() == [2 * 4 + 3, 4 * 4 + 1]
    with torch.inference_mode():
        assert buf.views(2, 1)[0].data_ptr() == views[0].data_ptr()
    buf.reset()
    fresh = buf.views(2, 1)
    assert fresh[0] is not views[0] and fresh[0].data_ptr() == buf.input_ids.data_ptr()
