"""Dequantizers for the DeepSeek V4 release checkpoints' stored formats (read path of the pack
spec: every quantized tensor becomes float32 before it is packed).

Formats, as the sources below state them:

* **FP8 block-scaled matrices** (attention projections, shared experts, ...): the weight
  ``[..., N, K]`` is ``float8_e4m3fn`` (safetensors ``F8_E4M3``); its companion holds one scale
  per 128x128 block, ``[..., ceil(N/128), ceil(K/128)]`` (blocks at the bottom / right edge are
  partial: ceil division, as transformers' ``_alloc_expert_proj`` sizes them with ``_cdiv``).
  ``weight = fp8_value * scale[row // 128, col // 128]``. The companion is ``<prefix>.scale`` in
  release naming (transformers renames ``^(.+)\\.scale`` -> ``\\1.weight_scale_inv``:
  ``quantizers/quantizer_finegrained_fp8.py`` ``update_weight_conversions``, comment "DeepSeek-V4-
  Flash") and ``<prefix>.weight_scale_inv`` / ``<param>_scale_inv`` in transformers naming.
* **Scales**: ``scale_fmt="ue8m0"`` (``utils/quantization_config.py`` ``FineGrainedFP8Config``:
  "1-byte ``torch.float8_e8m0fnu``, V4-style"), safetensors ``F8_E8M0``: an 8-bit biased
  exponent, value ``2^(e-127)`` (``Fp8Dequantize._dequantize_one`` reads raw ``uint8`` bytes the
  same way); ``float32`` scales (``scale_fmt="float"``, V3-style) are used as they are.
* **FP4 routed experts** (``expert_dtype="fp4"``): e2m1 codes, two per byte, stored ``int8``
  with the K dim halved (``integrations/finegrained_fp8.py`` ``FP8Experts.__init__``: "weight is
  ``int8``, K dim halved (2 e2m1 values per byte)", "per-row SF at gran_k=32"), or as safetensors
  ``F4`` (``torch.float4_e2m1fn_x2``, which safetensors 0.8 maps to ``F4``; ``uint8`` is read the
  same way). The low nibble is the even column, the high nibble the odd one
  (``Fp8Dequantize._unpack_fp4``: ``stack([lut[low], lut[high]], -1)``); nibble ``s e e m`` is
  ``(-1)^s`` times ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}[eem]`` (``_FP4_E2M1_LUT``). One scale per 32
  values of a row: ``weight[n, k] = e2m1(code[n, k]) * scale[n, k // 32]``, scale
  ``[..., N, ceil(K/32)]``.

transformers' own ``Fp8Dequantize`` derives the block from the scale grid (``rows //
scale_rows``), which only agrees with 128x128 blocks when the dims are multiples of 128; the
release's blocks are fixed at 128x128 (``weight_block_size`` default ``(128, 128)``), so here the
block is fixed and edge blocks are cropped.
"""

from __future__ import annotations

import math

import torch

from services.errors import InvalidArgument

#: FP8 weight block (rows, columns) of the release (``FineGrainedFP8Config.weight_block_size``).
FP8_BLOCK = (128, 128)
#: FP4 scale group: values of one row per scale.
FP4_GROUP = 32
#: e2m1 code (0..15) -> value: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
_FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def is_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` is stored as FP8 e4m3 codes."""
    return t.dtype in _FP8_DTYPES


def is_packed_fp4(t: torch.Tensor) -> bool:
    """Whether ``t``'s dtype can hold packed e2m1 pairs (int8, uint8, float4_e2m1fn_x2); only a
    companion scale says that it does."""
    return t.dtype in _FP4_DTYPES


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t``'s dtype is one of the stored quantized forms (FP8 or packed FP4)."""
    return is_fp8(t) or is_packed_fp4(t)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: ``float8_e8m0fnu`` and raw ``uint8`` exponent bytes as ``2^(e-127)``
    (``e = 255`` is NaN), float scales as they are."""
    if _E8M0 is not None and scale.dtype == _E8M0:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        e = scale.to(torch.float32)
        return torch.where(e == 255, torch.nan, torch.exp2(e - 127.0))
    if not scale.is_floating_point():
        raise InvalidArgument(f"a block scale must be float or ue8m0, not {scale.dtype}")
    return scale.to(torch.float32)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., N, K/2]`` bytes of e2m1 pairs -> float32 ``[..., N, K]`` (low nibble first)."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _expand(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """A ``[..., ceil(rows/br), ceil(cols/bc)]`` grid as a ``[..., rows, cols]`` tensor."""
    scale = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    return scale.repeat_interleave(block_cols, dim=-1)[..., :cols]


def _check_grid(what: str, scale: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(scale.shape) != expected:
        raise InvalidArgument(f"{what} has a scale of shape {list(scale.shape)}, expected {list(expected)}")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                   what: str = "an FP8 weight") -> torch.Tensor:
    """float32 ``weight * scale`` per ``block`` (ceil division: edge blocks are partial);
    ``weight`` ``[..., N, K]`` float8_e4m3fn, ``scale`` ``[..., ceil(N/br), ceil(K/bc)]``
    (ue8m0 or float). ``InvalidArgument`` when the scale grid does not fit."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    _check_grid(what, scale, (*weight.shape[:-2], math.ceil(rows / br), math.ceil(cols / bc)))
    return weight.to(torch.float32) * _expand(scale_values(scale), rows, cols, br, bc)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP,
                   what: str = "an FP4 weight") -> torch.Tensor:
    """float32 ``e2m1(code) * scale`` per ``group`` values of a row; ``packed`` ``[..., N, K/2]``
    (two codes a byte), ``scale`` ``[..., N, ceil(K/group)]``. ``InvalidArgument`` when the scale
    grid does not fit."""
    values = unpack_e2m1(packed)
    rows, cols = values.shape[-2:]
    _check_grid(what, scale, (*values.shape[:-2], rows, math.ceil(cols / group)))
    return values * _expand(scale_values(scale), rows, cols, 1, group)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, what: str = "a quantized weight",
               halves: bool = False) -> torch.Tensor:
    """Dequantize by the stored dtype: FP8 (128x128 blocks) or packed FP4 (rows of 32 groups).
    ``halves``: ``weight`` is two matrices concatenated along the rows (transformers' merged
    ``gate_up_proj``), each with its own block grid, when the scale has twice the block rows of
    one half."""
    if is_fp8(weight):
        rows = weight.shape[-2]
        if halves and rows % 2 == 0 and scale.shape[-2] == 2 * math.ceil(rows // 2 / FP8_BLOCK[0]):
            half, srows = rows // 2, scale.shape[-2] // 2
            return torch.cat([dequantize_fp8(weight[..., :half, :], scale[..., :srows, :], what=what),
                              dequantize_fp8(weight[..., half:, :], scale[..., srows:, :], what=what)], dim=-2)
        return dequantize_fp8(weight, scale, what=what)
    if is_packed_fp4(weight):
        return dequantize_fp4(weight, scale, what=what)
    raise InvalidArgument(f"{what} is stored as {weight.dtype}, which has no block scale")
