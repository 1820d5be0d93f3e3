"""Building blocks shared by the families' forward passes: RMSNorm, rotate-half RoPE, the paged
KV write, paged attention, and the linear layer / embedding lookup over float or weight-only
quantized matrices. Plain PyTorch with no Python control flow on tensor values, so a forward
built from them can be exported and compiled as is.

Quantized weights (:class:`Int4Weight`, :class:`Int8Weight`) are built once at load from the
sidecar's parts (:mod:`model_families.quant`) into what PyTorch's CPU weight-only kernels take:

- int4: ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` with
  ``packed`` from ``_convert_weight_to_int4pack_for_cpu`` (an opaque, CPU-ISA-specific layout of
  the codes, ``uint8 [N, K/2]``) and ``scales_and_zeros`` ``[K/32, N, 2]``; it computes
  ``x @ ((q - 8) * scale + zero).T``;
- int8: ``torch.ops.aten._weight_int8pack_mm(x, q [N, K], scales [N])`` = ``x @ (q * scale).T``.

Both kernels take ``scales`` in the activation dtype, so in bf16 compute the float32 scales and
zeros are rounded to bf16 at load. Their vectorised CPU paths are the bf16 ones (measured on
this AVX512-BF16 host, SmolLM2 shapes: int4 is ~5x faster than a float32 matmul at batch 1 in
bf16, but the float32-activation paths are PyTorch's scalar reference code, several times
*slower* than a float32 matmul); float32 compute over quantized weights is for fidelity checks.
Other devices (CUDA, NPU) get the dequantized matrix in the compute dtype
(:func:`quantized_weight`): correct, without the memory saving.

Paged layout (see :mod:`model_families.family`): a pool ``[layers, num_blocks, block_size, ...]``;
slot ``s`` = ``block_id * block_size + offset``; block 0 is the scratch block.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model_families import kv_write as _kv_write  # noqa: F401  (registers torch.ops.warmserve.kv_write_)
from model_families import quant
from services.errors import InvalidArgument


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


# -- weight-only quantized matrices ------------------------------------------------------------


class Int4Matrix(NamedTuple):
    """One int4 matrix ready for the kernel: ``packed`` uint8 ``[N, K/2]`` (CPU int4pack layout),
    ``scales_and_zeros`` ``[K/32, N, 2]`` in the compute dtype."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor


class Int8Matrix(NamedTuple):
    """One int8 matrix: ``weight`` int8 ``[N, K]``, ``scales`` ``[N]`` in the compute dtype."""

    weight: torch.Tensor
    scales: torch.Tensor


