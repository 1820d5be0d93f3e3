"""The ``warmserve`` custom-op library (``torch.library``): ``warmserve::linear`` (a float matmul
on the oneDNN prepacked copy, :mod:`model_families.prepack`), ``warmserve::int4_linear``
(PyTorch's int4 weight-only kernel, opaque to Inductor), ``warmserve::int4_tiles_linear`` (the
same for warmserve's int4 kernel, ``warmserve::int4_mm_tiles``; it and
``warmserve::decode_attention`` are C++ ops whose libraries :mod:`model_families.native` loads when
this module is imported), ``warmserve::grouped_experts`` (the
routed experts of an MoE layer) and ``warmserve::index_topk`` (DeepSeek V4's indexer picks, each
row cut to its own length), and :func:`tracing`, which picks the traced path. The KV
write op is :mod:`model_families.kv_write`. Loading a compiled program that calls these ops
needs them registered: import this module first. See ``docs/architecture.md`` §7, §9.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from model_families import native
from model_families.prepack import onednn_linear
from model_families.quantized_weights import int4_matmul, int4_tiles_matmul


def tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` flows through a trace (Dynamo compiling this code, or ``torch.export``
    tracing it) rather than eager execution. ``torch.compiler.is_exporting()`` alone is a
    process-wide flag, true in every thread while any thread exports; a runner that serves eager
    while its programs compile in the background (``EngineConfig.background_compile``) must not
    take the traced path, so an export also needs ``t`` to be a fake tensor."""
    return torch.compiler.is_dynamo_compiling() or (torch.compiler.is_exporting() and is_fake(t))



#: ``torch.ops.warmserve.linear``, defined with the low-level ``torch.library.Library`` rather than
#: ``torch.library.custom_op``: the latter wraps the kernel in Dynamo's ``disable``, whose
#: ``fx_traceback.annotate`` edits process-wide tracing metadata on every call, so a compiled
#: program calling it while another thread compiles (``EngineConfig.background_compile``) failed
#: with ``KeyError: 'custom'``. This kernel is called straight from the dispatcher.
_LIB = torch.library.Library("warmserve", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N])`` -> [M, N] in ``x``'s dtype, on the prepacked
    copy of ``weight`` when :class:`~model_families.prepack.PackedMatrices` holds one: the call an
    exported program makes for every :func:`~model_families.linear.float_linear` (register this
    op, i.e. import this module, before loading such a program)."""
    return onednn_linear(x, weight, bias)


_LIB.impl("linear", _linear_kernel, "CPU")


@torch.library.register_fake("warmserve::linear", lib=_LIB)
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


_LIB.define("int4_linear(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor")


def _int4_linear_kernel(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                        scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16 / f16) times an int4 matrix (``packed`` uint8 [N, K/2], CPU int4pack
    layout; ``scales_and_zeros`` [K/group_size, N, 2]) -> [M, N] in ``x``'s dtype:
    :func:`~model_families.quantized_weights.int4_matmul`, which picks PyTorch's
    ``_weight_int4pack_mm_for_cpu`` or a dense matmul by the row count at run time. The call a
    program makes where that choice is wanted (prefill, verify) and inside a loop body, where
    Inductor's own lowering of the aten kernel adds the group size as a tensor constant that AOTI's
    C++ wrapper of a ``while_loop`` body does not declare (the C++ does not compile, torch 2.13)."""
    return int4_matmul(x, packed, group_size, scales_and_zeros)


_LIB.impl("int4_linear", _int4_linear_kernel, "CPU")


@torch.library.register_fake("warmserve::int4_linear", lib=_LIB)
def _int4_linear_fake(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                      scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], scales_and_zeros.shape[1]))


_LIB.define("int4_tiles_linear(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor")


def _int4_tiles_linear_kernel(x: torch.Tensor, tiles: torch.Tensor, group_size: int,
                              scales_zeros: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16) times an int4 matrix in warmserve's tile layout (``tiles`` uint8
    ``[N/16, K/8, 64]``, ``scales_zeros`` bf16 ``[N/16, K/group_size, 2, 16]``) -> ``[M, N]``
    bf16: :func:`~model_families.quantized_weights.int4_tiles_matmul`, which picks
    ``warmserve::int4_mm_tiles`` or a dense matmul by the row count at run time (the call a
    prefill or verify program makes, as ``int4_linear`` for PyTorch's layout)."""
    return int4_tiles_matmul(x, tiles, group_size, scales_zeros)


_LIB.impl("int4_tiles_linear", _int4_tiles_linear_kernel, "CPU")


def _int4_tiles_fake(x: torch.Tensor, tiles: torch.Tensor, group_size: int,
                     scales_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], tiles.shape[0] * 16))


