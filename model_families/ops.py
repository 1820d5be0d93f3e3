"""Building blocks shared by the families' forward passes: RMSNorm, rotate-half RoPE, the paged
KV writes (in place per layer, or a decode step's rows for all layers at once), paged attention
(prefill: gather + SDPA; decode: fused reductions over the blocks in place), and the linear layer over float or weight-only quantized matrices. Plain PyTorch with no Python control flow on tensor values, so a forward
built from them can be exported and compiled as is.

Quantized weights are built once at load from the sidecar's parts (:mod:`model_families.quant`)
by :func:`quantized_weight`, and :func:`linear` runs them:

- bf16 (or f16) compute on the CPU uses PyTorch's weight-only kernels. int4
  (:class:`Int4Weight`): ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32,
  scales_and_zeros)`` with ``packed`` from ``_convert_weight_to_int4pack_for_cpu`` (an opaque,
  CPU-ISA-specific layout of the codes, ``uint8 [N, K/2]``, made once at load) and
  ``scales_and_zeros`` ``[K/32, N, 2]``; it computes ``x @ ((q - 8) * scale + zero).T``. int8
  (:class:`Int8Weight`): ``torch.ops.aten._weight_int8pack_mm(x, q [N, K], scales [N])``.
  Both take the scales in the activation dtype, so the float32 scales and zeros are rounded to
  bf16 at load.
- float32 compute dequantizes each matrix right before its matmul (:class:`Int4GroupWeight`
  keeps the sidecar's parts as they are, zero-copy; int8 likewise) and runs a float32 matmul:
  PyTorch's float32-activation paths of both kernels are scalar reference code. Measured on this
  2-core AVX512-BF16 host, 30 layers of SmolLM2-shaped matmuls, one thread (rough, a shared
  machine): float32 dense 51 ms at batch 1 / 134 ms at batch 32; int4 kernel in bf16 4.4 / 41 ms;
  int4 kernel in float32 298 / 5159 ms; dequantize-then-matmul in float32 ~190 / ~310 ms. So
  float32 over quantized weights keeps the memory saving and exact values (what the fidelity
  tests compare) but is slower than a float32 model; bf16 is the mode to serve in.
- Other devices (CUDA, NPU) get the dequantized matrix in the compute dtype: correct, without
  the memory saving.

Float matrices: :func:`float_linear` runs oneDNN's matmul on the CPU, on a blocked copy of the
matrix made once at load (:class:`PackedMatrices`) when the runner made one; exported programs
reach the copies through the ``torch.ops.warmserve.linear`` custom op.

Paged layout (see :mod:`model_families.family`): a pool ``[layers, num_blocks, block_size, ...]``;
slot ``s`` = ``block_id * block_size + offset``; block 0 is the scratch block.
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

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


def tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` flows through a trace (Dynamo compiling this code, or ``torch.export``
    tracing it) rather than eager execution. ``torch.compiler.is_exporting()`` alone is a
    process-wide flag, true in every thread while any thread exports; a runner that serves eager
    while its programs compile in the background (``EngineConfig.background_compile``) must not
    take the traced path, so an export also needs ``t`` to be a fake tensor."""
    return torch.compiler.is_dynamo_compiling() or (torch.compiler.is_exporting() and is_fake(t))


