"""A sequence: one request's tokens, its KV blocks and its progress (nano-vllm's ``Sequence``).

``token_ids`` holds the prompt followed by the generated tokens. ``num_computed_tokens`` counts
the leading tokens whose K/V are in the cache; a prefill step computes a chunk of the rest, a
decode step computes the last token (position ``num_tokens - 1``) and samples the next one. A
preempted sequence loses its blocks and ``num_computed_tokens`` drops to 0: it is recomputed
(prompt and generated tokens) by later prefill steps, starting after whatever prefix of it the
prefix cache still holds (:mod:`runner_service.block_manager`).
"""

from __future__ import annotations

import enum

import torch

from runner_service.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # in the waiting queue (new, partly prefilled, or preempted)
    RUNNING = "running"    # prefilled; decoded every decode step
    FINISHED = "finished"


class FinishReason(enum.IntEnum):
    """Values match ``warmserve.v1.FinishReason``."""

    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    ABORTED = 4


class Sequence:
    """Mutable per-request state owned by the scheduler (not thread-safe: the engine loop only)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int, generator: torch.Generator | None = None) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_model_len = max_model_len
        self.generator = generator
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        #: Choice i > 0 of a request with several choices: its first prefill waits until this
        #: sequence (the request's choice 0) has computed the prompt, so that it takes the
        #: prompt's full blocks from the prefix cache (:meth:`Scheduler.schedule
        #: <runner_service.scheduler.Scheduler.schedule>` clears it once scheduled).
        self.prefill_after: Sequence | None = None
        #: Draft tokens to verify at the next decode step (speculative decoding: the engine
        #: proposes them after each step; the scheduler allocates their slots), and the drafter's
        #: per-sequence state (:class:`runner_service.ngram.NgramIndex`), ``None`` until first used.
        self.draft_token_ids: list[int] = []
        self.drafter_state: object | None = None
        #: Structured output: this request's grammar matcher (llguidance's ``LLMatcher``, its state
        #: the tokens generated so far; :mod:`runner_service.structured`), ``None`` for free text.
        self.grammar: object | None = None
        # Prefix-cache progress, owned by the block manager: the hash-chain keys of the full
        # blocks of token_ids (memoised), how many leading blocks of block_table are resolved
        # against the cache, the cache entry of the last of them, whether the chain broke, and
        # the code (BlockManager.computed_by) its keys and blocks are of.
        self.block_hashes: list[bytes] = []
        self.cache_computed_by = ""
        self.cache_resolved_blocks = 0
        self.cache_parent: object | None = None
        self.cache_broken = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens a prefill still has to compute before the sequence can sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence can ever hold: prompt + max_tokens, capped by the context."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
