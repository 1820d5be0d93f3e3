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

With speculative decoding (``max_draft_tokens`` ``K`` > 0) a verify step feeds each active row
``1 + k`` tokens (its last token, then its ``k <= K`` draft tokens) through four more buffers
(:meth:`DecodeBuffers.fill_verify`); the block tables are the decode ones (same rows, same cache).
The three grids are flat, ``max_num_seqs * (1 + K)`` entries: a step of ``n`` rows and width
``S = 1 + max(k)`` uses the first ``n * S`` as an ``[n, S]`` row-major grid, so the step's
inputs are contiguous views (what a compiled program needs) with no copy:

====================  ===================================  ========================================
``verify_ids``        [n, S] of [max_num_seqs * (1 + K)]    last token, drafts, then padding (0)
``verify_positions``  [n, S] of [max_num_seqs * (1 + K)]    ``p .. p + k``, then 0
``verify_slots``      [n, S] of [max_num_seqs * (1 + K)]    their KV slots, then scratch slot 0
``verify_lens``       [max_num_seqs]                        context length after the step (``p + 1 + k``)
====================  ===================================  ========================================

On an accelerator the rows are written into host mirrors (pinned on CUDA) and the active prefix is copied
to the device tensors with ``non_blocking=True``; on the CPU the mirrors are the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import compress
from operator import ge, ne

import numpy as np
import torch

from model_families.block_layout import BlockLayout
from runner_service.kv_cache import SCRATCH_BLOCK
from services.errors import InvalidArgument

_NAMES = ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")
#: The verify step's flat grids ``[max_num_seqs * (1 + K)]`` (allocated when ``max_draft_tokens`` > 0).
_VERIFY_GRIDS = ("verify_ids", "verify_positions", "verify_slots")

#: The block-table cache key of a padding row (no blocks: every entry is the scratch block).
_PADDING_KEY: list[int] = []

#: Up to this many active rows, slots are computed from the block lists in Python
#: (``layout.row_slots``); above it, vectorised from the block-table buffer (``layout.slots_np``),
#: whose fixed cost of a few numpy calls is then the smaller (about 40 rows on a 2-core CPU).
_PYTHON_SLOT_ROWS = 40



def write_block_table_row(row: np.ndarray, old: Seq[int], blocks: Seq[int]) -> None:
    """Rewrite the block-table row ``row`` (int64 ``[max_blocks_per_seq]``, holding ``old`` then
    scratch entries) to hold ``blocks`` then scratch entries: only the new entries when
    ``blocks`` extends ``old`` (a sequence grew a block), else ``blocks`` and the scratch block
    over what is left of ``old``."""
    n, n_old = len(blocks), len(old)
    if n >= n_old and blocks[:n_old] == old:
        row[n_old:n] = blocks[n_old:]
    else:
        row[:n] = blocks
        row[n:n_old] = SCRATCH_BLOCK