def write_kv(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[layer]`` slots ``slots`` [T] (int64) <- ``values`` [T, *row_shape], in place
    (``cache`` [layers, num_blocks, block_size, *row_shape]).

    Eager: a plain ``index_copy_``. Under ``torch.compile`` / ``torch.export``: the
    ``warmserve::kv_write_`` custom op (:mod:`model_families.kv_write`), which compilers keep as
    one in-place call instead of copying the whole pool; eagerly the op's dispatch costs more
    than the copy, so it is used only when compiling.
    """
    if tracing(values):
        torch.ops.warmserve.kv_write_(cache, layer, slots, values)
    else:
        cache[layer].view(-1, *cache.shape[3:]).index_copy_(0, slots, values)


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

    Decode (``S == 1``) may pass the step's own ``k_new``/``v_new`` [B, 1, nkv, hd]: they stand
    in for the pool's entry at each row's position, which the caller writes after the step
    (the decode program thus only reads the pools). Decode runs :func:`decode_attention`;
    prefill (``S > 1``) gathers the rows' blocks and runs masked SDPA.
    """
    if q.shape[1] == 1:
        return decode_attention(q, k_pool, v_pool, block_tables, positions, seq_lens, k_new, v_new)
    if k_new is not None or v_new is not None:
        raise ValueError("k_new/v_new are for decode steps (one query token per row)")
    B, nb = block_tables.shape
    bs, nkv, hd = k_pool.shape[1:]
    k = k_pool[block_tables].reshape(B, nb * bs, nkv, hd).transpose(1, 2)
    v = v_pool[block_tables].reshape(B, nb * bs, nkv, hd).transpose(1, 2)
    key_pos = torch.arange(nb * bs, device=q.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)
    return out.transpose(1, 2)


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
    dispatched per layer. Measured on this 2-core AVX512-BF16 host (bf16, B=32, 9 query / 3 KV
    heads of 64, T=256 keys, 2 threads), per layer: 0.44 ms compiled vs 3.3 ms for the gather +
    masked SDPA it replaces; eagerly 3.1 vs 3.7 ms.
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


def write_kv_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write a decode step's rows into every layer of a pool, in place: ``cache`` [layers,
    num_blocks, block_size, *row_shape], ``slots`` [B] int64, ``rows`` [layers, B, *row_shape]
    (row ``b`` of layer ``l`` goes to slot ``slots[b]`` of layer ``l``). One ``index_copy_`` for
    all layers; runs outside the compiled decode program (see :meth:`FamilyModel.decode
    <model_families.family.FamilyModel.decode>`)."""
    cache.view(cache.shape[0], -1, *cache.shape[3:]).index_copy_(1, slots, rows)


# -- weight-only quantized matrices ------------------------------------------------------------


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
        return Int4Weight.from_parts({"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}, dtype)

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
    :mod:`model_families.quant`) computing in ``dtype``: on the CPU an :class:`Int4Weight`
    (bf16/f16: the kernel's layout), an :class:`Int4GroupWeight` (float32: the parts as they
    are) or an :class:`Int8Weight`; on any other device the dequantized matrix in ``dtype``
    (a plain tensor)."""
    if torch.device(device).type != "cpu":
        return quant.dequantize(parts).to(device=device, dtype=dtype)
    if quant.format_of(parts) == "int8":
        return Int8Weight.from_parts(parts, dtype)
    if dtype == torch.float32:
        return Int4GroupWeight(parts["qweight"], parts["scales"].float(), parts["zeros"].float())
    return Int4Weight.from_parts(parts, dtype)


