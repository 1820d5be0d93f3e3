"""The MTP drafter's staging (``runner_service.mtp.MtpBuffers``): the block's inputs live in
buffers allocated once, which every decode step's block run reads (the same storage across
steps, preemption included); padding rows and positions point at the scratch block; a bad step
raises before anything is written."""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_tiny import TINY_HC4
from runner_tiny import tiny_config

from model_families.block_layout import BlockLayout
from model_families.deepseek_v4 import FAMILY
from runner_service.engine import LLMEngine
from runner_service.mtp import MtpBuffers
from runner_service.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3


def _buffers(**kw) -> MtpBuffers:
    args = dict(max_num_seqs=4, width=1 + K, stream_shape=(2, 3), max_blocks_per_seq=6, num_blocks=32,
                layout=BlockLayout(4))
    args.update(kw)
    return MtpBuffers(**args)


def _snapshot(buf: MtpBuffers) -> list[torch.Tensor]:
    return [t.clone() for t in (buf.hidden, buf.input_ids, buf.positions, buf.seq_lens, buf.block_tables, buf.top)]


def test_the_block_reads_the_buffers_allocated_once_across_decode_steps_and_preemption():
    """8 sequences, K = 3, a KV budget small enough to preempt: every block run with at most
    ``1 + K`` positions a row (every decode step's catch-up and draft steps) reads views of the
    drafter's buffers, whose storage never changes; only catch-ups after prefill chunks longer
    than ``1 + K`` are staged apart; the text is plain decoding's."""
    config = FAMILY.config_from_hf(TINY_HC4)
    weights = FAMILY.random_weights(config, seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (3 + 4 * i,), generator=g).tolist() for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    def run(engine):
        streams = [engine.add_request(params, token_ids=p) for p in prompts]
        engine.run_until_done()
        return [s.result(timeout=0).token_ids for s in streams]

    plain = run(LLMEngine(config, weights, tiny_config(compile="off"), family=FAMILY))
    per_block = sum(s.bytes_per_block(torch.float32) for s in (*FAMILY.cache_specs(config, 4),
                                                               *FAMILY.draft_cache_specs(config, 4, "mtp")))
    blocks = FAMILY.block_layout(config, 4, 256, K).blocks_needed(60) * 4
    engine = LLMEngine(config, weights, tiny_config(compile="off", speculative="mtp", num_speculative_tokens=K,
                                                    kv_cache_bytes=per_block * blocks), family=FAMILY)
    drafter, model = engine.drafter, engine.runner.model
    buf = drafter.buffers
    owned = {name: getattr(buf, name).data_ptr()
             for name in ("hidden", "input_ids", "positions", "seq_lens", "block_tables", "top")}
    calls = []
    mtp = model.mtp

    def recording(pool, hidden, ids, pos, tables, lens, block=0):
        B, S = ids.shape
        calls.append((S, (hidden.data_ptr(), ids.data_ptr(), pos.data_ptr(), tables.data_ptr(), lens.data_ptr())))
        # padding positions: token 0, streams 0 (as the fresh staging pads them)
        count = (lens - pos[:, 0]).tolist()
        for r, n in enumerate(count):
            assert (ids[r, n:] == 0).all() and (hidden[r, n:] == 0).all()
        return mtp(pool, hidden, ids, pos, tables, lens, block)

    model.mtp = recording
    try:
        got = run(engine)
    finally:
        del model.mtp
    assert got == plain
    assert engine.scheduler.num_preemptions > 0
    assert {name: getattr(buf, name).data_ptr() for name in owned} == owned
    staged = [ptrs for S, ptrs in calls if S <= 1 + K]
    want = tuple(owned[name] for name in ("hidden", "input_ids", "positions", "block_tables", "seq_lens"))
    assert len(staged) > 100 and all(ptrs == want for ptrs in staged)
    assert drafter.fresh_runs == sum(S > 1 + K for S, _ in calls) > 0
    engine.close()
    assert buf.hidden is None  # closed with the runner's buffers


