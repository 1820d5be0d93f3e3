"""Paged attention over a layer's K/V block pools: prefill gathers the rows' blocks and runs
masked SDPA, decode runs fused float32 reductions over the blocks in place. Pool layout:
``[num_blocks, block_size, nkv, hd]`` per layer, slot ``block_id * block_size + offset``, block 0
the scratch block (``docs/architecture.md`` §7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_families import custom_ops as _custom_ops  # noqa: F401  (registers warmserve::decode_attention's shape)
from model_families import invariant, native


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries over each sequence's paged K/V.

    ``q`` [B, S, nh, hd]; ``k_pool``/``v_pool`` [num_blocks, block_size, nkv, hd] (one layer);
    ``block_tables`` [B, nb] int64 block ids (unused entries point at the scratch block);
    ``positions`` [B, S] int64 absolute position of each query token; ``seq_lens`` [B] int64
    tokens in the context including this step's. Key ``j`` (position in the block-table row) is
    visible to a query at position ``p`` iff ``j <= p`` and ``j < seq_len``. GQA: ``nh`` is a
    multiple of ``nkv``; scale ``1/sqrt(hd)``. Returns [B, S, nh, hd] in ``q``'s dtype.

    A step may pass its own ``k_new``/``v_new`` [B, S, nkv, hd]: they stand in for the pools'
    entries at the step's positions, which the caller writes after the step (the step thus only
    reads the pools). For prefill, row ``b``'s chunk is ``positions[b, 0]`` .. ``seq_lens[b] - 1``
    (a row's real tokens first, padding after them): the pools' keys before the chunk are visible,
    then the chunk's own keys causally. Decode runs warmserve's C++ kernel
    ``warmserve::decode_attention`` (``model_families/kernels/decode_attention.cpp``: the same
    computation, reading only each row's visible keys) where
    :func:`~model_families.native.decode_attention_enabled`, eager and traced alike, else
    :func:`decode_attention`; prefill (``S > 1``)
    gathers the rows' blocks and runs masked SDPA. In a batch-invariant step
    both run :func:`model_families.invariant.paged_attention` instead.
    """
    if invariant.active_policy() is not None:
        return invariant.paged_attention(q, k_pool, v_pool, block_tables, positions, seq_lens, k_new, v_new)
    if q.shape[1] == 1:
        if _native_decode(q, k_pool):
            return torch.ops.warmserve.decode_attention(q, k_pool, v_pool, block_tables, positions, seq_lens,
                                                        k_new, v_new)
        return decode_attention(q, k_pool, v_pool, block_tables, positions, seq_lens, k_new, v_new)
    if (k_new is None) != (v_new is None):
        raise ValueError("give the step's own K and V together (k_new and v_new), or neither")
    B, nb = block_tables.shape
    bs, nkv, hd = k_pool.shape[1:]
    k = k_pool[block_tables].reshape(B, nb * bs, nkv, hd)
    v = v_pool[block_tables].reshape(B, nb * bs, nkv, hd)
    key_pos = torch.arange(nb * bs, device=q.device)
    if k_new is None:
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    else:  # the pools' keys before the chunk, then the chunk's own (causal, not past the row's length)
        S = q.shape[1]
        start = positions[:, :1]  # [B, 1]: a row's chunk starts at its first token's position
        new = torch.arange(S, device=q.device)
        past = (key_pos[None, :] < start)[:, None, :].expand(B, S, nb * bs)
        own = (new[None, None, :] <= new[None, :, None]) & (new[None, None, :] < (seq_lens[:, None] - start)[:, :, None])
        mask = torch.cat([past, own], dim=2)
        k, v = torch.cat([k, k_new], dim=1), torch.cat([v, v_new], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask.unsqueeze(1), enable_gqa=True)
    return out.transpose(1, 2)


def _native_decode(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether this decode step runs ``warmserve::decode_attention`` (its limits: float32 or bf16
    pools of ``q``'s dtype, a head dim that is a multiple of 16 up to 256, at most 16 query heads
    per KV head). Never while Dynamo traces (``--compile inductor``: the torch ops are what it
    compiles; the kernels' build and load are not traceable)."""
    if torch.compiler.is_dynamo_compiling():
        return False
    hd, nh, nkv = q.shape[-1], q.shape[2], k_pool.shape[2]
    return (q.dtype in (torch.float32, torch.bfloat16) and k_pool.dtype == q.dtype and hd % 16 == 0 and hd <= 256
            and nh % nkv == 0 and nh // nkv <= 16 and native.decode_attention_enabled())


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     positions: torch.Tensor, seq_lens: torch.Tensor, k_new: torch.Tensor | None = None,
                     v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention of one query token per row (arguments as :func:`paged_attention`, ``S``
    = 1), written as broadcast products and sums in float32 rather than SDPA:
    ``s[b, t, g] = q[b, g] . k[b, t] / sqrt(hd)``, masked, softmax over ``t``,
    ``out[b, g] = sum_t p[b, t, g] v[b, t]``, with ``k[b, t]`` = ``k_pool[block_tables[b, t //
    block_size], t % block_size]`` (``k_new[b]`` at ``t == positions[b]`` when given; ``k_new``
    and ``v_new`` come together, else ``ValueError``).

    Compiled, Inductor fuses the block-table indexing into the two reductions, so the blocks are
    read in place (no gathered copy of the rows' K/V) and no ``[B*nh, 1, T]`` batched matmul is
    dispatched per layer (gain: ``docs/benchmarks.md``).
    """
    B, nb = block_tables.shape
    bs, nkv, hd = k_pool.shape[1:]
    nh = q.shape[2]
    g, T = nh // nkv, nb * bs
    k = k_pool[block_tables].view(B, T, nkv, 1, hd)
    v = v_pool[block_tables].view(B, T, nkv, 1, hd)
    key_pos = torch.arange(T, device=q.device)
    if (k_new is None) != (v_new is None):
        raise ValueError("give the step's own K and V together (k_new and v_new), or neither")
    if k_new is not None:
        own = (key_pos[None, :] == positions)[:, :, None, None, None]  # [B, T, 1, 1, 1]
        k = torch.where(own, k_new.view(B, 1, nkv, 1, hd), k)
        v = torch.where(own, v_new.view(B, 1, nkv, 1, hd), v)
    qf = q.view(B, 1, nkv, g, hd).float() * hd ** -0.5
    scores = (qf * k.float()).sum(-1)  # [B, T, nkv, g]
    visible = (key_pos[None, :] <= positions) & (key_pos[None, :] < seq_lens[:, None])
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * v.float()).sum(1)  # [B, nkv, g, hd]
    return out.view(B, 1, nh, hd).to(q.dtype)
