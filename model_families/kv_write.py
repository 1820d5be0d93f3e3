"""The paged-KV write as a custom op: ``torch.ops.warmserve.kv_write_``.

Why an op and not ``index_copy_`` inline: when a step that writes the KV pool in place is
compiled (``torch.export`` + AOTInductor, or ``torch.compile``), functionalization turns the
in-place write into "copy the pool, scatter into the copy, copy it back", and Inductor's
re-inplacing pass does not undo that for a layer slice of a graph input, so every compiled step
would copy the whole K and V pools. A custom op that declares ``mutates_args=("cache",)`` is
kept as one opaque in-place call on the caller's tensor (Inductor re-inplaces
``auto_functionalized`` ops), so the compiled step writes ``B`` rows and no more (measured
effect: ``docs/benchmarks.md``).

Loading an AOTInductor package that calls this op needs the op registered in the process: import
this module first (the families and :mod:`runner_service.programs` do). :func:`write_kv` picks
the op or a plain ``index_copy_``; :func:`write_kv_rows` writes a decode step's returned rows.
"""

from __future__ import annotations

import torch

from model_families.custom_ops import tracing

#: ``torch.ops.warmserve.kv_write_``, defined with the low-level ``torch.library.Library`` (as
#: ``warmserve::linear``, :mod:`model_families.custom_ops`) rather than ``torch.library.custom_op``,
#: which wraps the kernel in Dynamo's lazy ``disable``: its first call imports ``torch._dynamo``
#: (about 1.2 s of CPU), so a warm runner's first compiled prefill paid that import, and every
#: call edits process-wide fx tracing metadata. The schema is the one ``custom_op`` made
#: (``cache`` mutated: ``Tensor(a!)``), so export still functionalizes it into one in-place call.
_LIB = torch.library.Library("warmserve", "FRAGMENT")
_LIB.define("kv_write_(Tensor(a0!) cache, SymInt layer, Tensor slots, Tensor values) -> ()")


def kv_write_(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` into layer ``layer`` of the pool ``cache`` at ``slots``, in place.

    ``cache`` [L, num_blocks, block_size, *row] (compute dtype, contiguous; Llama's row is
    ``(nkv, hd)``); ``slots`` [T] int64 slot ids (``block_id * block_size + offset``, each
    < ``num_blocks * block_size``); ``values`` [T, *row] in ``cache``'s dtype. Same semantics as
    ``cache[layer].view(-1, *row).index_copy_(0, slots, values)``; raises ``IndexError`` /
    ``RuntimeError`` from ``index_copy_`` for an out-of-range slot.
    """
    cache[layer].view(-1, *cache.shape[3:]).index_copy_(0, slots, values)


_LIB.impl("kv_write_", kv_write_, "CompositeExplicitAutograd")


@torch.library.register_fake("warmserve::kv_write_", lib=_LIB)
def _kv_write_fake(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    return None


def write_kv(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[layer]`` slots ``slots`` [T] (int64) <- ``values`` [T, *row_shape], in place
    (``cache`` [layers, num_blocks, block_size, *row_shape]).

    Eager: a plain ``index_copy_``. Under ``torch.compile`` / ``torch.export``: the
    ``warmserve::kv_write_`` custom op (:func:`kv_write_`), which compilers keep as
    one in-place call instead of copying the whole pool; eagerly the op's dispatch costs more
    than the copy, so it is used only when compiling.
    """
    if tracing(values):
        torch.ops.warmserve.kv_write_(cache, layer, slots, values)
    else:
        cache[layer].view(-1, *cache.shape[3:]).index_copy_(0, slots, values)


def write_kv_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write a decode step's rows into every layer of a pool, in place: ``cache`` [layers,
    num_blocks, block_size, *row_shape], ``slots`` [B] int64, ``rows`` [layers, B, *row_shape]
    (row ``b`` of layer ``l`` goes to slot ``slots[b]`` of layer ``l``). One ``index_copy_`` for
    all layers; runs outside the compiled decode program (see :meth:`FamilyModel.decode
    <model_families.family.FamilyModel.decode>`)."""
    cache.view(cache.shape[0], -1, *cache.shape[3:]).index_copy_(1, slots, rows)
