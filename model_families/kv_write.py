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
this module first (:mod:`model_families.ops` and :mod:`runner_service.programs` do).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("warmserve::kv_write_", mutates_args=("cache",))
def kv_write_(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` into layer ``layer`` of the pool ``cache`` at ``slots``, in place.

    ``cache`` [L, num_blocks, block_size, *row] (compute dtype, contiguous; Llama's row is
    ``(nkv, hd)``); ``slots`` [T] int64 slot ids (``block_id * block_size + offset``, each
    < ``num_blocks * block_size``); ``values`` [T, *row] in ``cache``'s dtype. Same semantics as
    ``cache[layer].view(-1, *row).index_copy_(0, slots, values)``; raises ``IndexError`` /
    ``RuntimeError`` from ``index_copy_`` for an out-of-range slot.
    """
    cache[layer].view(-1, *cache.shape[3:]).index_copy_(0, slots, values)


@kv_write_.register_fake
def _kv_write_fake(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    return None
