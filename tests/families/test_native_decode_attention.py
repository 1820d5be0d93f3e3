"""warmserve's decode attention kernel (``warmserve::decode_attention``,
model_families/kernels/decode_attention.cpp) against the torch-ops implementation it replaces
(model_families/attention.decode_attention) and a float64 softmax written from the definition:
rows of mixed lengths over shuffled blocks, GQA groups, the step's own K/V, float32 and bf16,
empty rows, bad input, and the dispatch in paged_attention."""

from __future__ import annotations

import math

import pytest
import torch

from model_families import native
from model_families.attention import decode_attention, paged_attention

pytestmark = pytest.mark.skipif(not native.decode_attention_enabled(),
                                reason="this host cannot build or run the AVX-512 kernel")


def _case(dtype, lens, nh=6, nkv=2, hd=32, bs=4, seed=0, behind=0):
    """Rows of ``lens`` keys over shuffled blocks; each row's query at position ``len - 1 - behind``
    (``behind`` > 0: the step's own K/V stand in before the row's last key, and keys past the
    position are hidden although within ``seq_lens``)."""
    g = torch.Generator().manual_seed(seed)
    B, blocks = len(lens), 64
    nb = max(-(-n // bs) for n in lens) + 1  # one spare block column: the padded width
    k_pool = torch.randn(blocks, bs, nkv, hd, generator=g).to(dtype)
    v_pool = torch.randn(blocks, bs, nkv, hd, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:nb] + 1 for _ in range(B)])
    seq_lens = torch.tensor(lens)
    positions = (seq_lens - 1 - behind).clamp(min=0)[:, None]
    q = torch.randn(B, 1, nh, hd, generator=g).to(dtype)
    k_new = torch.randn(B, 1, nkv, hd, generator=g).to(dtype)
    v_new = torch.randn(B, 1, nkv, hd, generator=g).to(dtype)
    return q, k_pool, v_pool, tables, positions, seq_lens, k_new, v_new