torch.library.register_fake("warmserve::int4_tiles_linear", _int4_tiles_fake, lib=_LIB)
if native.load():  # the C++ ops (model_families/kernels/): their shape rules for tracing
    torch.library.register_fake("warmserve::int4_mm_tiles", _int4_tiles_fake, lib=_LIB)
    torch.library.register_fake("warmserve::int4_mm_tiles_a8", _int4_tiles_fake, lib=_LIB)

    @torch.library.register_fake("warmserve::decode_attention", lib=_LIB)
    def _decode_attention_fake(q, k_pool, v_pool, block_tables, positions, seq_lens, k_new=None, v_new=None):
        return q.new_empty(q.shape)  # contiguous, as the kernel's


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



_LIB.define("index_topk(Tensor scores, Tensor lengths, Tensor closed, int k) -> Tensor")


def _index_topk_kernel(scores: torch.Tensor, lengths: torch.Tensor, closed: torch.Tensor, k: int) -> torch.Tensor:
    """Which entries each query of a sparse-attention indexer picks, as transformers'
    ``DeepseekV4Indexer`` picks them: ``topk(min(k, n))`` over the query's row cut to exactly
    ``n = lengths`` entries, those at or past ``closed`` set to ``-inf``, picks past ``closed``
    dropped (transformers scores the ``n`` entries its cache holds, masks those past the query's
    causal threshold and marks picks past it invalid).

    ``scores`` [..., E] float (E: the table's capacity, >= every length; entries past a row's
    length may hold anything); ``lengths``, ``closed`` [...] int64 (``closed <= lengths``);
    ``k`` >= 1. Returns bool [..., E].

    ``torch.topk`` (CPU: ``nth_element`` or ``partial_sort``) orders equal scores by the row's
    length and content, and the indexer's scores (sums of ReLUs) tie at exactly 0 with few
    indexer heads. Only a tie across the boundary (the k-th and the (k+1)-th largest closed
    scores equal) makes the picked *set* depend on that order, so: one batched top-``k + 1``
    over the capacity with unclosed entries masked (what a step did before), and the rows with
    such a tie redone on their exact length, one ``topk`` per distinct length among them."""
    E = scores.shape[-1]
    flat = scores.reshape(-1, E)
    lengths, closed = lengths.reshape(-1), closed.reshape(-1)
    ids = torch.arange(E, device=scores.device)
    ready = ids < closed[:, None]
    if E <= k:
        return ready.view(scores.shape)
    values, top = flat.masked_fill(~ready, float("-inf")).topk(k + 1, dim=-1)
    out = torch.zeros_like(ready).scatter_(-1, top[:, :k], True) & ready
    tied = (values[:, k - 1] == values[:, k]) & (closed > k)
    if not bool(tied.any()):
        return out.view(scores.shape)
    for n in torch.unique(lengths[tied]).tolist():
        rows = (tied & (lengths == n)).nonzero().squeeze(1)
        c = closed[rows, None]
        exact = flat[rows, :n].masked_fill(ids[:n] >= c, float("-inf")).topk(k, dim=-1).indices
        out[rows] = torch.zeros(rows.shape[0], E, dtype=torch.bool, device=scores.device).scatter_(-1, exact, exact < c)
    return out.view(scores.shape)


_LIB.impl("index_topk", _index_topk_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("warmserve::index_topk", lib=_LIB)
def _index_topk_fake(scores: torch.Tensor, lengths: torch.Tensor, closed: torch.Tensor, k: int) -> torch.Tensor:
    return scores.new_empty(scores.shape, dtype=torch.bool)


def index_topk(scores: torch.Tensor, lengths: torch.Tensor, closed: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's picks, bool [..., E] (:func:`_index_topk_kernel`: shapes, rule). Traced, the
    custom op ``torch.ops.warmserve.index_topk`` (grouping rows by a run-time length cannot be
    expressed in a graph); eagerly, the kernel itself."""
    if tracing(scores):
        return torch.ops.warmserve.index_topk(scores, lengths, closed, int(k))
    return _index_topk_kernel(scores, lengths, closed, int(k))