def test_padding_rows_and_positions_point_at_the_scratch_block():
    buf = _buffers()
    source = torch.arange(3 * 4 * 2 * 3, dtype=torch.float32).view(3, 4, 2, 3)
    tables = [[5, 6], [7], [8, 9, 10]]
    h, ids, pos, bt, lens = buf.fill(source, [2, 0, 1], [0, 1, 0], [[11, 12, 13], [14], [15, 16]], [4, 0, 9], tables)
    assert h.shape == (3, 3, 2, 3) and ids.shape == pos.shape == (3, 3)
    assert bt.shape == (3, 3) and lens.tolist() == [7, 1, 11]
    assert torch.equal(h[0], source[2, :3]) and torch.equal(h[1, 0], source[0, 1]) and torch.equal(h[2, :2], source[1, :2])
    assert (h[1, 1:] == 0).all() and (h[2, 2:] == 0).all()
    assert ids.tolist() == [[11, 12, 13], [14, 0, 0], [15, 16, 0]]
    assert pos.tolist() == [[4, 5, 6], [0, 1, 2], [9, 10, 11]]
    assert bt.tolist() == [[5, 6, 0], [7, 0, 0], [8, 9, 10]]
    assert buf.row_builds == 3
    # a step of one row: rows 1 .. 3 become padding rows (no positions, every entry the scratch block)
    h, ids, pos, bt, lens = buf.fill(source, [1], [3], [[17]], [12], [[8, 9, 10, 11]])
    assert torch.equal(h[0, 0], source[1, 3]) and ids.tolist() == [[17]] and pos.tolist() == [[12]]
    assert bt.tolist() == [[8, 9, 10, 11]] and lens.tolist() == [13]
    assert (buf.block_tables[1:] == 0).all() and (buf.seq_lens[1:] == 0).all()
    assert buf.block_tables[0].tolist() == [8, 9, 10, 11, 0, 0]
    builds = buf.row_builds
    buf.fill(source, [0], [0], [[1, 2]], [13], [[8, 9, 10, 11]])  # the same blocks: no row rebuilt
    assert buf.row_builds == builds


def test_a_bad_step_raises_before_anything_is_written():
    buf = _buffers()
    source = torch.randn(3, 4, 2, 3)
    buf.fill(source, [0, 1], [0, 0], [[1, 2], [3]], [0, 5], [[1, 2], [3, 4]])
    before, builds = _snapshot(buf), buf.row_builds
    good = dict(rows=[0, 1], cols=[0, 0], ids=[[9], [9]], starts=[1, 6], block_tables=[[5], [6]])
    bad = [
        ("rows disagree", dict(rows=[0])),
        ("1 to 4 rows", dict(rows=[0] * 5, cols=[0] * 5, ids=[[9]] * 5, starts=[1] * 5, block_tables=[[5]] * 5)),
        ("1 to 4 positions", dict(ids=[[9] * 5, [9]])),
        ("1 to 4 positions", dict(ids=[[], [9]])),
        ("source rows", dict(rows=[0, 3])),
        ("source rows", dict(cols=[0, 4])),
        ("starts", dict(starts=[1, -1])),
        ("block ids", dict(block_tables=[[5], [32]])),
        ("exceed max_blocks_per_seq", dict(block_tables=[[5], [1, 2, 3, 4, 5, 6, 7]])),
        ("more than max_blocks_per_seq", dict(starts=[1, 40])),
    ]
    for match, change in bad:
        args = {**good, **change}
        with pytest.raises(ValueError, match=match):
            buf.fill(source, args["rows"], args["cols"], args["ids"], args["starts"], args["block_tables"])
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(buf), strict=True)), match
        assert buf.row_builds == builds
    with pytest.raises(ValueError, match="streams"):
        buf.fill(source.double(), **good)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(buf), strict=True))


def test_reset_clears_the_block_table_cache_with_the_buffers():
    buf = _buffers()
    source = torch.randn(1, 1, 2, 3)
    buf.fill(source, [0], [0], [[1]], [0], [[3]])
    builds = buf.row_builds
    buf.reset()
    assert (buf.block_tables == 0).all()
    _, _, _, bt, _ = buf.fill(source, [0], [0], [[1]], [0], [[3]])
    assert buf.row_builds == builds + 1 and bt.tolist() == [[3]]
    buf.close()
    assert buf.hidden is None
