"""Logits processing before sampling: ``min_tokens``, ``logit_bias`` and the presence,
frequency and repetition penalties (:class:`~runner_service.sampling_params.SamplingParams`),
with vLLM's definitions and in vLLM's order (its v1 sampler: ``min_tokens``, then
``logit_bias``, then repetition, frequency and presence penalties), on the raw logits, before
temperature, top-k, top-p and greedy's argmax. ``docs/architecture.md`` §8.

For a row (one request), with ``count[t]`` the times token ``t`` was generated so far and
``seen[t]`` whether ``t`` is in the prompt or was generated:

1. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, the logits of the
   request's ``stop_token_ids`` and, unless ``ignore_eos``, of the model's EOS tokens are
   ``-inf``;
2. ``logit_bias``: ``logit[t] += bias[t]``;
3. repetition: where ``seen[t]``, ``logit[t] /= r`` when ``logit[t] > 0``, else ``logit[t] *= r``;
4. frequency: ``logit[t] -= f * count[t]``;
5. presence: ``logit[t] -= p * (count[t] > 0)``.

The per-row state the penalties need lives in :class:`PenaltyState`, updated incrementally;
rows that need no processing pay nothing, and a batch where no row does is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner_service.sequence import Sequence as Seq
from runner_service.sequence import SequenceStatus


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Steps 3-5 of the module docstring, in place on ``logits`` [m, V] float32 (returned).
    ``counts`` [m, V] int32 (output-token counts), ``seen`` [m, V] bool (in the prompt or
    generated), ``presence``/``frequency``/``repetition`` [m] float32 (0, 0 and 1: off)."""
    factor = torch.where(seen, repetition[:, None], 1.0)
    logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits -= frequency[:, None] * counts
    logits -= presence[:, None] * (counts > 0)
    return logits