class DecodeBuffers:
    """The persistent decode inputs for up to ``max_num_seqs`` rows (see the module docstring);
    with ``max_draft_tokens`` > 0 also the verify step's."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu", layout: BlockLayout | None = None,
                 max_draft_tokens: int = 0) -> None:
        if max_num_seqs < 1 or max_blocks_per_seq < 1 or block_size < 1 or num_blocks < 2 or max_draft_tokens < 0:
            raise InvalidArgument("decode buffers need max_num_seqs, max_blocks_per_seq, block_size >= 1, "
                                  "num_blocks >= 2 and max_draft_tokens >= 0")
        self.max_draft_tokens = max_draft_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        #: Where a position's slot is in a block table (the family's block layout).
        self.layout = layout or BlockLayout(block_size)
        self.row_builds = 0
        self._limit_of: dict[int, int] = {}
        self._allocate()

    def _allocate(self) -> None:
        n, m = self.max_num_seqs, self.max_blocks_per_seq
        on_host = self.device.type == "cpu"
        pin = not on_host and torch.cuda.is_available() and self.device.type == "cuda"

        def host(*shape):
            return torch.zeros(shape, dtype=torch.int64, pin_memory=pin)

        self._host = {name: host(n) for name in _NAMES}
        self._host["block_tables"] = host(n, m)
        if self.max_draft_tokens:
            self._host.update({name: host(n * (1 + self.max_draft_tokens)) for name in _VERIFY_GRIDS})
            self._host["verify_lens"] = host(n)
            #: Column index of the verify grid, and the step's columns-in-use mask (scratch).
            self._verify_cols = np.arange(1 + self.max_draft_tokens, dtype=np.int64)
            self._verify_valid = np.zeros((n, 1 + self.max_draft_tokens), dtype=bool)
            self._verify_drafts = np.zeros(n, dtype=np.int64)
        self._np = {name: t.numpy() for name, t in self._host.items()}
        period = self.layout.slot_period
        #: Per row, the slot of each position modulo the layout's ``slot_period`` (a ring
        #: layout: a position's slot is one lookup); ``None`` for a layout without a period.
        self._period_slots = None if period is None else np.zeros((n, period), dtype=np.int64)
        self._period_flat = None if period is None else self._period_slots.ravel()
        self._period_positions = None if period is None else np.arange(period, dtype=np.int64)
        if on_host:
            self._dev = self._host
        else:
            self._dev = {name: torch.zeros_like(t, device=self.device) for name, t in self._host.items()}
        self._row_keys: list[list[int]] = [_PADDING_KEY] * n
        #: Per row, the most tokens its cached blocks hold (``layout.max_tokens``): a position
        #: below it is in the row's blocks (one compare per row and step).
        self._row_limits: list[int] = [self._max_tokens(0)] * n
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._verify_width = 1
        self._prefixes: dict[int, tuple[np.ndarray, ...]] = {}
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
        keys, limits = self._row_keys, self._row_limits
        # Rows whose block list differs from the cached one (none, the common step: one C-level
        # compare of the whole batch). Only those are validated and rebuilt; every other row
        # was validated when it was built, and its block-table row equals its block list.
        if type(block_tables) is list and block_tables == keys[:n]:
            changed = ()
        else:
            changed = list(compress(range(n), map(ne, block_tables, keys)))
            if changed:
                limits = limits[:n]
                m, num_blocks, limit_of = self.max_blocks_per_seq, self.num_blocks, self._limit_of
                for i in changed:  # block ids are checked when a row is (re)built
                    blocks = block_tables[i]
                    if len(blocks) > m:
                        raise InvalidArgument(f"row {i}: {len(blocks)} blocks exceed max_blocks_per_seq {m}")
                    if blocks and not (0 < min(blocks) and max(blocks) < num_blocks):
                        raise InvalidArgument(f"row {i}: block ids must be in [1, {num_blocks})")
                    limit = limit_of.get(len(blocks))
                    limits[i] = self._max_tokens(len(blocks)) if limit is None else limit
        if n and (min(positions) < 0 or any(map(ge, positions, limits))):
            self._check_positions(positions, block_tables, limits)
        prefix = self._prefixes.get(n) or self._prefix(n)
        ids, pos, lens, slots, tables, tmp, offsets = prefix
        ids[:] = tokens
        pos[:] = positions
        np.add(pos, 1, out=lens)
        for i in changed:
            self._build_row(i, block_tables[i], limits[i])
        if self._period_slots is not None:  # a periodic layout: one lookup per row
            np.remainder(pos, self.layout.slot_period, out=tmp)
            tmp += offsets
            self._period_flat.take(tmp, out=slots)
        elif n <= _PYTHON_SLOT_ROWS:
            slots[:] = self.layout.row_slots(block_tables, positions)
        else:  # rows 0 .. n-1 of the block-table buffer now hold exactly ``block_tables``
            slots[:] = self.layout.slots_np(tables, pos)
        if n < self.num_active:
            self._set_padding(n, self.num_active)
        copied = max(n, self.num_active)
        self.num_active = n
        self._copy_to_device(copied)
        return n

    def fill_verify(self, tokens: Seq[int], positions: Seq[int], block_tables: Seq[Seq[int]],
                    drafts: Seq[Seq[int]]) -> int:
        """Write a verify step's active prefix: :meth:`fill` for the rows' block tables, then
        row ``i`` of the verify grids gets ``tokens[i]`` at ``positions[i]`` followed by the
        ``k_i = len(drafts[i])`` draft tokens at the next positions; entries past ``k_i`` are
        padding (token 0, position 0, the scratch slot); ``verify_lens[i]`` is
        ``positions[i] + 1 + k_i``. Validated before any buffer is touched: ``InvalidArgument``
        for what :meth:`fill` refuses, no verify buffers (``max_draft_tokens`` 0), more than
        ``max_draft_tokens`` drafts, a draft position outside the row's blocks or a negative
        draft id. Returns the number of active rows; the step's grid width is
        ``1 + max(k_i)`` (:meth:`verify_views`)."""
        if not self.max_draft_tokens:
            raise InvalidArgument("these decode buffers have no verify buffers (max_draft_tokens is 0)")
        n = len(tokens)
        if len(drafts) != n:
            raise InvalidArgument(f"verify rows disagree: {n} tokens, {len(drafts)} draft lists")
        K = self.max_draft_tokens
        for i, d in enumerate(drafts):
            k = len(d)
            if k > K:
                raise InvalidArgument(f"row {i}: {k} draft tokens exceed max_draft_tokens {K}")
            if k and (min(d) < 0 or i >= len(positions) or i >= len(block_tables)
                      or self.layout.blocks_needed(positions[i] + k + 1) > len(block_tables[i])):
                raise InvalidArgument(f"row {i}: its {k} draft tokens need ids >= 0 and positions "
                                      f"inside its blocks")
        self.fill(tokens, positions, block_tables)
        np_ = self._np
        ks = self._verify_drafts[:n]
        ks[:] = [len(d) for d in drafts]
        width = 1 + int(ks.max()) if n else 1
        cols = self._verify_cols[:width]
        valid = self._verify_valid[:n, :width]
        np.less_equal(cols[None, :], ks[:, None], out=valid)
        ids, pos, slots = (np_[name][:n * width].reshape(n, width) for name in _VERIFY_GRIDS)
        base = np_["positions"][:n]
        np.add(base[:, None], cols[None, :], out=pos)
        pos *= valid
        ids[:] = 0
        ids[:, 0] = tokens
        for i, d in enumerate(drafts):
            if d:
                ids[i, 1:1 + len(d)] = d
        slots[:] = self.layout.slots_np(np_["block_tables"][:n], pos)
        slots *= valid  # padding entries: the scratch slot 0
        np.add(base, 1 + ks, out=np_["verify_lens"][:n])
        self._verify_width = width
        self._copy_to_device(n)
        return n

    def verify_views(self) -> tuple[torch.Tensor, ...]:
        """The active rows of the last :meth:`fill_verify` as ``(input_ids [n, S], positions
        [n, S], slot_mapping [n, S], block_tables [n, nb], seq_lens [n])``, ``S`` its grid width,
        ``nb`` :meth:`max_active_blocks` (views, no copies; the grids contiguous). Only the
        active rows: the flat grids hold no padding rows at width ``S``. Raises
        ``InvalidArgument`` without verify buffers."""
        if not self.max_draft_tokens:
            raise InvalidArgument("these decode buffers have no verify buffers (max_draft_tokens is 0)")
        n = self.num_active
        key = ("verify", n, self._verify_width, self.max_active_blocks(), torch.is_inference_mode_enabled())
        views = self._views.get(key)  # made once per shape, as :meth:`views` does
        if views is None:
            d, S, nb = self._dev, key[2], key[3]
            views = self._views[key] = (*(d[name][:n * S].view(n, S) for name in _VERIFY_GRIDS),
                                        d["block_tables"][:n, :nb], d["verify_lens"][:n])
        return views

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
        # The views of a shape are made once per buffer allocation (slicing five tensors costs
        # more than the rest of a step's host work); inference mode is part of the key, as
        # views made inside it are flagged as such.
        key = (batch, num_blocks, torch.is_inference_mode_enabled())
        views = self._views.get(key)
        if views is None:
            d = self._dev
            views = self._views[key] = (d["input_ids"][:batch], d["positions"][:batch], d["slot_mapping"][:batch],
                                        d["block_tables"][:batch, :num_blocks], d["seq_lens"][:batch])
        return views

    def max_active_blocks(self) -> int:
        """Most blocks held by an active row (1 when none is active)."""
        return max([len(k) for k in self._row_keys[: self.num_active]] or [1]) or 1

    def reset(self) -> None:
        """Recreate the buffers and clear the block-table cache together."""
        self._allocate()

    def close(self) -> None:
        """Drop the buffers and the cache together; :meth:`reset` makes them usable again."""
        self._host, self._dev, self._np, self._period_slots, self._period_flat = {}, {}, {}, None, None
        self._row_keys, self._row_limits, self._views, self._prefixes = [], [], {}, {}
        self.num_active = 0

    # -- internals ---------------------------------------------------------------------------

    def _prefix(self, n: int) -> tuple[np.ndarray, ...]:
        """The host views of the first ``n`` rows a step writes: ``(input_ids, positions,
        seq_lens, slot_mapping, block_tables)``, then a scratch row of ``n`` and, for a periodic
        layout, each row's offset in the flattened period-slot table; made once per ``n`` and
        allocation."""
        np_, period = self._np, self.layout.slot_period
        views = tuple(np_[name][:n] for name in ("input_ids", "positions", "seq_lens", "slot_mapping", "block_tables"))
        offsets = None if period is None else np.arange(n, dtype=np.int64) * period
        views += (np.zeros(n, dtype=np.int64), offsets)
        self._prefixes[n] = views
        return views

    def _max_tokens(self, num_blocks: int) -> int:
        """``layout.max_tokens(num_blocks)``, memoised (a ring layout bisects for it)."""
        limit = self._limit_of.get(num_blocks)
        if limit is None:
            limit = self._limit_of[num_blocks] = self.layout.max_tokens(num_blocks)
        return limit

    def _check_positions(self, positions: Seq[int], block_tables: Seq[Seq[int]], limits: Seq[int]) -> None:
        """The slow path of the position check, taken when some position is negative or not
        below its row's limit: raises unless every position is in its row's blocks (a capped
        limit, e.g. a ring layout's ``max_model_len``, may be below what the blocks hold)."""
        for i, (pos, limit) in enumerate(zip(positions, limits, strict=False)):
            if pos < 0 or (pos >= limit and self.layout.blocks_needed(pos + 1) > len(block_tables[i])):
                raise InvalidArgument(f"row {i}: position {pos} is outside its {len(block_tables[i])} blocks")

    def _build_row(self, row: int, blocks: Seq[int], limit: int | None = None) -> None:
        """Rewrite block-table row ``row`` as ``blocks`` followed by scratch entries; the row's
        cache key becomes a copy of ``blocks`` and its limit ``limit`` (default: the most tokens
        the blocks hold). Only the entries that differ from the old key's are written when
        ``blocks`` extends it (a sequence grew a block), and a periodic layout's slot table only
        when the blocks it reaches changed."""
        self.row_builds += 1
        old, n, bt = self._row_keys[row], len(blocks), self._np["block_tables"][row]
        write_block_table_row(bt, old, blocks)
        self._row_keys[row] = list(blocks)
        self._row_limits[row] = self._max_tokens(n) if limit is None else limit
        period = self.layout.slot_period
        if period is not None:
            # Entry ``t`` is the slot of every position ``p`` with ``p % slot_period == t``; the
            # first ``k`` are those the blocks reach (a position's block column is at most
            # ``p // block_size``), the rest the scratch slot (no valid position maps there).
            reach = -(-period // self.block_size)
            if blocks[:reach] == old[:reach]:
                return  # the same reachable blocks (then also the same k): the same table
            k = min(period, n * self.block_size)
            table = self._period_slots[row]
            table[:k] = self.layout.slots_np(bt[None, :], self._period_positions[:k])
            table[k:] = 0

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
            m = rows * (1 + self.max_draft_tokens) if name in _VERIFY_GRIDS else rows  # flat grids: row-major
            self._dev[name][:m].copy_(t[:m], non_blocking=True)
