"""Building blocks shared by the families' forward passes: RMSNorm, rotate-half RoPE, the paged
KV write and paged attention. Plain PyTorch with no Python control flow on tensor values, so a
forward built from them can be exported and compiled as is.

Paged layout (see :mod:`model_families.family`): a pool ``[layers, num_blocks, block_size, ...]``;
slot ``s`` = ``block_id * block_size + offset``; block 0 is the scratch block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_families import kv_write as _kv_write  # noqa: F401  (registers torch.ops.warmserve.kv_write_)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32 (as transformers' ``LlamaRMSNorm``):
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, n, hd] by per-token ``cos``/``sin`` [B, S, hd] (HF ``rotate_half``
    convention: first half / second half of each head)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def write_kv(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[layer]`` slots ``slots`` [T] (int64) <- ``values`` [T, *row_shape], in place
    (``cache`` [layers, num_blocks, block_size, *row_shape]).

    Eager: a plain ``index_copy_``. Under ``torch.compile`` / ``torch.export``: the
    ``warmserve::kv_write_`` custom op (:mod:`model_families.kv_write`), which compilers keep as
    one in-place call instead of copying the whole pool; eagerly the op's dispatch costs more
    than the copy, so it is used only when compiling.
    """
    if torch.compiler.is_compiling():
        torch.ops.warmserve.kv_write_(cache, layer, slots, values)
    else:
        cache[layer].view(-1, *cache.shape[3:]).index_copy_(0, slots, values)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
    """Attention of queries over each sequence's paged K/V.

    ``q`` [B, S, nh, hd]; ``k_pool``/``v_pool`` [num_blocks, block_size, nkv, hd] (one layer);
    ``block_tables`` [B, nb] int64 block ids (unused entries point at the scratch block);
    ``positions`` [B, S] int64 absolute position of each query token; ``seq_lens`` [B] int64
    tokens in the context including this step's. Key ``j`` (position in the gathered row) is
    visible to a query at position ``p`` iff ``j <= p`` and ``j < seq_len``. GQA: ``nh`` is a
    multiple of ``nkv``; scale ``1/sqrt(hd)``. Returns [B, S, nh, hd].
    """
    B, nb = block_tables.shape
    bs, nkv, hd = k_pool.shape[1:]
    k = k_pool[block_tables].reshape(B, nb * bs, nkv, hd).transpose(1, 2)
    v = v_pool[block_tables].reshape(B, nb * bs, nkv, hd).transpose(1, 2)
    key_pos = torch.arange(nb * bs, device=q.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)
    return out.transpose(1, 2)
