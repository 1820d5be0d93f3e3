"""Weight-only quantized matrices as the runner holds them, built once at load from the sidecar's
parts (:mod:`model_families.quant`) by :func:`quantized_weight`; :func:`model_families.linear.linear`
runs them (``docs/quantization.md``, ``docs/architecture.md`` §7):

- bf16 compute on a CPU with AVX512-BF16: int4 as :class:`Int4TileWeight`, warmserve's own
  kernel ``warmserve::int4_mm_tiles`` (``model_families/kernels/int4_tiles.cpp``, built and loaded
  by :mod:`model_families.native`) on its tile layout (:func:`pack_int4_tiles`); with
  :attr:`Int4TileWeight.int8_activations` (``--quantized-activations int8``, AVX512-VNNI)
  ``warmserve::int4_mm_tiles_a8`` on the same tiles, each row's activations quantized to int8
  per group of 32, at every row count.
- Otherwise bf16 (or f16) compute on the CPU: PyTorch's weight-only kernels. int4 (:class:`Int4Weight`):
  ``packed`` from ``_convert_weight_to_int4pack_for_cpu`` (an opaque, CPU-ISA-specific layout of
  the codes, ``uint8 [N, K/2]``) and ``scales_and_zeros`` ``[K/32, N, 2]``; int8
  (:class:`Int8Weight`): ``q [N, K]``, ``scales [N]``. Both take the scales in the activation
  dtype, so the float32 scales and zeros are rounded to bf16 at load.
- float32 compute dequantizes each matrix right before its matmul (:class:`Int4GroupWeight`
  keeps the sidecar's parts as they are, zero-copy; int8 likewise): PyTorch's float32-activation
  paths of both kernels are scalar reference code. This keeps the memory saving and exact values
  (what the fidelity tests compare) but is slower than a float32 model; bf16 is the mode to serve in.
- Other devices (CUDA, NPU) get the dequantized matrix in the compute dtype: correct, without
  the memory saving.

Both int4 kernels' time grows linearly with the rows ``M``, while a dense bf16 matmul amortizes
the weights over them: :func:`int4_matmul` runs an int4 matrix with at least
:data:`INT4_DENSE_MIN_ROWS` rows (a prefill chunk, a verify step) as :func:`dequantize_int4pack`
into a transient dense matrix and one dense matmul, :func:`int4_tiles_matmul` from
:data:`INT4_TILES_DENSE_MIN_ROWS` rows as :func:`dequantize_int4_tiles` and one dense matmul.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
from torch import nn

from model_families import native, quant
from services.errors import InvalidArgument

#: Rows from which :func:`int4_tiles_matmul` dequantizes the matrix and runs a dense matmul (the
#: crossover of ``python bench/bounds.py --rows`` for ``warmserve::int4_mm_tiles``).
INT4_TILES_DENSE_MIN_ROWS = 1024
#: Rows from which :func:`int4_matmul` dequantizes the int4 matrix and runs a dense matmul (the
#: crossover of ``python bench/bounds.py --rows``: the int4 kernel's time grows with ``M``,
#: dequantize-then-matmul costs one pass over the matrix plus a dense matmul).
INT4_DENSE_MIN_ROWS = 96


@functools.cache
def int4pack_block_n() -> int | None:
    """Output rows per block of the CPU int4pack layout (``_convert_weight_to_int4pack_for_cpu``)
    on this host, found once per process by packing a probe and reading it back with
    :func:`_int4pack_codes`: ``64`` on AVX-512 builds, where block ``b`` of ``packed`` viewed as
    ``[K, 32]`` bytes holds row ``64 b + j`` in the low nibble of byte ``(k, j)`` and row
    ``64 b + 32 + j`` in its high one. ``None`` when no block size reads the probe back (an ISA
    whose layout differs): :func:`int4_matmul` then always runs the int4 kernel."""
    codes = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    for block in (64, 32, 16):
        if torch.equal(_int4pack_codes(packed, block).permute(1, 0).to(torch.int32), codes):
            return block
    return None


def _int4pack_codes(packed: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The codes of ``packed`` (uint8 ``[N, K/2]``, int4pack layout, ``N`` a multiple of
    ``block``) as uint8 ``[K, N]`` (transposed: the layout a dense ``x @ w`` reads), into ``out``
    when given."""
    n, k = packed.shape[0], packed.shape[1] * 2
    nb, half = n // block, block // 2
    blk = packed.reshape(nb, k, half).transpose(0, 1)  # [K, nb, half]: byte (k, j) of each block
    codes = (torch.empty((k, nb, block), dtype=torch.uint8) if out is None else out.view(k, nb, block))
    torch.bitwise_and(blk, 15, out=codes[..., :half])
    torch.bitwise_right_shift(blk, 4, out=codes[..., half:])
    return codes.view(k, n)