class PenaltyState:
    """The processing of :func:`apply_penalties` plus ``min_tokens`` and ``logit_bias`` for a
    batch (:meth:`process`, :meth:`process_verify`), and the per-row state the penalties need.

    A sequence with a penalty (:attr:`SamplingParams.penalized
    <runner_service.sampling_params.SamplingParams.penalized>`) holds one of ``max_num_seqs``
    slots from its first sampling step until :meth:`release` (it finished or was aborted): row
    ``slot`` of :attr:`counts` [max_num_seqs, V] int32 (its output-token counts) and of
    :attr:`prompt_mask` [max_num_seqs, V] bool (its prompt's tokens), allocated on the first
    slot taken. The row is filled once when the slot is taken (from the sequence's tokens), then
    each step adds the tokens appended since the last one with one ``index_put_`` over every
    row (``accumulate=True``). Preemption keeps the slot (recompute keeps the generated tokens,
    so the counts stay valid); when every slot is held, one held by a sequence that is not
    resident (preempted, holding no blocks) is taken back and refilled when it returns.
    ``min_tokens`` and ``logit_bias`` need no state. ``eos_token_ids``: the model's, masked by
    ``min_tokens`` unless the request has ``ignore_eos``.

    Not thread-safe: the engine's stepping thread only."""

    def __init__(self, max_num_seqs: int, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 device: torch.device | str = "cpu") -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        #: Output-token counts [max_num_seqs, V] int32 and prompt-token mask [max_num_seqs, V]
        #: bool, one row per slot; ``None`` until a slot is first taken.
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self._slots: dict[Seq, int] = {}
        self._counted: dict[Seq, int] = {}  # output tokens already in the slot's counts
        self._free = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def slot(self, seq: Seq) -> int | None:
        """``seq``'s slot, ``None`` when it holds none."""
        return self._slots.get(seq)

    def release(self, seq: Seq) -> None:
        """Give ``seq``'s slot back (no-op when it holds none)."""
        slot = self._slots.pop(seq, None)
        if slot is not None:
            del self._counted[seq]
            self._free.append(slot)

    def process(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        """The processed next-token logits of ``seqs`` (row ``i`` of ``logits`` [n, V] float32 is
        ``seqs[i]``'s): ``logits`` itself when no row needs processing, else a processed copy
        (``logits`` is left as is, for the raw logprobs)."""
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
        if not rows:
            return logits
        out = logits.clone()
        self._process(out[:, None], seqs, rows)
        return out

    def process_verify(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        """:meth:`process` for a verify step's ``logits`` [n, S, V] (row ``i``'s position ``j``
        the logits after its ``j``-th draft): ``logit_bias`` is added at every position; the
        penalties and ``min_tokens`` are those of the row's first position at every position,
        which is exact for the only position read: a row with them is never drafted
        (:attr:`SamplingParams.may_speculate <runner_service.sampling_params.SamplingParams.may_speculate>`)."""
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
        if not rows:
            return logits
        out = logits.clone()
        self._process(out, seqs, rows)
        return out

    def _process(self, logits: torch.Tensor, seqs: Sequence[Seq], rows: list[int]) -> None:
        """Process ``logits`` [n, S, V] in place at ``rows``."""
        dev = logits.device
        # 1. min_tokens
        masked_rows, masked_ids = [], []
        for i in rows:
            p = seqs[i].params
            if seqs[i].num_completion_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                masked_rows += [i] * len(ids)
                masked_ids += sorted(ids)
        if masked_rows:
            logits[torch.tensor(masked_rows, device=dev), :, torch.tensor(masked_ids, device=dev)] = float("-inf")
        # 2. logit_bias
        bias_rows, bias_ids, bias_values = [], [], []
        for i in rows:
            for token, value in seqs[i].params.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(value)
        if bias_rows:
            r = torch.tensor(bias_rows, device=dev)
            t = torch.tensor(bias_ids, device=dev)
            logits[r, :, t] += torch.tensor(bias_values, device=dev, dtype=logits.dtype)[:, None]
        # 3-5. penalties
        pen = [i for i in rows if seqs[i].params.penalized]
        if not pen:
            return
        slots = self._update([seqs[i] for i in pen])
        idx = torch.tensor(slots, device=self.device)
        counts, prompt = self.counts[idx], self.prompt_mask[idx]
        params = [seqs[i].params for i in pen]
        r = torch.tensor(pen, device=dev)
        S = logits.shape[1]
        sub = logits[r].reshape(len(pen) * S, -1)

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=dev).repeat_interleave(S)

        counts = counts.to(dev).repeat_interleave(S, dim=0)
        seen = prompt.to(dev).repeat_interleave(S, dim=0) | (counts > 0)
        apply_penalties(sub, counts, seen, per_row([p.presence_penalty for p in params]),
                        per_row([p.frequency_penalty for p in params]),
                        per_row([1.0 if p.repetition_penalty is None else p.repetition_penalty for p in params]))
        logits[r] = sub.reshape(len(pen), S, -1)

    def _update(self, seqs: list[Seq]) -> list[int]:
        """The slots of ``seqs`` (penalized, resident), taking one for each that holds none, with
        every slot's counts brought up to date: one ``index_put_`` of the tokens each sequence
        appended since the last call."""
        if self.counts is None:
            self.counts = torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.bool, device=self.device)
        slots, rows, tokens = [], [], []
        for seq in seqs:
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._take(seq)
            done = self._counted[seq]
            new = seq.token_ids[seq.num_prompt_tokens + done:]
            if new:
                rows += [slot] * len(new)
                tokens += new
                self._counted[seq] = done + len(new)
            slots.append(slot)
        if rows:
            self.counts.index_put_((torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device)),
                                   torch.ones(len(rows), dtype=torch.int32, device=self.device), accumulate=True)
        return slots

    def _take(self, seq: Seq) -> int:
        """A slot for ``seq``, its rows cleared and its prompt marked (its output tokens are
        counted by the caller). Takes one back from a non-resident sequence when none is free."""
        if not self._free:
            holder = next((s for s in self._slots if s.is_finished
                           or (s.status is SequenceStatus.WAITING and not s.block_table)), None)
            if holder is None:
                raise RuntimeError(f"no penalty slot free: {len(self._slots)} resident sequences hold all "
                                   f"{self.max_num_seqs}")
            self.release(holder)
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        prompt = torch.tensor(seq.token_ids[:seq.num_prompt_tokens], device=self.device)
        self.prompt_mask[slot, prompt] = True
        self._slots[seq] = slot
        self._counted[seq] = 0
        return slot
