"""DeepSeek V4's caches: the pools, the ring of window blocks and the compressed entries' slots,
and the geometry of one step over them (:class:`Step`). See ``docs/deepseek_v4.md`` ("Caches").

Pools (every one ``[layers of its kind, num_blocks, block_size, width]``, one row per slot; the
block table is laid out by :class:`model_families.block_layout.RingLayout`):

=============  ===========  ===============================  ======================================
pool           layers       row width                        row ``s``
=============  ===========  ===============================  ======================================
``win``        all L        hd                               K=V of the token at ring slot ``s``
                                                             (after ``kv_norm`` and RoPE)
``csa_raw``    CSA layers   4·hd + 4·id                      that token's raw compressor inputs:
                                                             ``wkv·x`` (2hd), ``wgate·x`` (2hd),
                                                             indexer ``wkv·x`` (2id), ``wgate·x`` (2id)
``hca_raw``    HCA layers   2·hd                             ``wkv·x`` (hd), ``wgate·x`` (hd)
``csa_kv``     CSA layers   hd                               compressed entry ``e`` (entry slot)
``csa_ik``     CSA layers   id                               indexer key of entry ``e``
``hca_kv``     HCA layers   hd                               compressed entry ``e``
=============  ===========  ===============================  ======================================

Ring pools hold the last ``ring_tokens`` tokens (at least the window and one compressor span:
``max(W, 2m, m')``, plus one spare slot per speculative draft token), so the rolling compressor
state is simply the ring's raw rows. Compressed
entry ``e`` of a pool lives at slot ``block_table[e // bs] * bs + e % bs``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from model_families.block_layout import RingLayout
from model_families.custom_ops import tracing
from model_families.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from model_families.family import CacheSpec
from model_families.kv_write import write_kv


def ring_span(c: DeepseekV4Config) -> int:
    """Tokens a step must still find in the ring: the window ``W``, and one compressor span
    (``2m`` for CSA, whose entries overlap the previous window; ``m'`` for HCA)."""
    spans = [c.sliding_window]
    if c.layers_of(CSA):
        spans.append(2 * c.csa_compress_rate)
    if c.layers_of(HCA):
        spans.append(c.hca_compress_rate)
    return max(spans)


def ring_tokens(c: DeepseekV4Config, block_size: int, draft_tokens: int = 0) -> int:
    """The ring's length in token slots: :func:`ring_span` plus ``draft_tokens`` spare slots,
    rounded up to whole blocks. A verify step writes the ring rows of up to ``draft_tokens``
    tokens past what its row keeps (rejected drafts); the spare slots keep those writes off the
    rows the next step reads back, so rolling the drafts back needs only the shorter length."""
    return -(-(ring_span(c) + draft_tokens) // block_size) * block_size


def cache_specs(c: DeepseekV4Config, block_size: int) -> tuple[CacheSpec, ...]:
    """The pools of the module docstring, in order, those of absent layer kinds left out."""
    hd, idim = c.head_dim, c.index_head_dim
    n_csa, n_hca = len(c.layers_of(CSA)), len(c.layers_of(HCA))
    specs = [CacheSpec("win", c.num_hidden_layers, (block_size, hd))]
    if n_csa:
        specs += [CacheSpec("csa_raw", n_csa, (block_size, 4 * hd + 4 * idim)),
                  CacheSpec("csa_kv", n_csa, (block_size, hd)), CacheSpec("csa_ik", n_csa, (block_size, idim))]
    if n_hca:
        specs += [CacheSpec("hca_raw", n_hca, (block_size, 2 * hd)), CacheSpec("hca_kv", n_hca, (block_size, hd))]
    return tuple(specs)


def block_layout(c: DeepseekV4Config, block_size: int, max_model_len: int, draft_tokens: int = 0) -> RingLayout:
    """The block-table layout: a ring of :func:`ring_tokens` slots (``draft_tokens`` spare), and
    the compressed pools' entries (one per CSA / HCA rate tokens) through the same table."""
    rates = [c.csa_compress_rate] if c.layers_of(CSA) else []
    rates += [c.hca_compress_rate] if c.layers_of(HCA) else []
    return RingLayout(block_size, ring_tokens(c, block_size, draft_tokens) // block_size, rates, max_model_len)


def _ring_slots(block_tables: torch.Tensor, p: torch.Tensor, bs: int, ring_blocks: int) -> torch.Tensor:
    """Ring slots [B, K] of positions ``p`` [B, K] (>= 0):
    ``table[(p // bs) % ring_blocks] * bs + p % bs`` (:class:`~model_families.block_layout.RingLayout`)."""
    blocks = torch.gather(block_tables, 1, torch.div(p, bs, rounding_mode="floor") % ring_blocks)
    return blocks * bs + p % bs


def _entry_write_slots(block_tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, rate: int,
                       bs: int) -> torch.Tensor:
    """[B*S] pool slot of the compressed entry each chunk token closes (entry ``e = (p + 1) /
    rate - 1`` at ``table[e // bs] * bs + e % bs``), 0 (the scratch block) where it closes none."""
    closing = valid & ((pos + 1) % rate == 0)
    e = torch.where(closing, torch.div(pos + 1, rate, rounding_mode="floor") - 1, 0)
    blocks = torch.gather(block_tables, 1, torch.div(e, bs, rounding_mode="floor"))
    return torch.where(closing, blocks * bs + e % bs, 0).reshape(-1)


class Step:
    """The geometry of one step, computed once and shared by the layers: positions ``pos`` /
    ``valid`` [B, S], ring slots to write, the ring slots of the ``P`` tokens before the chunk
    for each read-back length ``P`` a pool needs (the window ``W - 1``, CSA ``2m - 1``, HCA
    ``m' - 1``), the window mask, compressed-entry slots, rope rows. ``collect``: a decode step
    (S = 1) whose writes are collected as rows (:meth:`DeepseekV4Model.decode`) and whose
    entry reads see the step's own entry in place of its slot. ``draft_tokens``: the ring's
    spare slots (:func:`ring_tokens`)."""

    def __init__(self, c: DeepseekV4Config, caches: tuple[torch.Tensor, ...], positions: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, cos: Mapping[str, torch.Tensor],
                 sin: Mapping[str, torch.Tensor], *, collect: bool, draft_tokens: int = 0) -> None:
        window = c.sliding_window
        B, S = positions.shape
        dev = positions.device
        # The block size is the pools' (a static shape): the ring's geometry follows from it.
        self.bs = bs = caches[0].shape[2]
        ring = ring_tokens(c, bs, draft_tokens)
        self.block_tables, self.collect = block_tables, collect
        start = positions[:, :1]
        self.pos = pos = start + torch.arange(S, device=dev)                      # [B, S]
        self.valid = valid = pos < seq_lens[:, None]
        # A token's ring row is written unless padding or overwritten later in the same chunk.
        keep = valid & (pos >= seq_lens[:, None] - ring)
        slots = _ring_slots(block_tables, torch.where(valid, pos, 0), bs, ring // bs)
        self.ring_slots = torch.where(keep, slots, 0).reshape(-1)
        spans = {window - 1}
        if c.layers_of(CSA):
            spans.add(2 * c.csa_compress_rate - 1)
        if c.layers_of(HCA):
            spans.add(c.hca_compress_rate - 1)
        self.ctx_slots = {}
        for span in sorted(spans):
            ctx_pos = start + torch.arange(-span, 0, device=dev)
            self.ctx_slots[span] = _ring_slots(block_tables, ctx_pos.clamp(min=0), bs, ring // bs)
            if span == window - 1:
                ext_pos = torch.cat([ctx_pos, pos], dim=1)                        # [B, W - 1 + S]
                ext_ok = torch.cat([ctx_pos >= 0, valid], dim=1)
                delta = pos[:, :, None] - ext_pos[:, None, :]
                self.win_mask = (delta >= 0) & (delta < window) & ext_ok[:, None, :]
        # Every entry slot the table can hold, [B, nb * bs].
        self.entry_table = (block_tables[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(B, -1)
        self.entry_ids = torch.arange(self.entry_table.shape[1], device=dev)
        self.cos = {label: table[pos] for label, table in cos.items()}
        self.sin = {label: table[pos] for label, table in sin.items()}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.row_slots: dict[str, torch.Tensor] = {}
        self._closes: dict[int, bool] = {}

    def entry_slots(self, rate: int) -> torch.Tensor:
        """[B*S] pool slot of the entry each token closes, 0 (scratch) where it closes none."""
        return _entry_write_slots(self.block_tables, self.pos, self.valid, rate, self.bs)

    def may_close(self, rate: int) -> bool:
        """Whether some token of the step may close a window of ``rate``: always when tracing
        (one graph for every step); eagerly, only when one does (most decode steps close none,
        and then the window's compression is skipped)."""
        if tracing(self.pos):
            return True
        if rate not in self._closes:
            self._closes[rate] = bool((self.valid & ((self.pos + 1) % rate == 0)).any())
        return self._closes[rate]

    def closed(self, rate: int) -> torch.Tensor:
        """[B, S, E]: entry ``e`` is closed by query position ``p`` (``e < (p + 1) // rate``)."""
        return self.entry_ids[None, None, :] < torch.div(self.pos + 1, rate, rounding_mode="floor")[:, :, None]

    def index_rows(self, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lengths, closed)`` [B, S] int64 for :func:`~model_families.custom_ops.index_topk`:
        each query's indexer row is exactly the entries its position has closed, ``(p + 1) //
        rate`` (0 for padding), in every step: transformers' decode rows (its cache holds just
        those). Its single-forward prefill instead gives every query of the call the call's
        entries, the later ones at ``-inf``, which ``torch.topk`` may order differently among
        tied scores; rows of each query's own length keep a chunk's picks independent of the
        chunking, recompute after preemption exact and a verify step equal to plain decoding."""
        closed = torch.where(self.valid, torch.div(self.pos + 1, rate, rounding_mode="floor"), 0)
        return closed, closed

    def write(self, pool: torch.Tensor, name: str, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Pool ``name``'s layer-``layer`` rows [B, S, width] at ``slots`` [B*S]: written in place,
        or (``collect``) kept for :meth:`DeepseekV4Model.decode` to return."""
        rows = rows.reshape(slots.shape[0], -1)
        if self.collect:
            self.rows.setdefault(name, []).append(rows)
            self.row_slots[name] = slots
        else:
            write_kv(pool, layer, slots, rows)

    def entries(self, pool: torch.Tensor, layer: int, rate: int, fresh: torch.Tensor) -> torch.Tensor:
        """The entries [B, E, width] of the rows' tables in pool layer ``layer``; in a decode step
        the entry the token closes comes from ``fresh`` [B, 1, width] (not yet written)."""
        width = pool.shape[-1]
        got = pool[layer].view(-1, width)[self.entry_table]
        if not self.collect:
            return got
        closing = self.valid & ((self.pos + 1) % rate == 0)                         # [B, 1]
        new = (self.entry_ids[None, :] == torch.div(self.pos + 1, rate, rounding_mode="floor") - 1) & closing
        return torch.where(new[:, :, None], fresh.to(got.dtype), got)
