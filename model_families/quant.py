"""Weight-only quantized matrices in the sidecar: the two formats, the rules that produce them
from float weights, and their reference dequantization. Shared by every family's pack spec
(which decides *which* matrices are quantized) and by the runner (:mod:`model_families.quantized_weights`
turns the stored parts into what PyTorch's kernels take).

A quantized matrix ``NAME`` of float shape ``[..., N, K]`` (``N`` output rows, ``K`` input
features, optional leading layer dim) is stored as parts ``NAME.<part>``:

=======  ==========  ========  ====================  ==============================================
format   part        dtype     shape                 meaning
=======  ==========  ========  ====================  ==============================================
int4     ``qweight``  uint8    ``[..., N, K/2]``     4-bit codes ``q`` in 0..15, two per byte: byte
                                                     ``j`` holds column ``2j`` in its low nibble and
                                                     ``2j+1`` in its high nibble
int4     ``scales``   float32  ``[..., N, K/32]``    one scale per group of 32 columns
int4     ``zeros``    float32  ``[..., N, K/32]``    one zero per group: ``w = (q - 8) * scale + zero``
int8     ``qweight``  int8     ``[..., N, K]``       codes in -127..127
int8     ``scales``   float32  ``[..., N]``          one scale per output row: ``w = q * scale``
=======  ==========  ========  ====================  ==============================================

int4's formula is PyTorch's (``_weight_int4pack_mm_for_cpu``: ``(q - 8) * scale + zero``), so
GGUF blocks map onto it without a float detour: Q4_0 (``w = (q - 8) * d``) is ``scale = d``,
``zero = 0``; Q4_1 (``w = q * d + m``) is ``scale = d``, ``zero = m + 8 d`` (exact in float32 for
real weights, since ``m`` and ``8 d`` are float16 values of similar magnitude; it is rounded
to nearest otherwise). ``(q - 8) * d`` is exact, so a decoded value is the single rounding of
``q d + m``: the same float32 GGUF's own dequantization gives.

Rules for float weights (a float checkpoint asked for int4/int8, or a GGUF type with no exact
mapping, dequantized first):

- int4, asymmetric min/max per group of 32: ``scale = (max - min) / 15``,
  ``q = clamp(round((w - min) / scale), 0, 15)``, ``zero = min + 8 scale`` (GGUF's Q4_1 rule; a
  constant group gets ``scale = 0``, ``zero = min``);
- int8, symmetric per output row: ``scale = max|w| / 127``, ``q = clamp(round(w / scale), -127, 127)``
  (an all-zero row gets ``scale = 0``). PyTorch's int8 weight-only matmul takes one scale per
  output row, so GGUF Q8_0 (one scale per 32 values) is *requantized* with this rule, as is
  anything else asked for int8 (a Q4_1 file's int8 sidecar: one scale per row cannot hold Q4_1's
  per-32 min and scale, so it is an approximation of the GGUF, not a copy).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.errors import InvalidArgument

#: Columns sharing one int4 scale and zero.
INT4_GROUP = 32
#: PyTorch's CPU int4 kernel packs rows 16 at a time: int4 matrices need ``N % 16 == 0``.
INT4_ROWS = 16
#: Quantized formats and their parts, in storage order.
FORMATS: dict[str, tuple[str, ...]] = {"int4": ("qweight", "scales", "zeros"), "int8": ("qweight", "scales")}


class Int4Groups(NamedTuple):
    """An int4 matrix before nibble packing: ``q`` uint8 ``[..., N, K]`` codes 0..15, ``scales``
    and ``zeros`` float32 ``[..., N, K/32]``; ``w = (q - 8) * scale + zero``."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def part_specs(name: str, shape: tuple[int, ...], fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``NAME.<part>`` -> ``(shape, dtype)`` of the float matrix ``name`` ``[..., N, K]`` stored in
    ``fmt``. Raises ``InvalidArgument`` when int4 does not fit (``K`` not a multiple of 32)."""
    *lead, n, k = shape
    lead = tuple(lead)
    if fmt == "int4":
        if k % INT4_GROUP or n % INT4_ROWS:
            raise InvalidArgument(f"int4 needs {name} to have a multiple of {INT4_GROUP} input features and of "
                                  f"{INT4_ROWS} output rows, it has {k} and {n}")
        groups = (*lead, n, k // INT4_GROUP)
        return {f"{name}.qweight": ((*lead, n, k // 2), torch.uint8),
                f"{name}.scales": (groups, torch.float32), f"{name}.zeros": (groups, torch.float32)}
    if fmt == "int8":
        return {f"{name}.qweight": ((*lead, n, k), torch.int8), f"{name}.scales": ((*lead, n), torch.float32)}
    raise InvalidArgument(f"unknown quantized format {fmt!r} (known: {', '.join(FORMATS)})")


def format_of(parts: dict[str, torch.Tensor]) -> str:
    """``int4`` or ``int8``, from the ``qweight`` part's dtype."""
    dtype = parts["qweight"].dtype
    if dtype == torch.uint8 and "zeros" in parts:
        return "int4"
    if dtype == torch.int8:
        return "int8"
    raise InvalidArgument(f"quantized parts with a {dtype} qweight are neither int4 nor int8")