class QuantizedWeight(nn.Module):
    """Weight-only quantized matrices, stacked (``[L, N, K]``, index a layer with ``w[i]``) or
    not (``[N, K]``, :meth:`matrix`). Their tensors are non-persistent buffers, so a model that
    registers the weight as a submodule hands them to an exported program as constants.
    ``format`` is ``"int4"`` or ``"int8"``."""

    format: str

    def tensors(self) -> dict[str, torch.Tensor]:
        """Buffer name -> tensor."""
        return dict(self.named_buffers())

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (of the scales)."""
        return self.float_part.dtype

    @property
    def float_part(self) -> torch.Tensor:
        raise NotImplementedError

    def converted(self, dtype: torch.dtype, device: torch.device) -> QuantizedWeight:
        """A copy whose float part is in ``dtype`` (``self`` when it already is). The packed
        codes are CPU kernel data: another device raises ``InvalidArgument``."""
        if torch.device(device).type != "cpu":
            raise InvalidArgument(f"{self.format} weights are packed for the CPU kernels and cannot move to "
                                  f"{device}; load the sidecar on that device instead")
        if self.dtype == dtype:
            return self
        parts = self.tensors()
        return type(self)(**{n: (t.to(dtype) if t.is_floating_point() else t) for n, t in parts.items()})


class Int4Weight(QuantizedWeight):
    """int4, group 32: ``packed`` uint8 ``[..., N, K/2]`` (CPU int4pack layout per matrix),
    ``scales_and_zeros`` ``[..., K/32, N, 2]`` in the compute dtype."""

    format = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    @property
    def float_part(self) -> torch.Tensor:
        return self.scales_and_zeros

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Int4Weight:
        """Convert the sidecar parts (:mod:`model_families.quant`: ``qweight`` uint8
        ``[..., N, K/2]``, ``scales``/``zeros`` ``[..., N, K/32]``) for the CPU kernel: the codes
        go through ``_convert_weight_to_int4pack_for_cpu`` one matrix at a time."""
        qweight = parts["qweight"]
        lead, (n, half_k) = qweight.shape[:-2], qweight.shape[-2:]
        flat = qweight.reshape(-1, n, half_k)
        packed = torch.empty_like(flat)
        for i in range(flat.shape[0]):
            codes = quant.unpack_nibbles(flat[i]).to(torch.int32)
            packed[i] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.stack((parts["scales"], parts["zeros"]), dim=-1).transpose(-3, -2)  # [..., K/32, N, 2]
        return cls(packed.reshape(*lead, n, half_k), sz.to(dtype).contiguous())

    def __getitem__(self, i) -> Int4Matrix:
        return Int4Matrix(self.packed[i], self.scales_and_zeros[i])

    def matrix(self) -> Int4Matrix:
        """The matrix of an unstacked weight."""
        return Int4Matrix(self.packed, self.scales_and_zeros)


class Int8Weight(QuantizedWeight):
    """int8, one scale per output row: ``weight`` int8 ``[..., N, K]``, ``scales`` ``[..., N]``
    in the compute dtype."""

    format = "int8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    @property
    def float_part(self) -> torch.Tensor:
        return self.scales

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Int8Weight:
        """The sidecar parts (``qweight`` int8, ``scales``) as they are; scales in ``dtype``."""
        return cls(parts["qweight"], parts["scales"].to(dtype))

    def __getitem__(self, i) -> Int8Matrix:
        return Int8Matrix(self.weight[i], self.scales[i])

    def matrix(self) -> Int8Matrix:
        """The matrix of an unstacked weight."""
        return Int8Matrix(self.weight, self.scales)


def quantized_weight(parts: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device) -> QuantizedWeight | torch.Tensor:
    """The runner's weight for one quantized sidecar matrix (``parts`` as stored, see
    :mod:`model_families.quant`): on the CPU an :class:`Int4Weight` / :class:`Int8Weight`; on any
    other device the dequantized matrix in ``dtype`` (a plain tensor)."""
    if torch.device(device).type != "cpu":
        return quant.dequantize(parts).to(device=device, dtype=dtype)
    if quant.format_of(parts) == "int4":
        return Int4Weight.from_parts(parts, dtype)
    return Int8Weight.from_parts(parts, dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Matrix | Int8Matrix | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight.T (+ bias)`` for a float ``[N, K]`` matrix (``F.linear``), one
    quantized matrix (a layer of a stacked :class:`QuantizedWeight`: ``w[i]``) or an unstacked
    :class:`QuantizedWeight`. Output in ``x``'s dtype."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        weight = weight.matrix()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if isinstance(weight, Int4Matrix):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, quant.INT4_GROUP, weight.scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, weight.weight, weight.scales)
    y = y.reshape(*lead, y.shape[-1])
    return y if bias is None else y + bias


def embedding(ids: torch.Tensor, weight: torch.Tensor | Int8Weight) -> torch.Tensor:
    """Rows ``ids`` of a float ``[V, H]`` table, or of an int8 one dequantized (``q * scale``,
    in the scales' dtype)."""
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    if not isinstance(weight, Int8Weight):
        raise InvalidArgument(f"an embedding table cannot be {weight.format}")
    return weight.weight[ids].to(weight.scales.dtype) * weight.scales[ids].unsqueeze(-1)
