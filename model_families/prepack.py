"""The oneDNN prepack registry: blocked copies of float weight matrices made once at load
(:class:`PackedMatrices`), looked up by the plain matrix they stand for, and the oneDNN matmul
that uses them (:func:`onednn_linear`); and int8 copies of an output head, which that matmul
uses for a few rows (``head`` of :class:`PackedMatrices`). See ``docs/architecture.md`` §7.
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
#: int8 copies (``warmserve::int8_mm_tiles``'s ``(tiles, scales_zeros)``) of bf16 output heads, by
#: :func:`_matrix_key` of the plain matrix (:class:`PackedMatrices` ``head``), with whether they
#: are multiplied by int8 activations (``warmserve::int8_mm_tiles_a8``).
_INT8_HEADS: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}
#: Below this many rows :func:`onednn_linear` runs a head's int8 copy: reading half the bytes wins
#: while a step is bound by reading the matrix (a few decode rows); from it on oneDNN's bf16 matmul
#: is faster (SmolLM2's 49152 x 576 head, ``docs/benchmarks.md``).
INT8_HEAD_MAX_ROWS = 8


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

    ``head``: a bf16 output head (``[V, H]``) that also gets an int8 copy (``pack_int8_tiles``:
    one scale per 32, llama.cpp's Q8_0), which :func:`onednn_linear` uses below
    :data:`INT8_HEAD_MAX_ROWS` rows; skipped where ``warmserve::int8_mm_tiles`` does not run.
    With ``int8_activations`` (where ``warmserve::int8_mm_tiles_a8`` runs) the copy serves every
    row count, multiplied by int8 activations (faster than oneDNN's bf16 matmul at any count),
    and the head gets no blocked copy (:attr:`head_unread`).
    """

    def __init__(self, matrices, batch_hint: int, head: torch.Tensor | None = None,
                 int8_activations: bool = False) -> None:
        self._keys: list[tuple] = []
        self._plain: list[torch.Tensor] = []  # keeps each key's address in use while registered
        #: ``head`` when its int8 copy serves every row count (``int8_activations``): it gets no
        #: oneDNN-blocked copy, and :func:`onednn_linear` never reads the plain head (a tied
        #: embedding only gathers rows of it; a ``torch.compile`` graph, which multiplies with
        #: ``F.linear``, still reads it whole). ``None`` otherwise.
        self.head_unread: torch.Tensor | None = None
        self.nbytes = 0
        if not _HAS_ONEDNN:
            return
        if head is not None and _int8_head_eligible(head) and _matrix_key(head) not in _INT8_HEADS:
            from model_families import native
            from model_families.quantized_weights import pack_int8_tiles

            int8_activations = int8_activations and native.int8_activations_enabled()
            key = _matrix_key(head)
            _INT8_HEADS[key] = (*pack_int8_tiles(head), int8_activations)
            self._head_key: tuple | None = key
            self._plain.append(head)
            if int8_activations:
                self.head_unread = head
            self.nbytes += sum(t.numel() * t.element_size() for t in _INT8_HEADS[key][:2])
        unread_key = None if self.head_unread is None else self._head_key
        for w in matrices:
            if not (isinstance(w, torch.Tensor) and onednn_linear_eligible(w, w)):
                continue
            key = _matrix_key(w)
            if key in _PACKED or key == unread_key:  # a head its int8 copy serves throughout needs none
                continue
            _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
            self._keys.append(key)
            self._plain.append(w)
            self.nbytes += w.numel() * w.element_size()
        self._finalizer = weakref.finalize(self, _unregister, list(self._keys), getattr(self, "_head_key", None))

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        """Drop the copies (idempotent; also when this object is collected); matmuls over these
        matrices use the plain ones again."""
        if hasattr(self, "_finalizer"):
            self._finalizer()
        self._keys, self._plain, self.head_unread = [], [], None


def _unregister(keys: list[tuple], head_key: tuple | None = None) -> None:
    for key in keys:
        _PACKED.pop(key, None)
    if head_key is not None:
        _INT8_HEADS.pop(head_key, None)


def _int8_head_eligible(w: torch.Tensor) -> bool:
    """Whether ``w`` gets an int8 copy: a bf16 ``[N, K]`` CPU matrix with ``N % 16 == 0`` and ``K`` a
    multiple of the group (``quant.INT4_GROUP``, what ``pack_int8_tiles`` uses), on a host where
    ``warmserve::int8_mm_tiles`` runs (:mod:`model_families.native`)."""
    from model_families import native, quant

    return (w.dtype == torch.bfloat16 and w.dim() == 2 and w.device.type == "cpu" and w.shape[0] % 16 == 0
            and w.shape[1] % quant.INT4_GROUP == 0 and native.int4_tiles_enabled())


def onednn_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 [M, K] @ weight[N, K].T (+ bias)`` with oneDNN, on the prepacked copy when there is
    one (:class:`PackedMatrices`); below :data:`INT8_HEAD_MAX_ROWS` rows over a head with an int8
    copy, ``warmserve::int8_mm_tiles`` on that copy (``int8_mm_tiles_a8`` at any row count where
    the copy is for int8 activations)."""
    key = _matrix_key(weight)
    head = _INT8_HEADS.get(key)
    if head is not None and (head[2] or x2.shape[0] < INT8_HEAD_MAX_ROWS):
        tiles, scales, a8 = head
        mm = torch.ops.warmserve.int8_mm_tiles_a8 if a8 else torch.ops.warmserve.int8_mm_tiles
        y = mm(x2, tiles, x2.shape[1] // scales.shape[1], scales)  # the packed group
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x2, _PACKED.get(key, weight), bias, "none", [], "")