# -- nibbles -----------------------------------------------------------------------------------


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` (0..15, any integer dtype) -> uint8 ``[..., K/2]``, column ``2j`` in
    the low nibble of byte ``j``."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> uint8 codes ``[..., K]`` (the inverse of :func:`pack_nibbles`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# -- rules -------------------------------------------------------------------------------------


def quantize_int4(w: torch.Tensor) -> Int4Groups:
    """Asymmetric min/max int4 of float ``w`` ``[..., N, K]`` (``K`` a multiple of 32), computed
    in float32 (see the module docstring)."""
    w = w.float()
    *lead, n, k = w.shape
    g = w.reshape(*lead, n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(*lead, n, k), scale, lo + 8 * scale)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of float ``w`` ``[..., N, K]``: ``(q int8 [..., N, K], scales
    float32 [..., N])``."""
    w = w.float()
    scale = w.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int4_parts(groups: Int4Groups) -> dict[str, torch.Tensor]:
    """The stored parts (``qweight`` packed, ``scales``, ``zeros``) of ``groups``."""
    return {"qweight": pack_nibbles(groups.q), "scales": groups.scales.float(), "zeros": groups.zeros.float()}


def quantize_parts(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The stored parts of float ``w`` quantized to ``fmt`` by the module's rules."""
    if fmt == "int4":
        return int4_parts(quantize_int4(w))
    q, scales = quantize_int8(w)
    return {"qweight": q, "scales": scales}


# -- reference dequantization ------------------------------------------------------------------


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 matrix ``[..., N, K]`` the stored ``parts`` encode (the reference the kernels
    are tested against)."""
    if format_of(parts) == "int4":
        q = unpack_nibbles(parts["qweight"]).float()
        scales = parts["scales"].float().repeat_interleave(INT4_GROUP, -1)
        zeros = parts["zeros"].float().repeat_interleave(INT4_GROUP, -1)
        return (q - 8) * scales + zeros
    return parts["qweight"].float() * parts["scales"].float()[..., None]


def checkpoint_parts(ckpt, name: str, fmt: str) -> dict[str, torch.Tensor]:
    """The stored parts of the checkpoint matrix ``name`` (HF name and layout) in ``fmt``: for
    int4 the checkpoint's own groups when it offers them (``ckpt.int4_groups(name)``, e.g. GGUF
    Q4_0/Q4_1: exact, no float detour), else the float tensor quantized by the rules above."""
    if fmt == "int4":
        exact = getattr(ckpt, "int4_groups", None)
        groups = exact(name) if exact is not None else None
        if groups is not None:
            return int4_parts(groups)
    return quantize_parts(ckpt.tensor(name), fmt)


def concat_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Matrices stacked along their output rows (a fused projection), part by part: rows are
    quantized independently, so the parts of the concatenation are the concatenated parts."""
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
