"""``model_families.custom_ops.index_topk`` (the DeepSeek V4 indexer's picks, each row cut to its
own length) against ``torch.topk`` on each row's exact-length slice, one row at a time (the rule of
transformers' ``DeepseekV4Indexer``), on rows full of exact ties."""

from __future__ import annotations

import pytest
import torch

from model_families.custom_ops import index_topk

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _brute(scores, lengths, closed, k):
    """Row by row: ``topk(min(k, n))`` of the first ``n = lengths`` scores, those at or past
    ``closed`` at ``-inf``; the picks below ``closed`` kept."""
    E = scores.shape[-1]
    flat, out = scores.reshape(-1, E), torch.zeros(scores.reshape(-1, E).shape, dtype=torch.bool)
    for r, (n, c) in enumerate(zip(lengths.reshape(-1).tolist(), closed.reshape(-1).tolist(), strict=True)):
        row = flat[r, :n].clone()
        row[c:] = float("-inf")
        top = row.topk(min(k, n)).indices
        out[r, top[top < c]] = True
    return out.view(scores.shape)


def _tied_scores(shape, g):
    """Scores as the indexer's (sums of ReLUs times signed weights): most exactly 0 (some -0.0),
    the rest a few repeated values, so ties straddle every top-k boundary."""
    values = torch.tensor([0.0, -0.0, 0.0, 0.5, -0.25, 0.5, 1.0])
    return values[torch.randint(0, len(values), shape, generator=g)]


def test_ties_break_as_topk_on_each_rows_own_length():
    """Rows of different lengths (0, <= k, > k), closed counts below the length (transformers'
    prefill rows), ties at 0: every pick equals torch.topk on the exact-length slice; top-k over
    the full capacity (what a step picked before) differs on some rows, so the test tells the
    rules apart."""
    g = torch.Generator().manual_seed(0)
    B, S, E, k = 6, 5, 48, 3
    scores = _tied_scores((B, S, E), g)
    lengths = torch.randint(0, E + 1, (B, S), generator=g)
    lengths[0] = 30                                                     # one row: a shared length
    lengths[1, :3] = torch.tensor([0, 1, k])                            # no topk needed
    closed = torch.minimum(lengths, torch.randint(0, E + 1, (B, S), generator=g))
    closed[2] = lengths[2]                                              # decode: length == closed
    want = _brute(scores, lengths, closed, k)
    got = index_topk(scores, lengths, closed, k)
    assert got.dtype == torch.bool and got.shape == (B, S, E)
    assert torch.equal(got, want)
    assert torch.equal(torch.ops.warmserve.index_topk(scores, lengths, closed, k), want)  # what programs call
    assert int(got.sum()) == int(torch.minimum(closed, torch.full_like(closed, k)).sum())
    capacity = _brute(scores, torch.full_like(lengths, E), closed, k)
    assert not torch.equal(capacity, want)


@pytest.mark.parametrize("length", [2, 7, 40])
@pytest.mark.parametrize("tied", [True, False], ids=["ties", "distinct_scores"])
def test_decode_rows_of_one_length_and_of_several(length, tied):
    """Decode rows (length == closed): all the same length, and of distinct lengths; scores
    with ties (rows redone at their length) and without (the batched top-k alone)."""
    g = torch.Generator().manual_seed(length)
    scores = _tied_scores((8, 1, 64), g) if tied else torch.randn(8, 1, 64, generator=g)
    same = torch.full((8, 1), length)
    assert torch.equal(index_topk(scores, same, same, 2), _brute(scores, same, same, 2))
    mixed = torch.randint(0, 64, (8, 1), generator=g)
    assert torch.equal(index_topk(scores, mixed, mixed, 2), _brute(scores, mixed, mixed, 2))


def test_a_table_no_longer_than_k_picks_every_closed_entry():
    scores = torch.zeros(2, 3, 4)
    closed = torch.tensor([[0, 1, 2], [3, 4, 4]])
    assert torch.equal(index_topk(scores, closed, closed, 4), torch.arange(4) < closed[..., None])


def test_exported_graph_calls_the_op():
    """Traced by ``torch.export`` the picks are the custom op (data-dependent grouping is no
    graph), and the exported program picks as the kernel does on other data."""

    class Pick(torch.nn.Module):
        def forward(self, scores, pos):
            closed = torch.div(pos + 1, 4, rounding_mode="floor")
            return index_topk(scores * 2, closed, closed, 2)

    g = torch.Generator().manual_seed(3)
    args = (_tied_scores((3, 2, 16), g), torch.tensor([[9, 10], [30, 31], [3, 4]]))
    program = torch.export.export(Pick(), args)
    assert "warmserve.index_topk" in str(program.graph)
    other = (_tied_scores((3, 2, 16), g), torch.tensor([[40, 41], [20, 21], [55, 56]]))
    closed = torch.div(other[1] + 1, 4, rounding_mode="floor")
    assert torch.equal(program.module()(*other), _brute(other[0] * 2, closed, closed, 2))
