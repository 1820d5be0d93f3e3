"""Example inputs and ``torch.export`` dynamic-shape specs of the decode, prefill and verify programs
(``docs/architecture.md`` §9)."""

from __future__ import annotations

import torch

from runner_service.options import MAX_PROGRAM_BATCH
from runner_service.programs.spec import ProgramSpec


def example_inputs(spec: ProgramSpec) -> tuple:
    """Decode inputs of 2 padding rows (the batch dim is dynamic; export specialises 0 and 1):
    every slot and block id is the scratch block 0, ``seq_lens`` 1; the KV pools are the runner's.
    The block-table width is 2 where that dim is dynamic, else 1."""
    batch, blocks = 2, min(2, spec.max_blocks_per_seq)
    zeros = torch.zeros(batch, dtype=torch.int64, device=spec.device)
    return (spec.pools, zeros, zeros.clone(), zeros.clone(),
            torch.zeros((batch, blocks), dtype=torch.int64, device=spec.device), torch.ones_like(zeros))


def _shared_dims(spec: ProgramSpec) -> tuple[tuple, object, object]:
    """The dims both programs share: the pools' spec (every pool's block count, one dim), the
    batch (1 .. :data:`~runner_service.options.MAX_PROGRAM_BATCH`, whatever the runner's
    ``max_num_seqs``: the bound is only the program's shape check, so runners that differ in it
    share the program) and the block-table width (``None`` when ``max_blocks_per_seq`` is 1)."""
    Dim = torch.export.Dim
    pool = {1: Dim("num_blocks", min=2)}
    batch = Dim("batch", min=1, max=MAX_PROGRAM_BATCH)
    blocks = Dim("blocks", min=1, max=spec.max_blocks_per_seq) if spec.max_blocks_per_seq >= 2 else None
    return tuple(pool for _ in spec.pools), batch, blocks


def _dims(*dims: tuple[int, object]) -> dict | None:
    """A tensor's dynamic-shape spec from ``(axis, dim)`` pairs, leaving out ``None`` dims."""
    return {axis: d for axis, d in dims if d is not None} or None


def dynamic_shapes(spec: ProgramSpec) -> tuple:
    """``torch.export`` dynamic-shape spec for the decode module: every pool's block count (one
    shared dim), the batch and the block-table width (when ``max_blocks_per_seq`` >= 2)."""
    pools, batch, blocks = _shared_dims(spec)
    row = _dims((0, batch))
    return (pools, row, row, row, _dims((0, batch), (1, blocks)), row)


def prefill_example_inputs(spec: ProgramSpec) -> tuple:
    """Prefill inputs (:meth:`FamilyModel.forward`) of 2 padding rows of 2 tokens over 2
    block-table entries (export specialises sizes 0 and 1): every slot and block id is the
    scratch block 0; the KV pools are the runner's."""
    dev = spec.device
    B, S, nb = 2, 2, min(2, spec.max_blocks_per_seq)
    tokens = torch.zeros((B, S), dtype=torch.int64, device=dev)
    rows = torch.zeros(B, dtype=torch.int64, device=dev)
    return (spec.pools, tokens, tokens.clone(), tokens.clone(),
            torch.zeros((B, nb), dtype=torch.int64, device=dev), rows + 1, rows)


def prefill_dynamic_shapes(spec: ProgramSpec) -> tuple:
    """``torch.export`` dynamic-shape spec for the prefill forward: the pools' block count, the
    batch (as decode's), the tokens per row (2 .. ``max_prefill_tokens``; a one-token chunk is
    padded to 2, see :meth:`ModelRunner.run_prefill`) and the block-table width (when
    ``max_blocks_per_seq`` >= 2)."""
    pools, batch, blocks = _shared_dims(spec)
    tokens = torch.export.Dim("tokens", min=2, max=max(2, spec.max_prefill_tokens))
    grid, row = _dims((0, batch), (1, tokens)), _dims((0, batch))
    return (pools, grid, grid, grid, _dims((0, batch), (1, blocks)), row, row)


def verify_example_inputs(spec: ProgramSpec) -> tuple:
    """Verify inputs (:class:`~model_families.family.VerifyStep`) of 2 padding rows of 2 tokens
    (the last token and one draft) over 2 block-table entries: :func:`prefill_example_inputs`
    without ``last_index``."""
    return prefill_example_inputs(spec)[:-1]


def verify_dynamic_shapes(spec: ProgramSpec) -> tuple:
    """``torch.export`` dynamic-shape spec for the verify step: as prefill's, the tokens per row
    2 .. ``1 + num_draft_tokens`` (a step verifies only rows' drafts, so at least 2; static 2 when
    ``num_draft_tokens`` is 1, the least a dynamic dim allows being 2 .. 3)."""
    pools, batch, blocks = _shared_dims(spec)
    top = 1 + spec.num_draft_tokens
    tokens = torch.export.Dim("tokens", min=2, max=top) if top > 2 else None
    grid, row = _dims((0, batch), (1, tokens)), _dims((0, batch))
    return (pools, grid, grid, grid, _dims((0, batch), (1, blocks)), row)
