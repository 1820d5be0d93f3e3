"""Multi-token-prediction (MTP) draft tokens for speculative decoding (``--speculative mtp``),
for a family whose model carries MTP blocks (DeepSeek V4: ``DeepseekV4Model.mtp``).

The MTP block is a small model of its own beside the main one: position ``p`` pairs the main
model's residual streams at ``p`` with the token at ``p + 1`` and predicts the token at ``p + 2``;
it keeps a window ring of its own (:meth:`ModelFamily.draft_cache_specs`: its rows at the
same slots as the main ring's, so the sequence's block table serves both).

After every main step over positions ``[a, a + s)`` of a row (a prefill chunk, or a verify step
of the last token and ``k`` drafts) the drafter (:class:`MtpDrafter`) runs the block over the
positions whose next token is now known: ``p`` in ``[a, min(a + s, num_tokens - 1))`` (a verify
step's accepted prefix and its bonus token; a prefill chunk's positions, the last one once its
first token is sampled), with the streams the step returned. That rewrites every row the block
holds for those positions, so the rows its own drafting wrote there with its own streams (below)
roll back without any bookkeeping. A sequence whose known tokens are all processed then drafts:
the first draft is the argmax of the block's logits at the last position; each further one runs
the block one more position on its own output streams and the draft before (the recurrent use
of one MTP block for ``K`` drafts, as vLLM and SGLang run DeepSeek's). Drafts are argmax
whatever the request's sampling: :meth:`Sampler.verify` accepts a one-hot draft so that every
emitted token keeps the target distribution.

Positions the block drafts at may lie past the blocks allocated so far (the next schedule
allocates them for the verify step): their rows then go to the scratch block and only the
drafts' quality can suffer, never the output. ``seq.drafter_state`` (:class:`MtpState`) holds
the positions processed; a sequence that restarts from position 0 (preempted, recomputed)
starts it again.

Staging (:class:`MtpBuffers`): the block's inputs live in persistent buffers allocated once for
the largest step the drafter runs while decoding, ``max_num_seqs`` rows of ``1 + K`` positions
(a catch-up after a verify step: the accepted prefix and the bonus token; each recurrent draft
step: 1). A step writes only its active prefix, into views of those buffers; the model reads
views of them. A catch-up after a prefill chunk longer than ``1 + K`` positions (not a decode
step) is staged in tensors made for it, as before (:meth:`MtpDrafter._run_fresh`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import compress
from operator import ne

import numpy as np
import torch

from model_families.block_layout import BlockLayout
from runner_service.decode_buffers import write_block_table_row
from runner_service.kv_cache import KVCache


@dataclass
class MtpState:
    """A sequence's MTP progress: ``processed`` positions ``[0, processed)`` hold the block's
    rows made from the main model's streams; ``broken`` once a step skipped some (no more drafts)."""

    processed: int = 0
    broken: bool = False


#: The block-table cache key of a padding row (no blocks: every entry is the scratch block).
_PADDING_KEY: list[int] = []
#: The flat int64 buffers of ``max_num_seqs * width`` entries, and the per-row ones (host
#: mirrors on an accelerator).
_GRIDS = ("input_ids", "positions", "sources", "padding")
_ROWS = ("seq_lens", "block_tables")


