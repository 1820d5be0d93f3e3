"""Persistent decode buffers and the static-metadata (block-table) cache.

Allocated once for ``max_num_seqs`` rows; a decode step writes only its active rows (rows
``0 .. n-1``, the *active prefix*), so the tensors the model reads keep their storage
(``data_ptr``) for the life of the runner and a compiled program can be fed the same inputs
every step. Rows ``n ..`` are *padding*: token 0 at position 0, slot 0 and every block-table
entry pointing at the scratch block, so a padded batch bucket computes harmlessly.

Block-table rows are the expensive part of the metadata (``max_blocks_per_seq`` ids each), so
each row remembers the block ids it holds (the cache key: the row's padded block ids); a row is
rebuilt only when its key changes — a sequence moved into the row, or grew a block. Counting
calls of :meth:`DecodeBuffers._build_row` (``row_builds``) shows this in the tests.

All buffers are int64 (indexing and ``index_copy_`` take int64):

====================  ===================================  ========================================
buffer                shape                                 row ``i`` of a decode step
====================  ===================================  ========================================
``input_ids``         [max_num_seqs]                        last token of the sequence
``positions``         [max_num_seqs]                        its position (``num_tokens - 1``)
``slot_mapping``      [max_num_seqs]                        KV slot of that position
``block_tables``      [max_num_seqs, max_blocks_per_seq]    block ids, then scratch (0)
``seq_lens``          [max_num_seqs]                        context length (``position + 1``)
``logits_indices``    [max_num_seqs]                        row whose logits come ``i``-th (``i``)
====================  ===================================  ========================================

On an accelerator the rows are written into host mirrors (pinned on CUDA) and the active prefix is copied
to the device tensors with ``non_blocking=True``; on the CPU the mirrors are the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from model_families.block_layout import BlockLayout
from runner_service.kv_cache import SCRATCH_BLOCK
from services.errors import InvalidArgument

_NAMES = ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")

#: The block-table cache key of a padding row (no blocks: every entry is the scratch block).
_PADDING_KEY: list[int] = []


class DecodeBuffers:
    """The persistent decode inputs for up to ``max_num_seqs`` rows (see the module docstring)."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu", layout: BlockLayout | None = None) -> None:
        if max_num_seqs < 1 or max_blocks_per_seq < 1 or block_size < 1 or num_blocks < 2:
            raise InvalidArgument("decode buffers need max_num_seqs, max_blocks_per_seq, block_size >= 1 "
                                  "and num_blocks >= 2")
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        #: Where a position's slot is in a block table (the family's block layout).
        self.layout = layout or BlockLayout(block_size)
        self.row_builds = 0
        self._allocate()

    def _allocate(self) -> None:
        n, m = self.max_num_seqs, self.max_blocks_per_seq
        on_host = self.device.type == "cpu"
        pin = not on_host and torch.cuda.is_available() and self.device.type == "cuda"

        def host(*shape):
            return torch.zeros(shape, dtype=torch.int64, pin_memory=pin)

        self._host = {name: host(n) for name in _NAMES}
        self._host["block_tables"] = host(n, m)
        self._np = {name: t.numpy() for name, t in self._host.items()}
        if on_host:
            self._dev = self._host
        else:
            self._dev = {name: torch.zeros_like(t, device=self.device) for name, t in self._host.items()}
        self._row_keys: list[list[int]] = [_PADDING_KEY] * n
        self.num_active = 0
        self._set_padding(0, n)
        self._np["logits_indices"][:] = range(n)
        self._copy_to_device(n)

    # -- public ------------------------------------------------------------------------------

    @property
    def input_ids(self) -> torch.Tensor:
        return self._dev["input_ids"]

    @property
    def positions(self) -> torch.Tensor:
        return self._dev["positions"]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self._dev["slot_mapping"]

    @property
    def block_tables(self) -> torch.Tensor:
        return self._dev["block_tables"]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._dev["seq_lens"]

    @property
    def logits_indices(self) -> torch.Tensor:
        return self._dev["logits_indices"]

    def fill(self, tokens: Seq[int], positions: Seq[int], block_tables: Seq[Seq[int]]) -> int:
        """Write the active prefix: row ``i`` gets ``tokens[i]`` at ``positions[i]`` with block
        list ``block_tables[i]``; rows that were active before and are not now become padding.

        Everything is validated before any buffer is touched; raises ``InvalidArgument`` for more
        rows than ``max_num_seqs``, a block list longer than ``max_blocks_per_seq``, a block id
        outside ``[1, num_blocks)``, or a position outside the row's blocks. Returns the number
        of active rows.
        """
        n = len(tokens)
        if len(positions) != n or len(block_tables) != n:
            raise InvalidArgument(f"decode rows disagree: {n} tokens, {len(positions)} positions, "
                                  f"{len(block_tables)} block tables")
        if n > self.max_num_seqs:
            raise InvalidArgument(f"{n} decode rows exceed the {self.max_num_seqs} allocated")
        m, keys, layout = self.max_blocks_per_seq, self._row_keys, self.layout
        changed = []
        slots = []
        for i in range(n):
            blocks, pos = block_tables[i], positions[i]
            if len(blocks) > m:
                raise InvalidArgument(f"row {i}: {len(blocks)} blocks exceed max_blocks_per_seq {m}")
            if pos < 0 or layout.blocks_needed(pos + 1) > len(blocks):
                raise InvalidArgument(f"row {i}: position {pos} is outside its {len(blocks)} blocks")
            if blocks != keys[i]:
                # Block ids are checked when a row is (re)built; unchanged rows were checked then.
                if not (0 < min(blocks) and max(blocks) < self.num_blocks):
                    raise InvalidArgument(f"row {i}: block ids must be in [1, {self.num_blocks})")
                changed.append(i)
            slots.append(layout.slot(blocks, pos))
        self._np["input_ids"][:n] = tokens
        self._np["positions"][:n] = positions
        self._np["slot_mapping"][:n] = slots
        self._np["seq_lens"][:n] = [p + 1 for p in positions]
        for i in changed:
            self._build_row(i, block_tables[i])
        if n < self.num_active:
            self._set_padding(n, self.num_active)
        copied = max(n, self.num_active)
        self.num_active = n
        self._copy_to_device(copied)
        return n

    def order_logits(self, rows: Seq[int]) -> None:
        """Make the first ``len(rows)`` entries of ``logits_indices`` equal ``rows``: the step's
        logits are then gathered in that order (e.g. the scheduler's order rather than the row
        order). Raises ``InvalidArgument`` unless ``rows`` is a permutation of the active rows."""
        if sorted(rows) != list(range(self.num_active)):
            raise InvalidArgument(f"logits order {list(rows)} is not a permutation of the {self.num_active} active rows")
        self._np["logits_indices"][: len(rows)] = rows
        self._copy_to_device(len(rows))

    def views(self, batch: int, num_blocks: int) -> tuple[torch.Tensor, ...]:
        """The first ``batch`` rows as ``(input_ids [B], positions [B], slot_mapping [B],
        block_tables [B, num_blocks], seq_lens [B])`` — views, no copies. Raises
        ``InvalidArgument`` when ``batch`` or ``num_blocks`` is out of range."""
        if not self.num_active <= batch <= self.max_num_seqs:
            raise InvalidArgument(f"batch {batch} must be in [{self.num_active}, {self.max_num_seqs}]")
        if not 1 <= num_blocks <= self.max_blocks_per_seq:
            raise InvalidArgument(f"num_blocks {num_blocks} must be in [1, {self.max_blocks_per_seq}]")
        d = self._dev
        return (d["input_ids"][:batch], d["positions"][:batch], d["slot_mapping"][:batch],
                d["block_tables"][:batch, :num_blocks], d["seq_lens"][:batch])

    def max_active_blocks(self) -> int:
        """Most blocks held by an active row (1 when none is active)."""
        return max([len(k) for k in self._row_keys[: self.num_active]] or [1]) or 1

    def reset(self) -> None:
        """Recreate the buffers and clear the block-table cache together."""
        self._allocate()

    def close(self) -> None:
        """Drop the buffers and the cache together; :meth:`reset` makes them usable again."""
        self._host, self._dev, self._np = {}, {}, {}
        self._row_keys = []
        self.num_active = 0

    # -- internals ---------------------------------------------------------------------------

    def _build_row(self, row: int, blocks: Seq[int]) -> None:
        """Rewrite block-table row ``row`` as ``blocks`` followed by scratch entries; the row's
        cache key becomes a copy of ``blocks``."""
        self.row_builds += 1
        bt = self._np["block_tables"][row]
        bt[: len(blocks)] = blocks
        bt[len(blocks):] = SCRATCH_BLOCK
        self._row_keys[row] = list(blocks)

    def _set_padding(self, start: int, stop: int) -> None:
        for name in ("input_ids", "positions", "slot_mapping"):
            self._np[name][start:stop] = 0  # token 0 at position 0 in scratch slot 0
        self._np["seq_lens"][start:stop] = 1
        for row in range(start, stop):
            if self._row_keys[row] != _PADDING_KEY:
                self._build_row(row, _PADDING_KEY)

    def _copy_to_device(self, rows: int) -> None:
        if self._dev is self._host or rows == 0:
            return
        for name, t in self._host.items():
            self._dev[name][:rows].copy_(t[:rows], non_blocking=True)
