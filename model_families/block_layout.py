"""Where a sequence's tokens live in its blocks: the one statement the block manager, the
decode buffers and the prefill batcher share (:meth:`model_families.family.ModelFamily.block_layout`).

:class:`BlockLayout` is the paged layout of vLLM and nano-vllm: block ``i`` of a sequence's block
table holds tokens ``[i * block_size, (i + 1) * block_size)``, so a sequence of ``n`` tokens
holds ``ceil(n / block_size)`` blocks and token ``p`` lives at slot
``block_table[p // block_size] * block_size + p % block_size``.

:class:`RingLayout` is for a model whose per-token rows are only read within a bounded
distance (a sliding window) while other pools grow slower than one row per token (compressed
entries, one per ``rate`` tokens): the first ``ring_blocks`` entries of the block table form a
ring, token ``p`` lives at ring slot ``p % (ring_blocks * block_size)`` (so blocks are reused as
the window slides), and the table grows further only as the slowest-growing pool needs it
(``entries_per_token``: the compressed pools' entries, ``floor(n / rate)`` for ``n`` tokens, each
pool indexed by entry through the same table). Every block id carries a row in every pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.errors import InvalidArgument


class BlockLayout:
    """The paged layout: one block per ``block_size`` tokens (see the module docstring)."""

    #: Positions ``p`` and ``p + slot_period`` of a sequence always share a slot (``None``:
    #: never, as in the paged layout). A position's block column is at most ``p // block_size``.
    slot_period: int | None = None

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: Sequence[int], position: int) -> int:
        """The slot of token ``position``: ``block_table[p // bs] * bs + p % bs``."""
        bs = self.block_size
        return block_table[position // bs] * bs + position % bs

    def max_tokens(self, num_blocks: int) -> int:
        """The most tokens ``num_blocks`` blocks hold (the inverse of :meth:`blocks_needed`)."""
        return num_blocks * self.block_size

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`slot` for a block table [nb] (int64) and positions [n] (int64) -> [n]."""
        bs = self.block_size
        return block_table[positions // bs] * bs + positions % bs

    def row_slots(self, block_tables: Sequence[Sequence[int]], positions: Sequence[int]) -> list[int]:
        """:meth:`slot` of each row's position in that row's block table (the Python form of
        :meth:`slots_np`, cheaper for a few dozen rows)."""
        bs = self.block_size
        return [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions, strict=True)]

    def slots_np(self, block_tables: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """:meth:`slot` of row ``i`` for C-contiguous block tables [n, nb] (int64) and positions
        [n] or [n, S] (int64), vectorised -> positions' shape: ``block_tables[i, p_i // bs] * bs
        + p_i % bs``; a single row [1, nb] serves any number of positions [m]."""
        bs = self.block_size
        return self._gather(block_tables, positions // bs) * bs + positions % bs

    @staticmethod
    def _gather(block_tables: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``block_tables[i, cols[i]]`` for each row ``i``, ``cols`` [n] or [n, S] (one flat ``take``)."""
        rows, width = block_tables.shape
        starts = np.arange(0, rows * width, width)
        return block_tables.ravel().take((starts if cols.ndim == 1 else starts[:, None]) + cols)

    def describe(self) -> dict:
        """The layout as plain JSON-able facts (it enters compiled programs' fingerprints)."""
        return {"kind": "paged", "block_size": self.block_size}


class RingLayout(BlockLayout):
    """The first ``ring_blocks`` blocks form a ring of ``ring_blocks * block_size`` token slots;
    the table also covers ``floor(n / rate)`` entries of each compressed pool per ``rate`` in
    ``rates`` (see the module docstring). ``max_model_len`` bounds :meth:`max_tokens`."""

    def __init__(self, block_size: int, ring_blocks: int, rates: Sequence[int], max_model_len: int) -> None:
        super().__init__(block_size)
        if ring_blocks < 1 or any(r < 1 for r in rates):
            raise InvalidArgument(f"a ring layout needs ring_blocks >= 1 and rates >= 1, got {ring_blocks}, {rates}")
        self.ring_blocks = ring_blocks
        self.ring_tokens = ring_blocks * block_size
        self.slot_period = self.ring_tokens
        self.rates = tuple(rates)
        self.max_model_len = max_model_len

    def blocks_needed(self, num_tokens: int) -> int:
        """``max(min(ceil(n / bs), ring_blocks), ceil(floor(n / rate) / bs) for each rate)``."""
        bs = self.block_size
        ring = min(-(-num_tokens // bs), self.ring_blocks)
        return max([ring, *(-(-(num_tokens // r) // bs) for r in self.rates)])

    def slot(self, block_table: Sequence[int], position: int) -> int:
        """The ring slot of token ``position``: ``block_table[(p // bs) % ring_blocks] * bs + p % bs``."""
        bs = self.block_size
        return block_table[(position // bs) % self.ring_blocks] * bs + position % bs

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`slot` for a block table [nb] (int64) and positions [n] (int64) -> [n]."""
        bs = self.block_size
        return block_table[(positions // bs) % self.ring_blocks] * bs + positions % bs

    def row_slots(self, block_tables: Sequence[Sequence[int]], positions: Sequence[int]) -> list[int]:
        """:meth:`slot` of each row's position in that row's block table (the Python form of
        :meth:`slots_np`, cheaper for a few dozen rows)."""
        bs, rb = self.block_size, self.ring_blocks
        return [t[(p // bs) % rb] * bs + p % bs for t, p in zip(block_tables, positions, strict=True)]

    def slots_np(self, block_tables: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """:meth:`slot` of row ``i`` for C-contiguous block tables [n, nb] (int64) and positions
        [n] (int64), vectorised -> [n]: ``block_tables[i, (p_i // bs) % ring_blocks] * bs + p_i % bs``;
        a single row [1, nb] serves any number of positions."""
        bs = self.block_size
        return self._gather(block_tables, positions // bs % self.ring_blocks) * bs + positions % bs

    def describe(self) -> dict:
        """The layout as plain JSON-able facts (it enters compiled programs' fingerprints)."""
        return {"kind": "ring", "block_size": self.block_size, "ring_blocks": self.ring_blocks,
                "rates": list(self.rates)}

    def max_tokens(self, num_blocks: int) -> int:
        """The most tokens (up to ``max_model_len``) whose :meth:`blocks_needed` is at most
        ``num_blocks`` (``blocks_needed`` grows with the tokens; found by bisection)."""
        if self.blocks_needed(self.max_model_len) <= num_blocks:
            return self.max_model_len
        lo, hi = 0, self.max_model_len  # blocks_needed(lo) <= num_blocks < blocks_needed(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.blocks_needed(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid
        return lo
