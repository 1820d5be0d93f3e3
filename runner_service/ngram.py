"""N-gram (prompt-lookup) draft tokens for speculative decoding.

The draft for a sequence is the continuation of the most recent earlier occurrence of its last
``n`` tokens, for the longest ``n`` in ``[n_min, n_max]`` that occurs earlier (Saxena's prompt
lookup decoding; vLLM's ``ngram`` method with ``prompt_lookup_min`` / ``prompt_lookup_max``):
up to ``k`` tokens that follow that occurrence. Copy-heavy output (code edits, quoting,
summaries, JSON from a schema in the prompt) repeats spans of its context, so the drafts are
often right; when none matches, the sequence decodes one token that step.

:class:`NgramIndex` keeps, per ``n``, a dict from each ``n``-gram of the sequence to the end
position of its most recent occurrence, the last position excluded (the current suffix is the
one looked up, and an occurrence must have a token after it). It is updated incrementally: a
step that appends ``m`` tokens registers ``m`` end positions per ``n`` (``O(m * (n_max - n_min
+ 1))`` dict writes), so a lookup costs ``n_max - n_min + 1`` dict reads however long the
sequence; a new sequence registers its prompt once, on its first lookup.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The n-gram index of one sequence's tokens (see the module docstring).

    ``n_min`` / ``n_max``: the suffix lengths looked up, ``1 <= n_min <= n_max`` (``ValueError``
    otherwise)."""

    __slots__ = ("n_min", "n_max", "_ends", "_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        #: Per n, longest first: n-gram (tuple of ids) -> end position of its latest occurrence.
        self._ends: list[tuple[int, dict[tuple[int, ...], int]]] = [(n, {}) for n in range(n_max, n_min - 1, -1)]
        self._indexed = 0  # end positions [0, _indexed) are registered

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens for the sequence ``tokens`` (its whole token list, the
        prompt first; it only ever grows between calls): the tokens after the latest earlier
        occurrence of its longest matching suffix, ``[]`` when no suffix of ``n_min`` or more
        tokens occurs earlier or ``k`` <= 0."""
        last = len(tokens) - 1
        ends = self._ends
        for e in range(self._indexed, last):  # register the end positions before the last one
            for n, table in ends:
                if e + 1 >= n:
                    table[tuple(tokens[e + 1 - n:e + 1])] = e
        if last > self._indexed:
            self._indexed = last
        if k <= 0:
            return []
        for n, table in ends:
            if n > last:
                continue
            e = table.get(tuple(tokens[last + 1 - n:]))
            if e is not None:
                return list(tokens[e + 1:e + 1 + k])
        return []


class NgramDrafter:
    """Proposes each decoding sequence's draft tokens after a step (``--speculative ngram``):
    at most ``k`` per sequence, and never more than its length limit leaves room to verify
    (a step emits up to ``drafts + 1`` tokens). The per-sequence :class:`NgramIndex` lives in
    ``seq.drafter_state`` (so it goes with the sequence)."""

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        NgramIndex(n_min, n_max)  # a bad size fails here
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, seqs) -> None:
        """Set ``seq.draft_token_ids`` of each running, unfinished sequence of ``seqs``
        (:class:`~runner_service.sequence.Sequence`); ``[]`` for one whose request opted out
        (``disable_speculative_decoding``, a penalty or ``min_tokens``: ``SamplingParams.may_speculate``),
        that has no room, or whose suffix matches nothing."""
        for seq in seqs:
            if seq.is_finished:
                continue
            room = min(self.k, seq.max_total_tokens - seq.num_tokens - 1)
            if room <= 0 or not seq.params.may_speculate:
                seq.draft_token_ids = []
                continue
            index = seq.drafter_state
            if index is None:
                index = seq.drafter_state = NgramIndex(self.n_min, self.n_max)
            seq.draft_token_ids = index.propose(seq.token_ids, room)


class SpeculationGate:
    """Whether a decode step should verify its drafts or decode one token per row, by measured
    throughput: per batch bucket, an exponential moving average (weight ``alpha``) of the tokens
    per second that verify steps and plain decode steps achieved. A step verifies when no verify
    step of its bucket was measured yet, when its verify rate is at least the decode rate, or
    as an exploration (the rates drift with the acceptance of the requests running): after
    ``explore_every`` steps the gate turned down, then after twice as many each time the
    exploration confirms the decline, up to ``max_explore_every`` (an exploration at a large
    batch costs several decode steps), back to ``explore_every`` once verify wins. The first step
    of each kind and bucket is not counted (a shape's first call can cost many later ones). The engine consults it while a compiled decode program
    is installed (an eager verify step can cost several of its steps; a compiled one still costs
    more than a decode step, which low acceptance does not repay) and resets it whenever a program
    is installed (:meth:`reset`)."""

    def __init__(self, alpha: float = 0.2, explore_every: int = 8, max_explore_every: int = 64) -> None:
        self.alpha, self.explore_every, self.max_explore_every = alpha, explore_every, max_explore_every
        self._rates: dict[tuple[str, int], float] = {}
        self._seen: set[tuple[str, int]] = set()
        self._declined: dict[int, int] = {}  # per bucket: steps turned down since the last exploration
        self._interval: dict[int, int] = {}  # per bucket: turned-down steps between explorations

    def reset(self) -> None:
        """Forget every rate (the steps' costs changed: a program was installed)."""
        self._rates.clear()
        self._seen.clear()
        self._declined.clear()
        self._interval.clear()

    def allow(self, bucket: int) -> bool:
        """Whether a decode step of batch bucket ``bucket`` with drafts should verify them."""
        verify, decode = self._rates.get(("verify", bucket)), self._rates.get(("decode", bucket))
        if verify is None or decode is None or verify >= decode:
            self._interval[bucket] = self.explore_every
            return verify is None or decode is not None
        declined = self._declined[bucket] = self._declined.get(bucket, 0) + 1
        interval = self._interval.setdefault(bucket, self.explore_every)
        if declined < interval:
            return False
        self._declined[bucket] = 0
        self._interval[bucket] = min(2 * interval, self.max_explore_every)
        return True

    def record(self, kind: str, bucket: int, tokens: int, seconds: float) -> None:
        """A ``kind`` (``verify`` / ``decode``) step of bucket ``bucket`` emitted ``tokens`` in ``seconds``."""
        if seconds <= 0:
            return
        if (kind, bucket) not in self._seen:
            self._seen.add((kind, bucket))
            return
        rate = tokens / seconds
        old = self._rates.get((kind, bucket))
        self._rates[(kind, bucket)] = rate if old is None else old + self.alpha * (rate - old)
