"""The shared forward building blocks against first principles: paged decode attention against
dense softmax attention over each row's keys assembled by hand, the deferred K/V write against
per-slot assignment, and the oneDNN float matmul against a float64 matmul."""

from __future__ import annotations

import pytest
import torch

from model_families import prepack as prepack_module
from model_families.attention import decode_attention, paged_attention
from model_families.kv_write import write_kv_rows
from model_families.linear import float_linear
from model_families.prepack import PackedMatrices, _matrix_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NH, NKV, HD, BS, NUM_BLOCKS = 6, 2, 8, 4, 12


def _pools(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, BS, NKV, HD, generator=g).to(dtype)
    v = torch.randn(NUM_BLOCKS, BS, NKV, HD, generator=g).to(dtype)
    return k, v


def _reference(q, keys, values):
    """Softmax attention of one query [nh, hd] over keys/values [T, nkv, hd], in float64."""
    group = NH // NKV
    out = torch.empty(NH, HD, dtype=torch.float64)
    for h in range(NH):
        k = keys[:, h // group].double()
        v = values[:, h // group].double()
        p = torch.softmax(k @ q[h].double() / HD ** 0.5, dim=0)
        out[h] = p @ v
    return out


def test_decode_attention_matches_dense_attention_over_the_rows_blocks_with_own_kv_substituted():
    k_pool, v_pool = _pools()
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 9, 4, 11]])
    seq_lens = torch.tensor([10, 3, 16])
    positions = (seq_lens - 1)[:, None]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 1, NH, HD, generator=g)
    k_new = torch.randn(3, 1, NKV, HD, generator=g)
    v_new = torch.randn(3, 1, NKV, HD, generator=g)

    got = decode_attention(q, k_pool, v_pool, tables, positions, seq_lens, k_new, v_new)
    via_dispatch = paged_attention(q, k_pool, v_pool, tables, positions, seq_lens, k_new, v_new)
    assert got.shape == (3, 1, NH, HD) and torch.equal(got, via_dispatch)
    for b in range(3):
        n = int(seq_lens[b])
        slots = [(int(tables[b, t // BS]), t % BS) for t in range(n)]
        keys = torch.stack([k_pool[blk, off] for blk, off in slots])
        values = torch.stack([v_pool[blk, off] for blk, off in slots])
        keys[n - 1], values[n - 1] = k_new[b, 0], v_new[b, 0]  # the step's own K/V, not the pool's
        torch.testing.assert_close(got[b, 0].double(), _reference(q[b, 0], keys, values), atol=1e-5, rtol=1e-5)


def test_decode_attention_without_own_kv_reads_the_pool_and_ignores_keys_past_seq_len():
    k_pool, v_pool = _pools(seed=2)
    tables = torch.tensor([[4, 6]])
    q = torch.randn(1, 1, NH, HD, generator=torch.Generator().manual_seed(3))
    got = decode_attention(q, k_pool, v_pool, tables, torch.tensor([[5]]), torch.tensor([6]))
    scrambled = k_pool.clone()
    scrambled[6, 2:] = 1e4  # positions 6, 7: past seq_len, must not matter
    again = decode_attention(q, scrambled, v_pool, tables, torch.tensor([[5]]), torch.tensor([6]))
    keys = torch.cat([k_pool[4], k_pool[6, :2]])
    values = torch.cat([v_pool[4], v_pool[6, :2]])
    torch.testing.assert_close(got[0, 0].double(), _reference(q[0, 0], keys, values), atol=1e-5, rtol=1e-5)
    assert torch.equal(got, again)


def test_prefill_attention_with_own_kv_matches_dense_causal_attention_over_past_and_chunk():
    """Rows: a chunk of 3 after 6 cached tokens, a 5-token prompt, a 2-token chunk after 9
    cached ones padded to 5, and a padding row (positions 0, length 1); each real query sees the
    pool's keys before its chunk, then the chunk's own keys up to itself (never the pool's
    entries at the chunk's slots, which hold stale values here)."""
    k_pool, v_pool = _pools(seed=4)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [2, 9, 4, 11], [0, 0, 0, 0]])
    starts, counts, S = [6, 0, 9, 0], [3, 5, 2, 1], 5
    positions = torch.zeros(4, S, dtype=torch.int64)
    for b, (st, n) in enumerate(zip(starts, counts, strict=True)):
        positions[b, :n] = torch.arange(st, st + n)
    seq_lens = torch.tensor([st + n for st, n in zip(starts, counts, strict=True)])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, S, NH, HD, generator=g)
    k_new, v_new = torch.randn(4, S, NKV, HD, generator=g), torch.randn(4, S, NKV, HD, generator=g)

    got = paged_attention(q, k_pool, v_pool, tables, positions, seq_lens, k_new, v_new)
    assert got.shape == (4, S, NH, HD) and bool(torch.isfinite(got).all())
    for b, (st, n) in enumerate(zip(starts, counts, strict=True)):
        past = [(int(tables[b, t // BS]), t % BS) for t in range(st)]
        for s in range(n):
            keys = torch.cat([torch.stack([k_pool[blk, off] for blk, off in past]).reshape(-1, NKV, HD)
                              if past else torch.empty(0, NKV, HD), k_new[b, :s + 1]])
            values = torch.cat([torch.stack([v_pool[blk, off] for blk, off in past]).reshape(-1, NKV, HD)
                                if past else torch.empty(0, NKV, HD), v_new[b, :s + 1]])
            torch.testing.assert_close(got[b, s].double(), _reference(q[b, s], keys, values), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="together"):
        paged_attention(q, k_pool, v_pool, tables, positions, seq_lens, k_new=k_new)


def test_write_kv_rows_puts_each_layers_row_at_its_slot_and_nothing_else():
    layers = 3
    cache = torch.zeros(layers, NUM_BLOCKS, BS, NKV, HD)
    slots = torch.tensor([7, 0, 21])  # block 1 row 3, the scratch slot, block 5 row 1
    rows = torch.randn(layers, 3, NKV, HD, generator=torch.Generator().manual_seed(4))
    write_kv_rows(cache, slots, rows)
    expected = torch.zeros_like(cache)
    for layer in range(layers):
        for r, s in enumerate(slots.tolist()):
            expected[layer, s // BS, s % BS] = rows[layer, r]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_float_linear_matches_a_float64_matmul(dtype, atol):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 40, generator=g).to(dtype)
    w = torch.randn(24, 40, generator=g).to(dtype)
    bias = torch.randn(24, generator=g).to(dtype)
    got = float_linear(x, w, bias)
    assert got.shape == (2, 3, 24) and got.dtype == dtype
    want = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0.02)
    torch.testing.assert_close(float_linear(x[0, 0], w).double(), want[0, 0] - bias.double(), atol=atol, rtol=0.02)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.3)])
def test_prepacked_matrices_give_the_float64_matmul_and_close_restores_the_plain_path(dtype, atol):
    g = torch.Generator().manual_seed(6)
    stacked = torch.randn(3, 24, 40, generator=g).to(dtype)  # [L, N, K] like a sidecar tensor
    x = torch.randn(5, 40, generator=g).to(dtype)
    bias = torch.randn(24, generator=g).to(dtype)
    quantized_like = torch.zeros(24, 20, dtype=torch.uint8)  # not a float matrix: skipped
    packed = PackedMatrices([stacked[i] for i in range(3)] + [quantized_like, stacked[0]], batch_hint=8)
    try:
        assert len(packed) == 3  # the repeated matrix is packed once
        assert packed.nbytes == 3 * 24 * 40 * stacked.element_size()
        for i in range(3):
            want = x.double() @ stacked[i].double().T + bias.double()
            torch.testing.assert_close(float_linear(x, stacked[i], bias).double(), want, atol=atol, rtol=0.02)
    finally:
        packed.close()
    packed.close()  # idempotent
    assert len(packed) == 0
    torch.testing.assert_close(float_linear(x, stacked[1]).double(), x.double() @ stacked[1].double().T,
                               atol=atol, rtol=0.02)


def test_an_exported_linear_reads_whatever_copy_is_registered_when_it_runs():
    """The exported graph calls ``warmserve::linear``, which looks the copy up at run time: a
    copy registered after export (here of 2 W under W's key) is what the program multiplies by."""

    class Lin(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.register_buffer("w", w, persistent=False)

        def forward(self, x):
            return float_linear(x, self.w[1])

    g = torch.Generator().manual_seed(7)
    stacked = torch.randn(2, 16, 32, generator=g)
    x = torch.randn(3, 32, generator=g)
    ep = torch.export.export(Lin(stacked), (x,), strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "warmserve.linear.default" in targets
    program = ep.module()
    torch.testing.assert_close(program(x), x @ stacked[1].T, atol=1e-4, rtol=1e-4)
    doubled = PackedMatrices([stacked[1] * 2], batch_hint=4)  # a copy of 2 W ...
    try:
        key = _matrix_key(stacked[1])
        prepack_module._PACKED[key] = prepack_module._PACKED.pop(_matrix_key(doubled._plain[0]))  # ... filed as W's
        torch.testing.assert_close(program(x), 2 * (x @ stacked[1].T), atol=1e-4, rtol=1e-4)
    finally:
        prepack_module._PACKED.pop(key, None)
    torch.testing.assert_close(program(x), x @ stacked[1].T, atol=1e-4, rtol=1e-4)
