"""The oneDNN prepack registry: blocked copies of float weight matrices made once at load
(:class:`PackedMatrices`), looked up by the plain matrix they stand for, and the oneDNN matmul
that uses them (:func:`onednn_linear`). See ``docs/architecture.md`` §7.
"""

from __future__ import annotations

import weakref

import torch

#: Float dtypes whose CPU matmuls go to oneDNN directly (:func:`model_families.linear.float_linear`), and whether
#: this torch has oneDNN (read once: Dynamo does not trace ``torch.backends``).
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_HAS_ONEDNN = torch.backends.mkldnn.is_available()

#: oneDNN-blocked copies of float matrices (:class:`PackedMatrices`), by :func:`_matrix_key` of
#: the plain matrix they stand for.
_PACKED: dict[tuple, torch.Tensor] = {}


def _matrix_key(weight: torch.Tensor) -> tuple:
    """What identifies a plain matrix to :data:`_PACKED`: its address, shape, strides and dtype
    (a layer's matrix is a view of a stacked tensor, rebuilt on every ``w[i]``; while it is
    registered, :class:`PackedMatrices` keeps it alive, so its address is not reused)."""
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype


def onednn_linear_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` goes to oneDNN (:func:`model_families.linear.float_linear`): oneDNN built in, both on
    the CPU in the same float32 / bf16 dtype."""
    return (_HAS_ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2)


class PackedMatrices:
    """oneDNN-blocked (prepacked) copies of float weight matrices, made once at load and used by
    every :func:`float_linear` over those matrices, eager or compiled, until :meth:`close`.

    ``matrices``: plain ``[N, K]`` float32 / bf16 CPU tensors (views of stacked layers are fine);
    ineligible ones (quantized, other devices, other dtypes) and ones already registered are
    skipped. ``batch_hint``: the activation rows (tokens) oneDNN picks the blocked layout for
    (``torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)``); the decode batch is the one to
    serve. Each copy is an opaque ``mkldnn`` tensor of the matrix's bytes (so a packed float32
    model holds its weights twice: the plain ones stay, mapped from the sidecar, for the
    embedding and as the compiled program's constants). Why: oneDNN reorders a plain matrix into
    its blocked layout inside every matmul otherwise (gains: ``docs/benchmarks.md``). A compiled
    program reaches the copies through ``torch.ops.warmserve.linear``
    (:mod:`model_families.custom_ops`), because AOTInductor binds constants by reference as plain
    strided tensors.
    """

    def __init__(self, matrices, batch_hint: int) -> None:
        self._keys: list[tuple] = []
        self._plain: list[torch.Tensor] = []  # keeps each key's address in use while registered
        self.nbytes = 0
        if not _HAS_ONEDNN:
            return
        for w in matrices:
            if not (isinstance(w, torch.Tensor) and onednn_linear_eligible(w, w)):
                continue
            key = _matrix_key(w)
            if key in _PACKED:
                continue
            _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
            self._keys.append(key)
            self._plain.append(w)
            self.nbytes += w.numel() * w.element_size()
        self._finalizer = weakref.finalize(self, _unregister, list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        """Drop the copies (idempotent; also when this object is collected); matmuls over these
        matrices use the plain ones again."""
        if hasattr(self, "_finalizer"):
            self._finalizer()
        self._keys, self._plain = [], []


def _unregister(keys: list[tuple]) -> None:
    for key in keys:
        _PACKED.pop(key, None)


def onednn_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 [M, K] @ weight[N, K].T (+ bias)`` with oneDNN, on the prepacked copy when there is
    one (:class:`PackedMatrices`)."""
    return torch.ops.mkldnn._linear_pointwise(x2, _PACKED.get(_matrix_key(weight), weight), bias, "none", [], "")
