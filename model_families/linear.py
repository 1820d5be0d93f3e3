"""The families' linear layer: :func:`float_linear` (oneDNN on the CPU, on the prepacked copy
when there is one, :mod:`model_families.prepack`; the ``warmserve::linear`` custom op when
exported) and :func:`linear`, which also runs weight-only quantized matrices
(:mod:`model_families.quantized_weights`), at fixed row counts in batch-invariant mode
(:mod:`model_families.invariant`). Plain PyTorch with no control flow on tensor values.
See ``docs/architecture.md`` §7.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from model_families import custom_ops as _custom_ops  # noqa: F401  (registers torch.ops.warmserve.linear)
from model_families import invariant, quant
from model_families.custom_ops import tracing
from model_families.prepack import onednn_linear, onednn_linear_eligible
from model_families.quantized_weights import (
    Int4Groups,
    Int4Matrix,
    Int4Tiles,
    Int8Matrix,
    QuantizedWeight,
    dequantized,
    int4_matmul,
    int4_tiles_matmul,
)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias [N])`` for a float matrix. On the CPU (f32 / bf16,
    oneDNN built in; :func:`onednn_linear_eligible`) this is oneDNN's matmul
    (``torch.ops.mkldnn._linear_pointwise``) on the matrix's prepacked copy
    (:class:`~model_families.prepack.PackedMatrices`) or else on the plain matrix; under ``torch.export`` it is the custom
    op ``torch.ops.warmserve.linear``, which does the same at run time, so a program compiled once
    uses whatever copies the process holds. ``F.linear`` would send float32 to the BLAS library
    (MKL), whose code path on this AMD host is slower (``docs/benchmarks.md``). Under
    ``torch.compile`` (Dynamo, ``--compile inductor``) and elsewhere: ``F.linear``."""
    if not onednn_linear_eligible(x, weight) or torch.compiler.is_dynamo_compiling():
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.warmserve.linear(x2, weight, bias) if tracing(x2) else onednn_linear(x2, weight, bias)
    return y.reshape(*lead, y.shape[-1])


#: Set while a program that runs int4 matrices as ``warmserve::int4_linear`` is traced
#: (:func:`opaque_quantized_kernels`).
_OPAQUE_QUANTIZED = contextvars.ContextVar("warmserve_opaque_quantized", default=False)


@contextlib.contextmanager
def opaque_quantized_kernels() -> Iterator[None]:
    """While tracing a loop body (``scan``, lowered to ``while_loop``) or a program whose steps run
    many rows per matmul (prefill, verify): int4 matrices run as the custom op
    ``warmserve::int4_linear`` (``warmserve::int4_tiles_linear`` for int4 tiles, whose kernel is
    :func:`~model_families.quantized_weights.int4_tiles_matmul`), which Inductor calls as is,
    instead of the aten kernel. Its kernel
    is :func:`~model_families.quantized_weights.int4_matmul`, as in eager steps: the int4 kernel
    or, from :data:`~model_families.quantized_weights.INT4_DENSE_MIN_ROWS` rows, dequantize and a
    dense matmul, picked by the row count at run time; and the aten kernel's Inductor lowering is
    one the C++ wrapper of a loop body cannot hold (:func:`model_families.custom_ops._int4_linear_kernel`).
    A decode program outside a loop calls the aten kernel directly (no Python op per matmul at
    batch 1)."""
    token = _OPAQUE_QUANTIZED.set(True)
    try:
        yield
    finally:
        _OPAQUE_QUANTIZED.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Matrix | Int4Tiles | Int4Groups | Int8Matrix | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight.T (+ bias)`` for a float ``[N, K]`` matrix (``F.linear``), one
    quantized matrix (a layer of a stacked :class:`QuantizedWeight`: ``w[i]``) or an unstacked
    :class:`QuantizedWeight`. Output in ``x``'s dtype. Float matrices run :func:`float_linear`;
    bf16 activations over int4 tiles warmserve's kernel
    (:func:`~model_families.quantized_weights.int4_tiles_matmul`, dense from
    :data:`~model_families.quantized_weights.INT4_TILES_DENSE_MIN_ROWS` rows; with int8
    activations ``warmserve::int4_mm_tiles_a8`` at every row count); bf16/f16
    activations over other quantized matrices PyTorch's weight-only kernels (int4 from
    :data:`~model_families.quantized_weights.INT4_DENSE_MIN_ROWS` rows: dequantized, then a dense
    matmul, :func:`~model_families.quantized_weights.int4_matmul`); float32 ones a
    float32 matmul of the matrix dequantized just before. In a batch-invariant step
    (:func:`model_families.invariant.active_policy`) the same kernels run at the policy's row
    counts (:meth:`~model_families.invariant.RowPolicy.rows`)."""
    policy = invariant.active_policy()
    if policy is not None:
        return policy.rows(x, lambda x2: _linear(x2, weight, bias))
    return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor | Int4Matrix | Int4Tiles | Int4Groups | Int8Matrix | QuantizedWeight,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return float_linear(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        weight = weight.matrix()
    if isinstance(weight, Int4Groups) or x.dtype == torch.float32:
        # F.linear, not float_linear: Inductor's oneDNN lowering wants the weight to be a constant
        return F.linear(x, dequantized(weight), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if isinstance(weight, Int4Tiles) and weight.int8_activations:  # one kernel at every row count
        y = torch.ops.warmserve.int4_mm_tiles_a8(x2, weight.tiles, quant.INT4_GROUP, weight.scales_zeros)
    elif isinstance(weight, Int4Matrix | Int4Tiles):
        # (eager: picks kernel or dense by rows, traced opaque: the same as a custom op, traced: the kernel)
        eager, opaque, kernel = (
            (int4_matmul, torch.ops.warmserve.int4_linear, torch.ops.aten._weight_int4pack_mm_for_cpu)
            if isinstance(weight, Int4Matrix) else
            (int4_tiles_matmul, torch.ops.warmserve.int4_tiles_linear, torch.ops.warmserve.int4_mm_tiles))
        int4_mm = eager if not tracing(x2) else opaque if _OPAQUE_QUANTIZED.get() else kernel
        y = int4_mm(x2, weight[0], quant.INT4_GROUP, weight[1])  # (codes, scales and zeros) of either layout
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, weight.weight, weight.scales)
    y = y.reshape(*lead, y.shape[-1])
    return y if bias is None else y + bias