def _dequantized(m: Int4Groups | Int8Matrix) -> torch.Tensor:
    """The float32 matrix of one stored int4 / float32-scaled int8 matrix (the formulas of
    :func:`model_families.quant.dequantize`)."""
    if isinstance(m, Int8Matrix):
        return m.weight.to(torch.float32) * m.scales.unsqueeze(-1)
    q = m.qweight
    codes = torch.stack((q & 0x0F, q >> 4), dim=-1).flatten(-2).to(torch.float32)
    n, k = codes.shape
    w = (codes.view(n, k // quant.INT4_GROUP, quant.INT4_GROUP) - 8) * m.scales.unsqueeze(-1) + m.zeros.unsqueeze(-1)
    return w.view(n, k)


#: Float dtypes whose CPU matmuls go to oneDNN directly (:func:`float_linear`), and whether
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
    """Whether ``x @ weight.T`` goes to oneDNN (:func:`float_linear`): oneDNN built in, both on
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
    its blocked layout inside every matmul otherwise. Measured on this 2-core AVX512-BF16 host,
    2 threads, 30 layers of SmolLM2-shaped matmuls (qkv, o, gate_up, down): float32 at batch 32
    20.8 -> 16.7 ms, batch 8 9.7 -> 6.1 ms; bf16 at batch 1 5.0 -> 2.8 ms; the tied 49152 x 576
    ``lm_head`` float32 at batch 32 7.3 -> 5.4 ms, bf16 at batch 1 1.7 -> 0.9 ms. A compiled
    program reaches the copies through ``torch.ops.warmserve.linear`` (a custom op, about 4 us
    per call), because AOTInductor binds constants by reference as plain strided tensors.
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


def _onednn_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 [M, K] @ weight[N, K].T (+ bias)`` with oneDNN, on the prepacked copy when there is
    one (:class:`PackedMatrices`)."""
    return torch.ops.mkldnn._linear_pointwise(x2, _PACKED.get(_matrix_key(weight), weight), bias, "none", [], "")


#: ``torch.ops.warmserve.linear``, defined with the low-level ``torch.library.Library`` rather than
#: ``torch.library.custom_op``: the latter wraps the kernel in Dynamo's ``disable``, whose
#: ``fx_traceback.annotate`` edits process-wide tracing metadata on every call, so a compiled
#: program calling it while another thread compiles (``EngineConfig.background_compile``) failed
#: with ``KeyError: 'custom'``. This kernel is called straight from the dispatcher.
_LIB = torch.library.Library("warmserve", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N])`` -> [M, N] in ``x``'s dtype, on the prepacked
    copy of ``weight`` when :class:`PackedMatrices` holds one: the call an exported program makes
    for every :func:`float_linear` (register this op, i.e. import this module, before loading such
    a program)."""
    return _onednn_linear(x, weight, bias)


_LIB.impl("linear", _linear_kernel, "CPU")


@torch.library.register_fake("warmserve::linear", lib=_LIB)
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


_LIB.define("grouped_experts(Tensor x, Tensor picks, Tensor weights, Tensor gate_up, Tensor down, float limit)"
            " -> Tensor")


def _grouped_experts_kernel(x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                            down: torch.Tensor, limit: float) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer, each picked expert run once on the
    tokens that picked it (as transformers' per-expert loop, e.g. ``DeepseekV4Experts``).

    ``x`` [T, H]; ``picks`` [T, k] int64 expert ids (distinct per token); ``weights`` [T, k] their
    weights; ``gate_up`` [E, 2I, H] (gate rows, then up); ``down`` [E, H, I]; ``limit``: the
    SwiGLU clamp (gate clamped above at ``limit``, up to ``[-limit, limit]``; ``inf`` for none).
    Returns ``sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`` [T, H] in ``x``'s dtype.
    """
    k, num_experts = picks.shape[1], gate_up.shape[0]
    flat = picks.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = torch.div(order, k, rounding_mode="floor")
    xs, ws = x[tokens], weights.reshape(-1)[order].to(x.dtype)
    out = x.new_zeros((x.shape[0], down.shape[1]))
    ys, start = [], 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            gate, up = F.linear(xs[start:start + n], gate_up[e]).chunk(2, dim=-1)
            act = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            ys.append(F.linear(act, down[e]) * ws[start:start + n, None])
            start += n
    return out.index_add_(0, tokens, torch.cat(ys)) if ys else out


_LIB.impl("grouped_experts", _grouped_experts_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("warmserve::grouped_experts", lib=_LIB)
def _grouped_experts_fake(x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, limit: float) -> torch.Tensor:
    return x.new_empty((x.shape[0], down.shape[1]))


def grouped_experts(x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, limit: float = math.inf) -> torch.Tensor:
    """Routed experts [T, H] (:func:`_grouped_experts_kernel`: shapes, formula). Traced (a
    compiled program), the custom op ``torch.ops.warmserve.grouped_experts``, so the program runs
    the same per-expert loop at run time instead of every expert on every token (a graph with
    data-dependent group sizes does not export); eagerly, the loop itself."""
    if tracing(x):
        return torch.ops.warmserve.grouped_experts(x, picks, weights, gate_up, down, float(limit))
    return _grouped_experts_kernel(x, picks, weights, gate_up, down, float(limit))


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias [N])`` for a float matrix. On the CPU (f32 / bf16,
    oneDNN built in; :func:`onednn_linear_eligible`) this is oneDNN's matmul
    (``torch.ops.mkldnn._linear_pointwise``) on the matrix's prepacked copy
    (:class:`PackedMatrices`) or else on the plain matrix; under ``torch.export`` it is the custom
    op ``torch.ops.warmserve.linear``, which does the same at run time, so a program compiled once
    uses whatever copies the process holds. ``F.linear`` sends float32 to the BLAS library (MKL),
    whose code path on this AMD host is about half as fast: measured on this 2-core AVX512-BF16
    host, 2 threads, 30 layers of SmolLM2-shaped matmuls at batch 32, float32 25 ms (plain
    oneDNN) vs 45 ms (``F.linear``); batch 1 6.1 vs 7.3 ms; bf16 equal at batch 32, 4.9 vs 6.3 ms
    at batch 1. Under ``torch.compile`` (Dynamo, ``--compile inductor``) and elsewhere:
    ``F.linear``."""
    if not onednn_linear_eligible(x, weight) or torch.compiler.is_dynamo_compiling():
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.warmserve.linear(x2, weight, bias) if tracing(x2) else _onednn_linear(x2, weight, bias)
    return y.reshape(*lead, y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Matrix | Int4Groups | Int8Matrix | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight.T (+ bias)`` for a float ``[N, K]`` matrix (``F.linear``), one
    quantized matrix (a layer of a stacked :class:`QuantizedWeight`: ``w[i]``) or an unstacked
    :class:`QuantizedWeight`. Output in ``x``'s dtype. Float matrices run :func:`float_linear`;
    bf16/f16 activations over quantized ones PyTorch's weight-only kernels; float32 ones a
    float32 matmul of the matrix dequantized just before."""
    if isinstance(weight, torch.Tensor):
        return float_linear(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        weight = weight.matrix()
    if isinstance(weight, Int4Groups) or x.dtype == torch.float32:
        # F.linear, not float_linear: Inductor's oneDNN lowering wants the weight to be a constant
        return F.linear(x, _dequantized(weight), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if isinstance(weight, Int4Matrix):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, quant.INT4_GROUP, weight.scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, weight.weight, weight.scales)
    y = y.reshape(*lead, y.shape[-1])
    return y if bias is None else y + bias