class MtpBuffers:
    """The persistent inputs of the MTP block's steps, for up to ``max_num_seqs`` rows of up to
    ``width`` (``1 + K``) positions, streams of ``stream_shape`` ``(n, H)`` in ``dtype`` on
    ``device``, block tables of up to ``max_blocks_per_seq`` ids in ``[1, num_blocks)``.

    Allocated once (:meth:`reset` reallocates, :meth:`close` drops, each with the block-table row
    cache); a step (:meth:`fill`) of ``B`` rows and ``S = max`` positions writes only its active
    prefix and returns views of the buffers (made once per shape), so their storage
    (``data_ptr``) is the same at every step:

    ================  ==========================================  ==================================================
    buffer            shape (dtype)                               a step's view, row ``r``
    ================  ==========================================  ==================================================
    ``hidden``        [max_num_seqs * width, n, H] (``dtype``)    [B, S, n, H]: its streams, then 0
    ``input_ids``     [max_num_seqs * width] (int64)              [B, S]: the token after each position, then 0
    ``positions``     [max_num_seqs * width] (int64)              [B, S]: ``start .. start + S - 1``
    ``seq_lens``      [max_num_seqs] (int64)                      [B]: ``start + count``
    ``block_tables``  [max_num_seqs, max_blocks_per_seq] (int64)  [B, nb]: its block ids, then scratch (0)
    ``sources``       [max_num_seqs * width] (int64)              the flat source row of each entry's streams
    ``padding``       [max_num_seqs * width] (int64)              the padding entries' indices (streams zeroed)
    ``top``           [max_num_seqs * width] (int64)              the argmax of the step's logits (:meth:`argmax`)
    ================  ==========================================  ==================================================

    The ``* width`` buffers are flat, as the verify grids of
    :class:`~runner_service.decode_buffers.DecodeBuffers`: a step uses its first ``B * S``
    entries as a row-major ``[B, S]`` grid, so its inputs are contiguous views; entries past them
    are stale and never read. Positions of a row past its count are padding (token 0, streams 0,
    ignored by the step past ``seq_lens``). ``seq_lens`` and ``block_tables`` rows from ``B`` on
    are padding rows: length 0, every entry the scratch block (block 0). A block-table row is
    rewritten only when the block list it holds changes (``row_builds`` counts them), as in
    ``DecodeBuffers``. On an accelerator the int64 buffers are written in host mirrors (pinned on
    CUDA) and the active prefix copied to the device."""

    def __init__(self, max_num_seqs: int, width: int, stream_shape: tuple[int, int], max_blocks_per_seq: int,
                 num_blocks: int, layout: BlockLayout, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if max_num_seqs < 1 or width < 1 or max_blocks_per_seq < 1 or num_blocks < 2 or len(stream_shape) != 2:
            raise ValueError("MTP buffers need max_num_seqs, width, max_blocks_per_seq >= 1, num_blocks >= 2 and "
                             "a stream shape (n, H)")
        self.max_num_seqs, self.width, self.max_blocks_per_seq = max_num_seqs, width, max_blocks_per_seq
        self.stream_shape, self.num_blocks, self.layout = tuple(stream_shape), num_blocks, layout
        self.dtype, self.device = dtype, torch.device(device)
        self.row_builds = 0
        self._allocate()

    def _allocate(self) -> None:
        n, w, m = self.max_num_seqs, self.width, self.max_blocks_per_seq
        on_host = self.device.type == "cpu"
        pin = not on_host and torch.cuda.is_available() and self.device.type == "cuda"

        def host(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self._host = {name: host(n * w) for name in _GRIDS}
        self._host.update(seq_lens=host(n), block_tables=host(n, m))
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._dev = self._host if on_host else {name: torch.zeros_like(t, device=self.device)
                                                for name, t in self._host.items()}
        self.hidden = torch.zeros((n * w, *self.stream_shape), dtype=self.dtype, device=self.device)
        self.top = torch.zeros(n * w, dtype=torch.int64, device=self.device)
        self._top_host = self.top if on_host else host(n * w)
        self._top_np = self._top_host.numpy()
        #: Per step scratch: the rows' starts, counts, source rows and columns; a column index; an
        #: entry index and the padding entries' mask (``padding`` above: their indices).
        self._cols = np.arange(w, dtype=np.int64)
        self._entries = np.arange(n * w, dtype=np.int64)
        self._pad_mask = np.zeros(n * w, dtype=bool)
        self._scratch = np.zeros((4, n), dtype=np.int64)
        self._row_keys: list[list[int]] = [_PADDING_KEY] * n
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.num_active = 0

    @property
    def input_ids(self) -> torch.Tensor:
        return self._dev["input_ids"]

    @property
    def positions(self) -> torch.Tensor:
        return self._dev["positions"]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._dev["seq_lens"]

    @property
    def block_tables(self) -> torch.Tensor:
        return self._dev["block_tables"]

    def reset(self) -> None:
        """Recreate the buffers and clear the block-table cache and the views together."""
        self._allocate()

    def close(self) -> None:
        """Drop the buffers, the cache and the views together; :meth:`reset` makes them usable again."""
        self._host, self._np, self._dev, self._views, self._row_keys = {}, {}, {}, {}, []
        self.hidden = self.top = self._top_host = self._top_np = None
        self.num_active = 0

    def fits(self, rows: int, positions: int, dtype: torch.dtype) -> bool:
        """Whether a step of ``rows`` rows of up to ``positions`` positions with streams of
        ``dtype`` can be staged here (a longer catch-up after a prefill chunk cannot)."""
        return 0 < rows <= self.max_num_seqs and 0 < positions <= self.width and dtype == self.dtype

    def fill(self, source: torch.Tensor, rows: Seq[int], cols: Seq[int], ids: Seq[Seq[int]], starts: Seq[int],
             block_tables: Seq[Seq[int]]) -> tuple[torch.Tensor, ...]:
        """Stage one step of ``B = len(ids)`` rows: row ``r`` covers ``len(ids[r])`` positions
        from ``starts[r]``, the tokens after them ``ids[r]``, its streams
        ``source[rows[r], cols[r]:cols[r] + len(ids[r])]`` (``source`` [Bs, Ss, n, H], a main
        step's streams or the block's own output), its block list ``block_tables[r]``. Returns
        ``(hidden [B, S, n, H], input_ids [B, S], positions [B, S], block_tables [B, nb],
        seq_lens [B])``, views of the buffers (``S`` the most positions of a row, ``nb`` the most
        blocks a row holds or its positions need), what :meth:`DeepseekV4Model.mtp` takes.

        Everything is validated before any buffer is written: ``ValueError`` for row lists of
        different lengths, no rows or more than ``max_num_seqs``, a row of no positions or more than
        ``width``, a source row or column outside ``source``, a negative start, ``source`` not
        [*, *, n, H] of the buffers' dtype and device, a block list longer than
        ``max_blocks_per_seq`` or with an id outside ``[1, num_blocks)``, or positions needing
        more than ``max_blocks_per_seq`` blocks."""
        B = len(ids)
        if not len(rows) == len(cols) == len(starts) == len(block_tables) == B:
            raise ValueError(f"MTP step rows disagree: {B} token lists, {len(rows)} source rows, {len(cols)} source "
                             f"columns, {len(starts)} starts, {len(block_tables)} block tables")
        if not 0 < B <= self.max_num_seqs:
            raise ValueError(f"an MTP step needs 1 to {self.max_num_seqs} rows (max_num_seqs), not {B}")
        counts = [len(t) for t in ids]
        S, total = max(counts), sum(counts)
        if min(counts) < 1 or S > self.width:
            raise ValueError(f"an MTP step's rows need 1 to {self.width} positions each, not {min(counts)} .. {S}")
        if source.dim() != 4 or tuple(source.shape[2:]) != self.stream_shape or source.dtype != self.dtype \
                or source.device != self.device:
            raise ValueError(f"the MTP step's streams are {tuple(source.shape)} {source.dtype} on {source.device}; "
                             f"the buffers take [*, *, {self.stream_shape[0]}, {self.stream_shape[1]}] {self.dtype} "
                             f"on {self.device}")
        Bs, Ss = source.shape[:2]
        if min(rows) < 0 or max(rows) >= Bs or min(cols) < 0 or max(map(sum, zip(cols, counts, strict=True))) > Ss:
            raise ValueError(f"an MTP step's source rows must be in [0, {Bs}) and their positions in [0, {Ss}]")
        if min(starts) < 0:
            raise ValueError("an MTP step's starts must be >= 0")
        keys, m = self._row_keys, self.max_blocks_per_seq
        changed = () if type(block_tables) is list and block_tables == keys[:B] else \
            list(compress(range(B), map(ne, block_tables, keys)))
        for r in changed:
            blocks = block_tables[r]
            if len(blocks) > m:
                raise ValueError(f"MTP row {r}: {len(blocks)} blocks exceed max_blocks_per_seq {m}")
            if blocks and not (0 < min(blocks) and max(blocks) < self.num_blocks):
                raise ValueError(f"MTP row {r}: block ids must be in [1, {self.num_blocks})")
        end = max(map(sum, zip(starts, counts, strict=True)))
        nb = max(max(map(len, block_tables)), self.layout.blocks_needed(end), 1)
        if nb > m:
            raise ValueError(f"an MTP step reaching position {end - 1} needs {nb} blocks, more than "
                             f"max_blocks_per_seq {m}")
        # -- writes ---------------------------------------------------------------------------
        np_, cols_ = self._np, self._cols[:S]
        st, cnt, src, col = self._scratch[:, :B]
        st[:] = starts
        cnt[:] = counts
        src[:] = rows
        col[:] = cols
        tok, pos, srcs = (np_[name][:B * S].reshape(B, S) for name in ("input_ids", "positions", "sources"))
        if S == 1:
            tok[:, 0] = [t[0] for t in ids]
        else:
            tok[:] = 0
            for r, t in enumerate(ids):
                tok[r, :len(t)] = t
        np.add(st[:, None], cols_[None, :], out=pos)
        np.add(st, cnt, out=np_["seq_lens"][:B])
        # the flat source row of each entry; padding entries repeat the row's last one (then zeroed)
        np.multiply(src, Ss, out=src)
        src += col
        cnt -= 1
        np.minimum(cols_[None, :], cnt[:, None], out=srcs)
        srcs += src[:, None]
        pads = B * S - total
        if pads:
            mask = self._pad_mask[:B * S]
            np.greater(cols_[None, :], cnt[:, None], out=mask.reshape(B, S))
            np.compress(mask, self._entries[:B * S], out=np_["padding"][:pads])
        for r in changed:
            self._build_row(r, block_tables[r])
        if B < self.num_active:
            for r in range(B, self.num_active):
                if keys[r] is not _PADDING_KEY:
                    self._build_row(r, _PADDING_KEY)
            np_["seq_lens"][B:self.num_active] = 0
        self._copy_to_device(B, S, max(B, self.num_active))
        self.num_active = B
        key = (B, S, nb, torch.is_inference_mode_enabled())
        views = self._views.get(key)
        if views is None:
            d, n = self._dev, B * S
            views = self._views[key] = (self.hidden[:n].view(B, S, *self.stream_shape), d["input_ids"][:n].view(B, S),
                                        d["positions"][:n].view(B, S), d["block_tables"][:B, :nb], d["seq_lens"][:B],
                                        d["sources"][:n], self.hidden[:n])
        flat = views[6]
        torch.index_select(source.reshape(Bs * Ss, *self.stream_shape), 0, views[5], out=flat)
        if pads:
            flat.index_fill_(0, self._dev["padding"][:pads], 0)
        return views[:5]

    def argmax(self, logits: torch.Tensor) -> np.ndarray:
        """The argmax over the last dim of a step's ``logits`` [B, S, V] into ``top``, as a host
        array of ``B * S`` (row-major; valid until the next call). ``ValueError`` for more than
        the buffer holds."""
        B, S = logits.shape[:2]
        if B * S > self.top.numel():
            raise ValueError(f"{B} x {S} logits rows exceed the {self.top.numel()} the MTP buffers hold")
        out = self.top[:B * S]
        torch.argmax(logits, dim=-1, out=out.view(B, S))
        if self._top_host is not self.top:
            self._top_host[:B * S].copy_(out)
        return self._top_np[:B * S]

    def _build_row(self, row: int, blocks: Seq[int]) -> None:
        """Rewrite block-table row ``row`` as ``blocks`` then scratch entries; only the entries
        past the old key's are written when ``blocks`` extends it (the sequence grew a block)."""
        self.row_builds += 1
        write_block_table_row(self._np["block_tables"][row], self._row_keys[row], blocks)
        self._row_keys[row] = list(blocks) if blocks else _PADDING_KEY

    def _copy_to_device(self, rows: int, width: int, table_rows: int) -> None:
        if self._dev is self._host:
            return
        n = rows * width
        for name in _GRIDS:
            self._dev[name][:n].copy_(self._host[name][:n], non_blocking=True)
        for name in _ROWS:
            self._dev[name][:table_rows].copy_(self._host[name][:table_rows], non_blocking=True)


class MtpDrafter:
    """Drafts each decoding sequence's next ``k`` tokens with the model's MTP block ``block``
    (see the module docstring), its window ring in ``pool`` (the runner's draft cache, pool
    ``mtp_win``) at the slots of ``layout`` (the family's block layout: a drafting position past
    a sequence's blocks reads and writes the scratch block); its steps hold ``lock`` (the
    runner's forward lock). Needs the main steps' residual streams (``mtp`` is in
    :data:`~runner_service.options.STREAMS_METHODS`): :meth:`observe` is called after each step
    with them.

    The block's inputs are staged in :attr:`buffers` (:class:`MtpBuffers`, ``max_num_seqs`` rows
    of ``1 + k`` positions, block tables of ``max_blocks_per_seq`` ids, streams of the model's
    ``(hc_mult, hidden_size)`` in ``dtype``, by default its embedding's); :meth:`reset` and
    :meth:`close` reset or drop them (with their block-table cache) as the runner's decode
    buffers are."""

    def __init__(self, k: int, model, pool: KVCache, layout: BlockLayout, block: int = 0,
                 lock: threading.Lock | None = None, *, max_num_seqs: int, max_blocks_per_seq: int,
                 dtype: torch.dtype | None = None) -> None:
        self.k, self.model, self.layout, self.block = k, model, layout, block
        self.pool = pool.pools["mtp_win"]
        self._lock = lock or contextlib.nullcontext()
        c = model.config
        self.buffers = MtpBuffers(
            max_num_seqs, 1 + k, (c.hc_mult, c.hidden_size), max_blocks_per_seq, self.pool.shape[1], layout,
            dtype or model.embed.dtype, self.pool.device)
        #: Block steps staged in tensors made for them (:meth:`_run_fresh`: a catch-up after a
        #: prefill chunk longer than ``1 + k`` positions), counted for the tests.
        self.fresh_runs = 0

    def propose(self, seqs) -> None:
        """Nothing: the drafts are made in :meth:`observe`, from the step's streams."""

    def reset(self) -> None:
        """Recreate the staging buffers and their block-table cache (:meth:`MtpBuffers.reset`)."""
        self.buffers.reset()

    def close(self) -> None:
        """Drop the staging buffers and their block-table cache (:meth:`MtpBuffers.close`)."""
        self.buffers.close()

    @torch.inference_mode()
    def observe(self, seqs, starts: list[int], lengths: list[int], streams: torch.Tensor) -> None:
        """After a main step in which row ``i`` (``seqs[i]``) computed positions ``[starts[i],
        starts[i] + lengths[i])`` with residual streams ``streams[i]`` [S, n, H] (padded to the
        longest row), and its emitted tokens were appended: run the block over each row's newly known
        positions, then set ``seq.draft_token_ids`` of each decoding, unfinished row (``[]`` for
        one that opted out, has no room or whose state is broken)."""
        rows = []
        for i, seq in enumerate(seqs):
            seq.draft_token_ids = []
            if seq.is_finished or not seq.params.may_speculate:
                continue
            a = starts[i]
            state = seq.drafter_state
            if state is None or a == 0:
                state = seq.drafter_state = MtpState()
            if state.broken or state.processed != a:
                state.broken = True  # positions before this step were never processed
                continue
            n = min(lengths[i], seq.num_tokens - 1 - a)
            if n > 0:
                rows.append((i, seq, a, n))
        if not rows:
            return
        S = max(n for *_, n in rows)
        top, out = self._run(streams, [i for i, *_ in rows], [0] * len(rows),
                             [seq.token_ids[a + 1:a + 1 + n] for _, seq, a, n in rows], [a for _, _, a, _ in rows],
                             [seq.block_table for _, seq, _, _ in rows])
        drafting = []  # (seq, room, its row in ``out``, its column there)
        for r, (_, seq, a, n) in enumerate(rows):
            seq.drafter_state.processed = a + n
            room = min(self.k, seq.max_total_tokens - seq.num_tokens - 1)
            # decoding (its prompt done) and every known token processed: draft
            if seq.num_tokens > seq.num_prompt_tokens and a + n == seq.num_tokens - 1 and room > 0:
                seq.draft_token_ids = [int(top[r * S + n - 1])]
                drafting.append((seq, room, r, n - 1))
        for j in range(1, max((room for _, room, _, _ in drafting), default=0)):
            drafting = [d for d in drafting if d[1] > j]
            top, out = self._run(out, [r for _, _, r, _ in drafting], [c for *_, c in drafting],
                                 [seq.draft_token_ids[-1:] for seq, *_ in drafting],
                                 [seq.num_tokens - 2 + j for seq, *_ in drafting],
                                 [seq.block_table for seq, *_ in drafting])
            for r, (seq, *_) in enumerate(drafting):
                seq.draft_token_ids.append(int(top[r]))
            drafting = [(seq, room, r, 0) for r, (seq, room, _, _) in enumerate(drafting)]

    def _run(self, source: torch.Tensor, rows: list[int], cols: list[int], ids: list[list[int]],
             starts: list[int], tables: list[list[int]]) -> tuple[np.ndarray, torch.Tensor]:
        """One block step: row ``r`` the ``len(ids[r])`` positions from ``starts[r]``, the tokens
        after them ``ids[r]``, streams ``source[rows[r], cols[r]:cols[r] + len(ids[r])]``, block
        list ``tables[r]``. Staged in :attr:`buffers` (:meth:`MtpBuffers.fill`) when they fit,
        else by :meth:`_run_fresh`. Returns ``(top, streams)``: the argmax token of each position,
        row-major ``[B * S]`` on the host (``S`` the longest row), and the block's output streams
        ``[B, S, n, H]``."""
        buf = self.buffers
        if buf.fits(len(ids), max(map(len, ids)), source.dtype):
            h, tok, pos, bt, lens = buf.fill(source, rows, cols, ids, starts, tables)
            with self._lock:
                logits, out = self.model.mtp(self.pool, h, tok, pos, bt, lens, self.block)
            return buf.argmax(logits), out
        logits, out = self._run_fresh([source[r, c:c + len(t)] for r, c, t in zip(rows, cols, ids, strict=True)],
                                      ids, starts, tables)
        return logits.argmax(-1).reshape(-1).cpu().numpy(), out

    def _run_fresh(self, hidden: list[torch.Tensor], ids: list[list[int]], starts: list[int],
                   tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One block step over rows of ``len(ids[r])`` positions from ``starts[r]`` with streams
        ``hidden[r]`` [len, n, H], in tensors made for it (padded to the longest; padding past
        each row's length is ignored by the step): for a step :attr:`buffers` cannot stage, a
        catch-up after a prefill chunk longer than ``1 + k`` positions (prefill, not a decode
        step). Returns ``(logits [B, S, V], streams [B, S, n, H])``."""
        self.fresh_runs += 1
        B, S = len(ids), max(len(t) for t in ids)
        dev = self.pool.device
        h = torch.zeros((B, S, *hidden[0].shape[1:]), dtype=hidden[0].dtype, device=dev)
        tok = torch.zeros((B, S), dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        lens = start + torch.tensor([len(t) for t in ids])
        nb = max(max(len(t) for t in tables), self.layout.blocks_needed(int(lens.max())))
        bt = torch.zeros((B, nb), dtype=torch.int64)  # entries past a row's blocks: the scratch block
        for r in range(B):
            n = len(ids[r])
            h[r, :n] = hidden[r]
            tok[r, :n] = torch.tensor(ids[r])
            bt[r, :len(tables[r])] = torch.tensor(tables[r])
        pos = start[:, None] + torch.arange(S)
        with self._lock:
            return self.model.mtp(self.pool, h, tok.to(dev), pos.to(dev), bt.to(dev), lens.to(dev), self.block)