def _definition(q, k_pool, v_pool, tables, positions, seq_lens, k_new, v_new):
    """float64, one row and head at a time: softmax(q . k_t / sqrt(hd)) over the visible keys."""
    B, _, nh, hd = q.shape
    bs, nkv = k_pool.shape[1], k_pool.shape[2]
    out = torch.zeros(B, 1, nh, hd, dtype=torch.float64)
    for b in range(B):
        n = min(int(positions[b, 0]) + 1, int(seq_lens[b]))
        for h in range(nh):
            kvh = h // (nh // nkv)
            ks, vs = [], []
            for t in range(n):
                slot = (int(tables[b, t // bs]), t % bs)
                own = k_new is not None and t == int(positions[b, 0])
                ks.append(k_new[b, 0, kvh] if own else k_pool[slot[0], slot[1], kvh])
                vs.append(v_new[b, 0, kvh] if own else v_pool[slot[0], slot[1], kvh])
            if not ks:
                continue
            k, v = torch.stack(ks).double(), torch.stack(vs).double()
            p = torch.softmax(k @ q[b, 0, h].double() / math.sqrt(hd), dim=0)
            out[b, 0, h] = p @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fresh", [True, False])
def test_kernel_is_the_softmax_over_the_visible_keys(dtype, fresh):
    """Rows of 1 to 37 keys (tails of blocks and of the kernel's 16-wide softmax), over shuffled
    blocks, 3 query heads per KV head: equal to the float64 definition to the output dtype's
    rounding, and to the torch-ops implementation."""
    q, kp, vp, tables, pos, lens, kn, vn = _case(dtype, [1, 4, 5, 16, 17, 33, 37])
    kn, vn = (kn, vn) if fresh else (None, None)
    got = torch.ops.warmserve.decode_attention(q, kp, vp, tables, pos, lens, kn, vn)
    assert got.shape == q.shape and got.dtype == dtype
    want = _definition(q, kp, vp, tables, pos, lens, kn, vn)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    ref = decode_attention(q, kp, vp, tables, pos, lens, kn, vn)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=0)


def test_head_dim_64_and_a_longer_row_than_the_padded_batch_mate():
    """SmolLM2's shape (9 heads over 3, hd 64, block 16): a row reads its own keys only, so a
    short row beside a long one gives the short row alone's result, bitwise."""
    q, kp, vp, tables, pos, lens, kn, vn = _case(torch.bfloat16, [3, 200], nh=9, nkv=3, hd=64, bs=16, seed=1)
    both = torch.ops.warmserve.decode_attention(q, kp, vp, tables, pos, lens, kn, vn)
    alone = torch.ops.warmserve.decode_attention(q[:1], kp, vp, tables[:1, :1], pos[:1], lens[:1], kn[:1], vn[:1])
    assert torch.equal(both[:1], alone)
    want = _definition(q, kp, vp, tables, pos, lens, kn, vn)
    assert (both.double() - want).abs().max().item() <= 2 ** -7 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_position_not_the_length_bounds_the_keys_and_places_the_own_kv(dtype):
    """A query at position len - 3: keys past it are hidden although within seq_lens, and the
    step's own K/V replace the pool's at that position, not at the row's last key."""
    q, kp, vp, tables, pos, lens, kn, vn = _case(dtype, [3, 9, 20], behind=2, seed=4)
    got = torch.ops.warmserve.decode_attention(q, kp, vp, tables, pos, lens, kn, vn)
    want = _definition(q, kp, vp, tables, pos, lens, kn, vn)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def test_an_out_of_range_block_is_refused_and_nan_stays_nan():
    q, kp, vp, tables, pos, lens, kn, vn = _case(torch.float32, [5, 9], seed=5)
    for bad in (-1, kp.shape[0], 1 << 40):
        t = tables.clone()
        t[1, 1] = bad  # a block the row's keys use
        with pytest.raises(RuntimeError, match=r"block_tables\[1, 1\] = .* is not a block of the pools"):
            torch.ops.warmserve.decode_attention(q, kp, vp, t, pos, lens, kn, vn)
    t = tables.clone()
    t[0, -1] = 1 << 40  # past the row's keys: never read
    torch.ops.warmserve.decode_attention(q, kp, vp, t, pos, lens, kn, vn)
    q2 = q.clone()
    q2[1, 0, 0, 0] = float("nan")
    got = torch.ops.warmserve.decode_attention(q2, kp, vp, tables, pos, lens, kn, vn)
    ref = decode_attention(q2, kp, vp, tables, pos, lens, kn, vn)
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got[1, 0, 0].isnan().all())  # head 0 of row 1 only
    assert not bool(got[1, 0, 1:].isnan().any()) and not bool(got[0].isnan().any())


@pytest.mark.parametrize("nh,nkv,hd,bs", [(4, 2, 48, 16), (16, 1, 128, 8), (2, 2, 256, 16)])
def test_bf16_head_dims_and_groups(nh, nkv, hd, bs):
    """bf16 pools with hd 48, 128 and 256, up to 16 query heads per KV head (the kernel's limits),
    blocks of 8 and 16: equal to the float64 definition to bf16's rounding, rows of 1 to 47 keys;
    a NaN in one query head makes that head's output NaN and nothing else."""
    q, kp, vp, tables, pos, lens, kn, vn = _case(torch.bfloat16, [1, 15, 16, 17, 31, 47], nh=nh, nkv=nkv, hd=hd,
                                                  bs=bs, seed=hd)
    got = torch.ops.warmserve.decode_attention(q, kp, vp, tables, pos, lens, kn, vn)
    want = _definition(q, kp, vp, tables, pos, lens, kn, vn)
    assert (got.double() - want).abs().max().item() <= 2 ** -7 * max(1.0, want.abs().max().item())
    q2 = q.clone()
    q2[2, 0, nh - 1, 3] = float("nan")
    got = torch.ops.warmserve.decode_attention(q2, kp, vp, tables, pos, lens, kn, vn)
    assert bool(got[2, 0, nh - 1].isnan().all()) and int(got.isnan().sum()) == hd


def test_shapes_past_the_kernels_limits_use_the_torch_ops():
    """17 query heads per KV head is past the kernel's 16: paged_attention falls back (no error)."""
    q, kp, vp, tables, pos, lens, kn, vn = _case(torch.float32, [6], nh=17, nkv=1, seed=6)
    got = paged_attention(q, kp, vp, tables, pos, lens, kn, vn)
    torch.testing.assert_close(got, decode_attention(q, kp, vp, tables, pos, lens, kn, vn))


def test_a_row_without_visible_keys_is_zeros_and_bad_input_is_refused():
    q, kp, vp, tables, pos, lens, kn, vn = _case(torch.float32, [0, 5])
    got = torch.ops.warmserve.decode_attention(q, kp, vp, tables, pos, lens, kn, vn)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and got[1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="k_new and v_new"):
        torch.ops.warmserve.decode_attention(q, kp, vp, tables, pos, lens, kn, None)
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.warmserve.decode_attention(q.bfloat16(), kp, vp, tables, pos, lens)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.warmserve.decode_attention(q[..., :24], kp[..., :24], vp[..., :24], tables, pos, lens)
    with pytest.raises(RuntimeError, match="block_tables int64"):
        torch.ops.warmserve.decode_attention(q, kp, vp, tables.int(), pos, lens)


def test_paged_attention_dispatches_decode_to_the_kernel(monkeypatch):
    """A one-token step goes to the kernel (and to the torch ops with the kernels switched off by
    the environment); both give the same result to float32 rounding."""
    q, kp, vp, tables, pos, lens, kn, vn = _case(torch.float32, [7, 12], seed=2)
    calls = []
    real = torch.ops.warmserve.decode_attention

    class Spy:
        def __call__(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(torch.ops.warmserve, "decode_attention", Spy())
    got = paged_attention(q, kp, vp, tables, pos, lens, kn, vn)
    assert calls == [q.shape]
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    off = paged_attention(q, kp, vp, tables, pos, lens, kn, vn)
    assert calls == [q.shape]
    torch.testing.assert_close(got, off, atol=1e-5, rtol=0)
