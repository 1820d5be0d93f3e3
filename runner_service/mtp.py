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
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from model_families.block_layout import BlockLayout
from runner_service.kv_cache import KVCache


@dataclass
class MtpState:
    """A sequence's MTP progress: ``processed`` positions ``[0, processed)`` hold the block's
    rows made from the main model's streams; ``broken`` once a step skipped some (no more drafts)."""

    processed: int = 0
    broken: bool = False


class MtpDrafter:
    """Drafts each decoding sequence's next ``k`` tokens with the model's MTP block ``block``
    (see the module docstring), its window ring in ``pool`` (the runner's draft cache, pool
    ``mtp_win``) at the slots of ``layout`` (the family's block layout: a drafting position past
    a sequence's blocks reads and writes the scratch block); its steps hold ``lock`` (the
    runner's forward lock). Needs the main steps' residual streams (``mtp`` is in
    :data:`~runner_service.options.STREAMS_METHODS`): :meth:`observe` is called after each step
    with them."""

    def __init__(self, k: int, model, pool: KVCache, layout: BlockLayout, block: int = 0,
                 lock: threading.Lock | None = None) -> None:
        self.k, self.model, self.layout, self.block = k, model, layout, block
        self.pool = pool.pools["mtp_win"]
        self._lock = lock or contextlib.nullcontext()

    def propose(self, seqs) -> None:
        """Nothing: the drafts are made in :meth:`observe`, from the step's streams."""

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
            if seq.is_finished or seq.params.disable_speculative_decoding:
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
        logits, out = self._run([streams[i, :n] for i, _, _, n in rows],
                                [seq.token_ids[a + 1:a + 1 + n] for _, seq, a, n in rows],
                                [a for _, _, a, _ in rows], [seq.block_table for _, seq, _, _ in rows])
        drafting = []
        for r, (_, seq, a, n) in enumerate(rows):
            seq.drafter_state.processed = a + n
            room = min(self.k, seq.max_total_tokens - seq.num_tokens - 1)
            # decoding (its prompt done) and every known token processed: draft
            if seq.num_tokens > seq.num_prompt_tokens and a + n == seq.num_tokens - 1 and room > 0:
                seq.draft_token_ids = [int(logits[r, n - 1].argmax())]
                drafting.append((seq, room, out[r, n - 1]))
        for j in range(1, max((room for _, room, _ in drafting), default=0)):
            drafting = [d for d in drafting if d[1] > j]
            logits, out = self._run([h[None] for _, _, h in drafting],
                                    [seq.draft_token_ids[-1:] for seq, _, _ in drafting],
                                    [seq.num_tokens - 2 + j for seq, _, _ in drafting],
                                    [seq.block_table for seq, _, _ in drafting])
            for r, (seq, _, _) in enumerate(drafting):
                seq.draft_token_ids.append(int(logits[r, 0].argmax()))
            drafting = [(seq, room, out[r, 0]) for r, (seq, room, _) in enumerate(drafting)]

    def _run(self, hidden: list[torch.Tensor], ids: list[list[int]], starts: list[int],
             tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One block step over rows of ``len(ids[r])`` positions from ``starts[r]`` (padded to
        the longest; padding past each row's length is ignored by the step): returns ``(logits
        [B, S, V], streams [B, S, n, H])``."""
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
