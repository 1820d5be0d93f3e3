"""Persistent decode buffers and the block-table cache (the host path of a decode step)."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

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

    for b in runner.buckets:
        runner.decode_programs[b] = spy
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