def dequantize_int4pack(packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor | None:
    """The dense transposed matrix ``w.T`` ``[K, N]`` in ``scales_and_zeros``' dtype of one int4
    matrix in the kernel's form (``packed`` uint8 ``[N, K/2]``, ``scales_and_zeros``
    ``[K/group_size, N, 2]``): ``w[n, k] = (q - 8) * scale + zero`` (the kernel's formula, each
    value computed in float32 and rounded once), in three passes over the matrix. ``None`` when
    this host's int4pack layout is not known (:func:`int4pack_block_n`) or ``N`` is not a
    multiple of its block."""
    block = int4pack_block_n()
    n, k = packed.shape[0], packed.shape[1] * 2
    if block is None or n % block:
        return None
    q = _int4pack_codes(packed, block).view(torch.int8).sub_(8)
    w = torch.empty((k, n), dtype=scales_and_zeros.dtype).copy_(q)
    groups = w.view(k // group_size, group_size, n)
    scales, zeros = scales_and_zeros.unbind(-1)  # [K/group_size, N] each, strided
    torch.addcmul(zeros.contiguous()[:, None], groups, scales.contiguous()[:, None], out=groups)
    return w


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                dense_from: int = INT4_DENSE_MIN_ROWS) -> torch.Tensor:
    """``x [M, K]`` (bf16 / f16) times an int4 matrix (``packed``, ``scales_and_zeros`` as
    :class:`Int4Matrix`) -> ``[M, N]`` in ``x``'s dtype: with ``M >= dense_from`` (and a known
    layout) ``x @ dequantize_int4pack(...)``, a transient ``[K, N]`` matrix and one dense matmul;
    else PyTorch's weight-only kernel ``_weight_int4pack_mm_for_cpu``. Both compute
    ``sum_k x[m, k] w[n, k]`` with ``w`` as in :func:`dequantize_int4pack`; they round differently."""
    if x.shape[0] >= dense_from:
        w = dequantize_int4pack(packed, group_size, scales_and_zeros)
        if w is not None:
            return torch.mm(x, w)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def pack_int4_tiles(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int = quant.INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile layout of ``warmserve::int4_mm_tiles`` (the kernel source's header states it) for
    the stored int4 parts (:mod:`model_families.quant`: ``qweight`` uint8 ``[..., N, K/2]``, code
    ``k`` in the low nibble of byte ``k // 2`` when ``k`` is even, else in its high nibble;
    ``scales`` / ``zeros`` ``[..., N, K/group_size]``): ``(tiles uint8 [..., N/16, K/8, 64],
    scales_zeros bf16 [..., N/16, K/group_size, 2, 16])``. Byte ``2 l + b`` of chunk ``c`` of tile
    ``t`` holds the codes of row ``16 t + l // 2`` at ``k = 8 c + 4 b + l % 2`` (low nibble) and
    ``k + 2`` (high nibble); it is built from the stored bytes ``4 c + 2 b`` and ``4 c + 2 b + 1``
    without unpacking the codes. Raises ``ValueError`` unless ``N % 16 == 0`` and ``K %
    group_size == 0`` with ``group_size % 8 == 0``."""
    *lead, n, half_k = qweight.shape
    k = 2 * half_k
    if n % 16 or group_size % 8 or k % group_size:
        raise ValueError(f"int4 tiles need N % 16 == 0 and K a multiple of a group size that is a "
                         f"multiple of 8; got N={n}, K={k}, group size {group_size}")
    pairs = qweight.reshape(*lead, n // 16, 16, k // 8, 2, 2)  # [.., t, i, c, b, p]: stored byte 4c + 2b + p
    b0, b1 = pairs[..., 0], pairs[..., 1]
    even = (b0 & 0x0F) | (b1 << 4)  # codes k = 8c + 4b and k + 2
    odd = (b0 >> 4) | (b1 & 0xF0)  # codes k = 8c + 4b + 1 and k + 3
    q = torch.stack((even, odd), dim=-1)  # [.., t, i, c, b, e]
    tiles = q.movedim(-3, -4).transpose(-1, -2).reshape(*lead, n // 16, k // 8, 64).contiguous()  # [.., t, c, i, e, b]

    def per_tile(v: torch.Tensor) -> torch.Tensor:  # [.., N, G'] -> [.., N/16, G', 16]
        return v.reshape(*lead, n // 16, 16, k // group_size).transpose(-1, -2)

    sz = torch.stack((per_tile(scales), per_tile(zeros)), dim=-2).to(torch.bfloat16).contiguous()
    return tiles, sz


def int4_tiles_codes(tiles: torch.Tensor) -> torch.Tensor:
    """The codes of one matrix in the tile layout (``tiles`` uint8 ``[N/16, K/8, 64]``) as uint8
    ``[K, N]`` (transposed: the layout a dense ``x @ w`` reads): the inverse of
    :func:`pack_int4_tiles`' code layout."""
    t, c = tiles.shape[0], tiles.shape[1]
    b = tiles.view(t, c, 16, 2, 2)  # [t, c, i, e, b]
    q = torch.stack((b & 15, b >> 4), dim=-1)  # [t, c, i, e, b, hb]
    return q.permute(1, 4, 5, 3, 0, 2).reshape(c * 8, t * 16)  # [c, b, hb, e, t, i] -> [K, N]


def dequantize_int4_tiles(tiles: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The dense transposed matrix ``w.T`` ``[K, N]`` (bf16) of one matrix in the tile layout:
    ``w[n, k] = (q - 8) * scale + zero``, the kernel's formula, each value computed in float32
    and rounded once."""
    k, n = tiles.shape[1] * 8, tiles.shape[0] * 16
    w = torch.empty((k, n), dtype=scales_zeros.dtype).copy_(int4_tiles_codes(tiles).view(torch.int8).sub_(8))
    groups = w.view(k // group_size, group_size, n)
    sz = scales_zeros.permute(1, 2, 0, 3).reshape(k // group_size, 2, n)  # [K/G, 2, N]
    torch.addcmul(sz[:, 1, None], groups, sz[:, 0, None], out=groups)
    return w


def int4_tiles_matmul(x: torch.Tensor, tiles: torch.Tensor, group_size: int, scales_zeros: torch.Tensor,
                      dense_from: int = INT4_TILES_DENSE_MIN_ROWS, int8_activations: bool = False) -> torch.Tensor:
    """``x [M, K]`` (bf16) times one matrix in the tile layout -> ``[M, N]`` bf16: with ``M >=
    dense_from`` ``x @ dequantize_int4_tiles(...)`` (a transient ``[K, N]`` matrix and one dense
    matmul), else ``warmserve::int4_mm_tiles``. Both compute ``sum_k x[m, k] w[n, k]`` with ``w``
    as in :func:`dequantize_int4_tiles`; they round differently. ``int8_activations``:
    ``warmserve::int4_mm_tiles_a8`` at every ``M`` (``x`` quantized per row and group of
    ``group_size``, a multiple of 16; the kernel source states the formula)."""
    if int8_activations:
        return torch.ops.warmserve.int4_mm_tiles_a8(x, tiles, group_size, scales_zeros)
    if x.shape[0] >= dense_from:
        return torch.mm(x, dequantize_int4_tiles(tiles, scales_zeros, group_size))
    return torch.ops.warmserve.int4_mm_tiles(x, tiles, group_size, scales_zeros)


def pack_int8_tiles(w: torch.Tensor, group_size: int = quant.INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix ``w`` ``[N, K]`` quantized to int8 with one scale per group of
    ``group_size`` (llama.cpp's Q8_0: ``q = round(w / s)`` in -127..127, ``s`` the group's
    ``max |w| / 127`` rounded up to a bf16 value, so ``q * s`` is what the kernel computes) in the
    tile layout of ``warmserve::int8_mm_tiles`` (the kernel source's header states it):
    ``(tiles uint8 [N/16, K/4, 64], scales_zeros bf16 [N/16, K/group_size, 2, 16])`` with zero
    zeros. Byte ``2 l + b`` of chunk ``c`` of tile ``t`` holds ``q + 128`` of row ``16 t + l // 2``
    at ``k = 4 c + 2 b + l % 2``. Raises ``ValueError`` unless ``N % 16 == 0`` and ``K %
    group_size == 0`` with ``group_size % 8 == 0``."""
    n, k = w.shape
    if n % 16 or group_size % 8 or k % group_size:
        raise ValueError(f"int8 tiles need N % 16 == 0 and K a multiple of a group size that is a "
                         f"multiple of 8; got N={n}, K={k}, group size {group_size}")
    tiles = torch.empty((n // 16, k // 4, 64), dtype=torch.uint8)
    sz = torch.zeros((n // 16, k // group_size, 2, 16), dtype=torch.bfloat16)
    for r in range(0, n, _PACK_ROWS):  # a block of rows at a time: float32 temporaries stay small
        rows = min(_PACK_ROWS, n - r)
        groups = w[r:r + rows].float().reshape(rows, k // group_size, group_size)
        amax = groups.abs().amax(-1)
        scale = (amax / 127).bfloat16()
        short = scale.float() * 127 < amax  # rounded down: step to the next bf16 up
        scale = torch.where(short, (scale.view(torch.int16) + 1).view(torch.bfloat16), scale)
        s = scale.float()
        q = torch.where(s[..., None] > 0, torch.round(groups / s.clamp(min=torch.finfo(torch.float32).tiny)[..., None]),
                        torch.zeros_like(groups)).clamp_(-127, 127)
        u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(rows // 16, 16, k // 4, 2, 2)  # [t, i, c, b, e]
        tiles[r // 16:(r + rows) // 16] = u.permute(0, 2, 1, 4, 3).reshape(rows // 16, k // 4, 64)  # [t, c, i, e, b]
        sz[r // 16:(r + rows) // 16, :, 0] = scale.reshape(rows // 16, 16, k // group_size).transpose(1, 2)
    return tiles, sz


#: Rows packed at a time by :func:`pack_int8_tiles` (a multiple of 16).
_PACK_ROWS = 1024


class Int4Tiles(NamedTuple):
    """One int4 matrix in the tile layout of ``warmserve::int4_mm_tiles``: ``tiles`` uint8
    ``[N/16, K/8, 64]``, ``scales_zeros`` bf16 ``[N/16, K/32, 2, 16]`` (:func:`pack_int4_tiles`);
    ``int8_activations``: multiplied by int8 activations (:func:`int4_tiles_matmul`)."""

    tiles: torch.Tensor
    scales_zeros: torch.Tensor
    int8_activations: bool = False


class Int4Matrix(NamedTuple):
    """One int4 matrix ready for the kernel: ``packed`` uint8 ``[N, K/2]`` (CPU int4pack layout),
    ``scales_and_zeros`` ``[K/32, N, 2]`` in the compute dtype (bf16 / f16)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor


class Int4Groups(NamedTuple):
    """One int4 matrix as stored (:mod:`model_families.quant`): ``qweight`` uint8 ``[N, K/2]``
    (two codes a byte), ``scales`` / ``zeros`` float32 ``[N, K/32]``; float32 compute
    dequantizes it right before its matmul."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


class Int8Matrix(NamedTuple):
    """One int8 matrix: ``weight`` int8 ``[N, K]``, ``scales`` ``[N]`` in the compute dtype
    (float32 compute dequantizes it right before its matmul)."""

    weight: torch.Tensor
    scales: torch.Tensor


class QuantizedWeight(nn.Module, ABC):
    """Weight-only quantized matrices, stacked (``[L, N, K]``, index a layer with ``w[i]``) or
    not (``[N, K]``, :meth:`matrix`). Their tensors are non-persistent buffers, so a model that
    registers the weight as a submodule hands them to an exported program as constants.
    ``format`` is ``"int4"`` or ``"int8"``; ``dtype`` the compute dtype it serves."""

    format: str

    def tensors(self) -> dict[str, torch.Tensor]:
        """Buffer name -> tensor."""
        return dict(self.named_buffers())

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The compute dtype this weight serves."""

    def layer_matrix(self, *parts: torch.Tensor):
        """The matrix ``w[i]`` is, built from layer ``i``'s slices of the stacked :meth:`tensors`
        (in their order): what a loop body that is handed the stacked parts runs."""
        return type(self[0])(*parts)

    def converted(self, dtype: torch.dtype, device: torch.device) -> QuantizedWeight:
        """This weight for compute dtype ``dtype`` (``self`` when it already is). The codes are
        CPU data: another device raises ``InvalidArgument``."""
        if torch.device(device).type != "cpu":
            raise InvalidArgument(f"{self.format} weights are laid out for the CPU kernels and cannot move to "
                                  f"{device}; load the sidecar on that device instead")
        return self if self.dtype == dtype else self._converted(dtype)

    @abstractmethod
    def _converted(self, dtype: torch.dtype) -> QuantizedWeight:
        """A copy laid out for compute dtype ``dtype`` (CPU)."""


class Int4Weight(QuantizedWeight):
    """int4, group 32, for bf16/f16 compute: ``packed`` uint8 ``[..., N, K/2]`` (the CPU
    int4pack layout, per matrix), ``scales_and_zeros`` ``[..., K/32, N, 2]`` in the compute
    dtype."""

    format = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Int4Weight:
        """Convert the sidecar parts (``qweight`` uint8 ``[..., N, K/2]``, ``scales``/``zeros``
        ``[..., N, K/32]``) for the kernel: the codes go through
        ``_convert_weight_to_int4pack_for_cpu`` one matrix at a time."""
        qweight = parts["qweight"]
        lead, (n, half_k) = qweight.shape[:-2], qweight.shape[-2:]
        flat = qweight.reshape(-1, n, half_k)
        packed = torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            quant.unpack_nibbles(m).to(torch.int32), 2) for m in flat])
        sz = torch.stack((parts["scales"], parts["zeros"]), dim=-1).transpose(-3, -2)  # [..., K/32, N, 2]
        return cls(packed.reshape(*lead, n, half_k), sz.to(dtype).contiguous())

    def _converted(self, dtype: torch.dtype) -> QuantizedWeight:
        if dtype == torch.float32:
            raise InvalidArgument("int4 weights packed for bf16 compute cannot serve float32 compute; "
                                  "load the sidecar with float32 compute instead")
        return Int4Weight(self.packed, self.scales_and_zeros.to(dtype))

    def __getitem__(self, i) -> Int4Matrix:
        return Int4Matrix(self.packed[i], self.scales_and_zeros[i])

    def matrix(self) -> Int4Matrix:
        """The matrix of an unstacked weight."""
        return Int4Matrix(self.packed, self.scales_and_zeros)


class Int4TileWeight(QuantizedWeight):
    """int4, group 32, for bf16 compute with warmserve's kernel (:func:`int4_tiles_enabled`):
    ``tiles`` uint8 ``[..., N/16, K/8, 64]`` and ``scales_zeros`` bf16 ``[..., N/16, K/32, 2, 16]``
    (:func:`pack_int4_tiles`). ``int8_activations`` (set by the runner that serves it, from
    ``--quantized-activations``; a Python attribute, not a buffer): its matrices are multiplied
    by int8 activations (:func:`int4_tiles_matmul`)."""

    format = "int4"

    def __init__(self, tiles: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        super().__init__()
        self.int8_activations = False
        self.register_buffer("tiles", tiles, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_zeros.dtype

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> Int4TileWeight:
        """The sidecar parts (``qweight`` uint8 ``[..., N, K/2]``, ``scales``/``zeros`` ``[...,
        N, K/32]``) in the tile layout; ``dtype`` must be bf16 (``ValueError`` otherwise, or when
        the shape does not tile: :func:`pack_int4_tiles`)."""
        if dtype != torch.bfloat16:
            raise ValueError(f"int4 tiles serve bf16 compute, not {dtype}")
        qweight, scales, zeros = parts["qweight"], parts["scales"], parts["zeros"]
        lead, (n, half_k) = qweight.shape[:-2], qweight.shape[-2:]
        flat = [(q, s, z) for q, s, z in zip(qweight.reshape(-1, n, half_k), scales.reshape(-1, n, scales.shape[-1]),
                                              zeros.reshape(-1, n, zeros.shape[-1]), strict=True)]
        packed = [pack_int4_tiles(q, s, z) for q, s, z in flat]  # a matrix at a time
        tiles, sz = torch.stack([t for t, _ in packed]), torch.stack([z for _, z in packed])
        return cls(tiles.reshape(*lead, *tiles.shape[1:]), sz.reshape(*lead, *sz.shape[1:]))

    def parts(self) -> dict[str, torch.Tensor]:
        """The stored parts back (:mod:`model_families.quant`'s names and layout; scales and
        zeros float32, as rounded to bf16)."""
        *lead, t, c, _ = self.tiles.shape
        flat = self.tiles.reshape(-1, t, c, 64)
        codes = torch.stack([int4_tiles_codes(m).T for m in flat]).reshape(*lead, t * 16, c * 8)
        sz = self.scales_zeros.float().movedim(-2, 0)  # [2, ..., t, g, 16]
        scales, zeros = (v.transpose(-1, -2).reshape(*lead, t * 16, -1) for v in sz)
        return {"qweight": codes[..., 0::2] | (codes[..., 1::2] << 4), "scales": scales, "zeros": zeros}

    def _converted(self, dtype: torch.dtype) -> QuantizedWeight:
        if dtype == torch.float32:
            raise InvalidArgument("int4 weights packed for bf16 compute cannot serve float32 compute; "
                                  "load the sidecar with float32 compute instead")
        return Int4Weight.from_parts(self.parts(), dtype)

    def __getitem__(self, i) -> Int4Tiles:
        return Int4Tiles(self.tiles[i], self.scales_zeros[i], self.int8_activations)

    def layer_matrix(self, tiles: torch.Tensor, scales_zeros: torch.Tensor) -> Int4Tiles:
        return Int4Tiles(tiles, scales_zeros, self.int8_activations)

    def matrix(self) -> Int4Tiles:
        """The matrix of an unstacked weight."""
        return Int4Tiles(self.tiles, self.scales_zeros, self.int8_activations)


def int4_weight(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Int4Weight | Int4TileWeight:
    """The int4 weight for bf16 / f16 compute on the CPU: an :class:`Int4TileWeight` for bf16 where
    :func:`~model_families.native.int4_tiles_enabled`, else an :class:`Int4Weight` (PyTorch's
    kernel). Both need ``N % 16 == 0``."""
    if dtype == torch.bfloat16 and native.int4_tiles_enabled():
        return Int4TileWeight.from_parts(parts, dtype)
    return Int4Weight.from_parts(parts, dtype)


class Int4GroupWeight(QuantizedWeight):
    """int4, group 32, for float32 compute: the sidecar's parts as they are (zero-copy from the
    mapped file), dequantized per matmul (see the module docstring for why)."""

    format = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("zeros", zeros, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def _converted(self, dtype: torch.dtype) -> QuantizedWeight:
        return int4_weight({"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}, dtype)

    def __getitem__(self, i) -> Int4Groups:
        return Int4Groups(self.qweight[i], self.scales[i], self.zeros[i])

    def matrix(self) -> Int4Groups:
        """The matrix of an unstacked weight."""
        return Int4Groups(self.qweight, self.scales, self.zeros)


class Int8Weight(QuantizedWeight):
    """int8, one scale per output row: ``weight`` int8 ``[..., N, K]``, ``scales`` ``[..., N]``
    in the compute dtype."""

    format = "int8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Int8Weight:
        """The sidecar parts (``qweight`` int8, ``scales``) as they are; scales in ``dtype``."""
        return cls(parts["qweight"], parts["scales"].to(dtype))

    def _converted(self, dtype: torch.dtype) -> QuantizedWeight:
        return Int8Weight(self.weight, self.scales.to(dtype))

    def __getitem__(self, i) -> Int8Matrix:
        return Int8Matrix(self.weight[i], self.scales[i])

    def matrix(self) -> Int8Matrix:
        """The matrix of an unstacked weight."""
        return Int8Matrix(self.weight, self.scales)


def quantized_weight(parts: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device) -> QuantizedWeight | torch.Tensor:
    """The runner's weight for one quantized sidecar matrix (``parts`` as stored, see
    :mod:`model_families.quant`) computing in ``dtype``: on the CPU :func:`int4_weight`
    (bf16/f16: a kernel's layout), an :class:`Int4GroupWeight` (float32: the parts as they
    are) or an :class:`Int8Weight`; on any other device the dequantized matrix in ``dtype``
    (a plain tensor)."""
    if torch.device(device).type != "cpu":
        return quant.dequantize(parts).to(device=device, dtype=dtype)
    if quant.format_of(parts) == "int8":
        return Int8Weight.from_parts(parts, dtype)
    if dtype == torch.float32:
        return Int4GroupWeight(parts["qweight"], parts["scales"].float(), parts["zeros"].float())
    return int4_weight(parts, dtype)


def dequantized(m: Int4Groups | Int8Matrix) -> torch.Tensor:
    """The float32 matrix of one stored int4 / float32-scaled int8 matrix (the formulas of
    :func:`model_families.quant.dequantize`)."""
    if isinstance(m, Int8Matrix):
        return m.weight.to(torch.float32) * m.scales.unsqueeze(-1)
    q = m.qweight
    codes = torch.stack((q & 0x0F, q >> 4), dim=-1).flatten(-2).to(torch.float32)
    n, k = codes.shape
    w = (codes.view(n, k // quant.INT4_GROUP, quant.INT4_GROUP) - 8) * m.scales.unsqueeze(-1) + m.zeros.unsqueeze(-1)
    return w.view(n, k)
