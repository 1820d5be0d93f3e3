"""Continuous batching (nano-vllm's ``Scheduler`` plus chunked prefill and a progress guarantee).

Each :meth:`Scheduler.schedule` call returns one step's work, either

- a **prefill** batch: waiting sequences in arrival order, each with a chunk of its uncomputed
  tokens, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` resident sequences; a
  chunk shorter than the rest (budget or free blocks ran out) ends the batch, so at most the
  last sequence of a batch is partly prefilled. A sequence that holds no blocks (new or
  preempted) first takes the longest cached prefix of its tokens from the prefix cache
  (:meth:`BlockManager.allocate_cached_prefix`), so its chunk starts after the hit. Choice
  i > 0 of a request with several choices (``seq.prefill_after``) is passed over until choice
  0 has computed the prompt, so it then hits every full prompt block choice 0 computed; or
- a **decode** batch: every running sequence, one token each (after a prefill step, a decode
  step comes first when a running sequence had no part in that prefill, so prefill and decode
  steps alternate while a backlog of prompts is prefilled: :meth:`Scheduler.schedule`), or
  with speculative decoding its last token and its draft tokens (``seq.draft_token_ids``, proposed by the engine after
  the previous step; dropped for the step when their blocks do not fit). When a sequence needs a new block
  and none is free, a partly prefilled waiting sequence gives its blocks back, else the youngest
  running sequence is *preempted*: its blocks are freed and it goes back to the front of the
  waiting queue to be recomputed later (free-then-recompute).

After the model ran a batch and the engine sampled, :meth:`Scheduler.postprocess` is the one
place a sequence is updated (nano-vllm's ``Scheduler.postprocess``, vLLM's
``update_from_output``): computed tokens advance (blocks they fill join the prefix cache), a
completed prefill starts running, the sampled token is appended, and a stop token, EOS or the
length limit finishes the sequence and frees its blocks. The scheduler never sees text: stop
strings are the output processor's (:mod:`runner_service.output_processor`), and the engine
finishes a sequence one matched through :meth:`Scheduler.finish`.

No deadlock: a request is admitted only if it fits the cache alone
(:meth:`Scheduler.check_fits`); when nothing can be scheduled, sequences holding blocks behind
the head of the waiting queue are preempted until the head fits, so every step makes progress.

Threads: only the engine's stepping thread calls the scheduler, except :meth:`Scheduler.check_fits`,
which reads constants only and may be called from any thread (request validation).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from runner_service.block_manager import BlockManager
from runner_service.sequence import FinishReason, Sequence, SequenceStatus
from services.errors import InvalidArgument, ResourceExhausted


@dataclass
class ScheduledBatch:
    """One step: ``seqs[i]`` computes ``num_tokens[i]`` tokens starting at ``starts[i]``."""

    is_prefill: bool
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    _sampling_rows: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_speculative(self) -> bool:
        """A decode batch in which some row verifies draft tokens (computes more than one token)."""
        return not self.is_prefill and sum(self.num_tokens) > len(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def drop_drafts(self) -> None:
        """Make a speculative decode batch a plain one: one token per row, drafts cleared (their
        blocks stay with the sequences, whose next tokens use them). Call before the batch runs."""
        for seq in self.seqs:
            seq.draft_token_ids = []
        self.num_tokens = [1] * len(self.seqs)

    def sampling_rows(self) -> list[int]:
        """Rows that sample a token after this step: those whose chunk reaches the sequence's last
        token (every decode row, drafts or not; a prefill row that completes its prompt). Computed once, on the
        first call, which must come after the batch is complete and before
        :meth:`Scheduler.postprocess` appends the sampled tokens (the runner, the engine and
        ``postprocess`` then share that one list)."""
        if self._sampling_rows is None:
            self._sampling_rows = [i for i, (seq, st, n)
                                   in enumerate(zip(self.seqs, self.starts, self.num_tokens, strict=True))
                                   if st + n >= seq.num_tokens]
        return self._sampling_rows


class Scheduler:
    """Owns the waiting queue and running list (see the module docstring for the thread
    contract). ``eos_token_ids``: the model's end-of-sequence tokens (ignored by requests with
    ``ignore_eos``)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Seq[int] = ()) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._last_prefill: set[int] = set()  # ids of the last step's sequences when it was a prefill

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, seq: Sequence, n: int = 1) -> None:
        """Raise ``ResourceExhausted`` when ``seq`` could never fit the KV cache even alone (its
        K/V at most: ``max_total_tokens - 1`` tokens, the last sampled token is never fed back),
        or when ``n`` such sequences (the choices of one request) could never be resident
        together: more than ``max_num_seqs`` of them (``InvalidArgument``), or more blocks than
        the cache has, counting the prompt's full blocks once when the prefix cache shares them
        (``ResourceExhausted``). Reads only the block manager's fixed sizes: safe from any thread."""
        bm = self.block_manager
        need = bm.blocks_needed(max(1, seq.max_total_tokens - 1))
        if need > bm.num_usable_blocks:
            raise ResourceExhausted(
                f"the request needs up to {need} KV blocks ({seq.max_total_tokens} tokens) but the cache has "
                f"{bm.num_usable_blocks}; shorten the prompt or max_tokens")
        if n == 1:
            return
        if n > self.max_num_seqs:
            raise InvalidArgument(f"n={n} choices cannot run together: this runner decodes at most "
                                  f"{self.max_num_seqs} sequences at once (--max-num-seqs); ask for fewer choices")
        shared = (seq.num_prompt_tokens - 1) // bm.block_size if bm.enable_prefix_caching else 0
        total = need + (n - 1) * (need - shared)
        if total > bm.num_usable_blocks:
            raise ResourceExhausted(
                f"n={n} choices need up to {total} KV blocks together ({need} each, {shared} prompt blocks "
                f"shared) but the cache has {bm.num_usable_blocks}; ask for fewer choices or shorten the "
                "prompt or max_tokens")

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (call :meth:`check_fits` first)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark ``seq`` finished, free its blocks and drop it from the queues (idempotent)."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it at the front of the waiting queue for recompute."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or ``None`` when there is nothing to do. Prefill first, except
        that after a prefill step a decode step comes first when a running sequence took no
        part in that prefill (it got no token from it): a backlog of prompts (chunked to
        ``max_num_batched_tokens`` per step) then puts at most one prefill step between a
        running sequence's tokens, not the whole backlog, while the choices of one request and
        prompts arriving together still prefill back to back."""
        batch = self._schedule()
        self._last_prefill = {id(s) for s in batch.seqs} if batch is not None and batch.is_prefill else set()
        return batch

    def _schedule(self) -> ScheduledBatch | None:
        if not self.has_work():
            return None
        if self._last_prefill and any(id(s) not in self._last_prefill for s in self.running):
            batch = self._schedule_decode()
            if batch:
                return batch
        batch = self._schedule_prefill()
        if batch:
            return batch
        if self.running:
            batch = self._schedule_decode()
            if batch:
                return batch
        # Nothing runs and the head of the queue cannot get blocks: the blocks are held by
        # partly prefilled sequences behind it. Release those (youngest first) and retry.
        head = self.waiting[0]
        for seq in reversed(list(self.waiting)):
            if seq is not head and seq.block_table:
                self.preempt_in_place(seq)
                batch = self._schedule_prefill()
                if batch:
                    return batch
        raise RuntimeError(f"scheduler made no progress: head {head!r}, {self.block_manager.num_free_blocks} free")

    def preempt_in_place(self, seq: Sequence) -> None:
        """Free a waiting sequence's blocks without moving it in the queue."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=True)
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        resident = len(self.running) + sum(1 for s in self.waiting if s.block_table)
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if seq.prefill_after is not None:  # a request's choice i > 0: after choice 0's prompt
                if seq.prefill_after.status is SequenceStatus.WAITING:
                    continue
                seq.prefill_after = None
            is_new = not seq.block_table
            if is_new and resident >= self.max_num_seqs:
                break
            hit = bm.allocate_cached_prefix(seq) if is_new else 0
            n = min(seq.num_uncomputed_tokens, budget)
            fit = bm.tokens_that_fit(seq) - seq.num_computed_tokens
            n = min(n, fit)
            if n <= 0:
                if hit:  # not scheduled after all: give the hit back
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                break
            if is_new and bm.enable_prefix_caching:
                bm.record_lookup(seq.num_tokens, hit)
            bm.allocate(seq, seq.num_computed_tokens + n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            batch.starts.append(seq.num_computed_tokens)
            budget -= n
            resident += is_new
            if n < seq.num_uncomputed_tokens:
                break
        return batch

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=False)
        bm = self.block_manager
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            preempted_self = False
            k = len(seq.draft_token_ids)
            if k and not bm.can_allocate(seq, seq.num_tokens + k):
                seq.draft_token_ids = []  # no blocks for the drafts' slots: one token this step
                k = 0
            while not bm.can_allocate(seq, seq.num_tokens):
                holder = next((s for s in reversed(self.waiting) if s.block_table), None)
                if holder is not None:  # a partly prefilled sequence gives its blocks back first
                    self.preempt_in_place(holder)
                    continue
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            if k and not bm.can_allocate(seq, seq.num_tokens + k):  # preemption above took them
                seq.draft_token_ids = []
                k = 0
            bm.allocate(seq, seq.num_tokens + k)
            batch.seqs.append(seq)
            batch.num_tokens.append(1 + k)
            batch.starts.append(seq.num_tokens - 1)
        return batch

    def on_step_done(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance ``num_computed_tokens`` after the model ran ``batch`` and register the blocks
        that are now full and computed in the prefix cache; sequences whose prefill completed
        move to ``running``. Returns the sequences that now sample a token (those of
        :meth:`ScheduledBatch.sampling_rows`). The first half of :meth:`postprocess`."""
        sampling = [batch.seqs[i] for i in batch.sampling_rows()]
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        for seq in sampling:
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        return sampling

    def postprocess(self, batch: ScheduledBatch, tokens: Seq[int] | Seq[Seq[int]]) -> list[Sequence]:
        """Apply one step's result: :meth:`on_step_done`, then append ``tokens[k]`` to the k-th
        sampling sequence and finish it (blocks freed) on, in this order: a stop token or EOS
        (``STOP``), or the length limit (``LENGTH``). For a speculative batch
        (:attr:`ScheduledBatch.is_speculative`) ``tokens[k]`` is the list of tokens row ``k``
        emits (its accepted drafts, then the target model's token: ``Sampler.verify``): they are
        appended in order up to the first that finishes the sequence, and its computed tokens
        advance by their count (the last token and the accepted drafts), not by what was
        scheduled. Returns the sampling sequences, in order; finished ones have ``is_finished``
        and ``finish_reason`` set. Raises ``ValueError`` when ``tokens`` does not match the
        sampling rows."""
        if batch.is_speculative:
            return self._postprocess_verify(batch, tokens)
        sampling = self.on_step_done(batch)
        if len(tokens) != len(sampling):
            raise ValueError(f"{len(tokens)} sampled tokens for {len(sampling)} sampling sequences")
        for seq, token in zip(sampling, tokens, strict=True):
            self._append(seq, token)
        return sampling

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append one sampled token; finish ``seq`` on a stop token / EOS / its length limit.
        Returns whether it finished."""
        seq.token_ids.append(token)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish(seq, FinishReason.STOP)
            return True
        if seq.num_tokens >= seq.max_total_tokens:
            self.finish(seq, FinishReason.LENGTH)
            return True
        return False

    def _postprocess_verify(self, batch: ScheduledBatch, tokens: Seq[Seq[int]]) -> list[Sequence]:
        """:meth:`postprocess` of a speculative decode batch (every row running and sampling).
        The tokens are appended before the full blocks are cached: a block's key covers its
        tokens, and the accepted drafts are tokens of the blocks the step computed."""
        if len(tokens) != len(batch.seqs) or not all(1 <= len(t) <= n for t, n in zip(tokens, batch.num_tokens,
                                                                                       strict=False)):
            raise ValueError(f"verify results {[len(t) for t in tokens]} do not match the scheduled rows "
                             f"{batch.num_tokens} (1 .. 1 + drafts tokens each)")
        for seq, emitted in zip(batch.seqs, tokens, strict=True):
            seq.draft_token_ids = []
            seq.num_computed_tokens += len(emitted)  # the last token and the accepted drafts
            for token in emitted:
                if self._append(seq, token):
                    break
            else:
                self.block_manager.cache_full_blocks(seq)
        return list(batch.seqs)
