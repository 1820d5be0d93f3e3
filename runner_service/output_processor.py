"""Text out of the token stream (vLLM v1's ``OutputProcessor``): per request, detokenize each
sampled token incrementally, check stop strings, and queue :class:`RequestOutput` deltas and the
final one (finish reason, usage) for its :class:`RequestStream`. The scheduler stays token-level.
See ``docs/architecture.md`` §8 and §11.

Threads: :class:`OutputProcessor` is the engine's stepping thread's only; a
:class:`RequestStream` is read by its consumer.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from runner_service.detokenizer import IncrementalDetokenizer
from runner_service.sampler import TokenLogprobs
from runner_service.sequence import FinishReason
from runner_service.sequence import Sequence as Seq
from runner_service.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """A streamed delta (or, from :meth:`RequestStream.result`, the whole output).

    ``token_ids``/``text``/``logprobs`` are new since the previous delta; ``finish_reason`` is set
    on the last delta only, with the usage counts (tokens). ``index`` names the choice (0 .. n-1;
    ``request_id`` is the request's, whichever choice): each choice's last delta has its finish
    reason and its usage, the prompt's tokens and that choice's completion tokens.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    index: int = 0


def merge_outputs(outs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one choice of a request as one: token ids, text and logprobs
    concatenated in order; the finish reason and the usage counts of the last (only the last
    delta of a choice has a finish reason). ``outs`` is not empty; one delta is returned as it
    is. Raises ``ValueError`` for deltas of different choices."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    if any(o.index != last.index for o in outs):
        raise ValueError("merge_outputs: deltas of different choices are never merged")
    return RequestOutput(last.request_id, [t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                         [lp for o in outs for lp in o.logprobs], last.finish_reason, last.prompt_tokens,
                         last.completion_tokens, last.index)


def merge_by_choice(outs: Sequence[RequestOutput]) -> list[RequestOutput]:
    """Deltas of one request (in stream order) merged choice by choice (:func:`merge_outputs`):
    one delta per choice present, in the order the choices first appear."""
    by_index: dict[int, list[RequestOutput]] = {}
    for out in outs:
        by_index.setdefault(out.index, []).append(out)
    return [merge_outputs(group) for group in by_index.values()]


class RequestStream:
    """The consumer side of one request: iterate its deltas, or :meth:`cancel` it (``abort``:
    the engine's :meth:`~runner_service.engine.LLMEngine.abort`). ``n`` choices stream
    interleaved (each delta's ``index``); the stream is finished once every choice's last delta
    was taken."""

    def __init__(self, request_id: str, prompt_tokens: int, abort: Callable[[str], None], n: int = 1) -> None:
        self._abort = abort
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.n = n
        self._running = n  # choices whose last delta was not taken yet
        self.queue: queue.Queue[RequestOutput] = queue.Queue()
        self.finished = False

    def get(self, timeout: float | None = None, *, block: bool = True) -> RequestOutput:
        """Next delta; raises ``queue.Empty`` after ``timeout`` seconds (at once, when
        ``block`` is false and none is queued)."""
        out = self.queue.get(block, timeout)
        if out.finish_reason is not None:
            self._running -= 1
            self.finished = self._running == 0
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    def coalesced(self) -> Iterator[RequestOutput]:
        """Like iterating, but each delta comes merged with every delta queued behind it by the
        time it is taken, choice by choice (:func:`merge_by_choice`): the first wait blocks, the
        rest never does, so no delta waits for a later one, and a consumer slower than the
        engine gets one delta per choice for all the tokens it fell behind by instead of one per
        token."""
        while not self.finished:
            outs = [self.get()]
            while not self.finished:
                try:
                    outs.append(self.get(block=False))
                except queue.Empty:
                    break
            yield from merge_by_choice(outs)

    def cancel(self) -> None:
        """Abort the request; its blocks are freed and a final CANCELLED delta is sent."""
        self._abort(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end and merge all deltas (needs the engine loop running, or steps
        driven by another thread). Raises ``ValueError`` for a request with several choices
        (see :meth:`results`)."""
        if self.n != 1:
            raise ValueError(f"the request has {self.n} choices: use results()")
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[RequestOutput]:
        """Like :meth:`result`, one merged output per choice, in ``index`` order."""
        totals = [RequestOutput(self.request_id, prompt_tokens=self.prompt_tokens, index=i) for i in range(self.n)]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.finished:
            out = self.get(None if deadline is None else max(0.0, deadline - time.monotonic()))
            total = totals[out.index]
            total.token_ids += out.token_ids
            total.text += out.text
            total.logprobs += out.logprobs
            total.finish_reason = out.finish_reason
            total.completion_tokens = out.completion_tokens
        return totals


@dataclass
class _RequestState:
    seq: Seq
    stream: RequestStream
    detok: IncrementalDetokenizer
    index: int = 0  # the choice the sequence is


class OutputProcessor:
    """The in-flight requests' output state. ``tokenizer=None``: outputs carry ids, no text."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add(self, seq: Seq, stream: RequestStream, index: int = 0) -> None:
        """Track a sequence from now on: choice ``index`` of ``stream``'s request (its stop
        strings: ``seq.params.stop``). Sequences are keyed by their own ``request_id``."""
        self._requests[seq.request_id] = _RequestState(
            seq, stream, IncrementalDetokenizer(self._tokenizer, seq.params.stop), index)

    def seq(self, request_id: str) -> Seq | None:
        """The in-flight sequence of that id, ``None`` when unknown or finished."""
        state = self._requests.get(request_id)
        return None if state is None else state.seq

    def seqs_of(self, request_id: str) -> list[Seq]:
        """The in-flight sequences of a request: the one of that id, else its choices'."""
        state = self._requests.get(request_id)
        if state is not None:
            return [state.seq]
        return [s.seq for s in self._requests.values() if s.stream.request_id == request_id]

    def seqs(self) -> list[Seq]:
        """The in-flight requests' sequences."""
        return [state.seq for state in self._requests.values()]

    def process(self, seqs: Sequence[Seq], logprobs: Sequence[TokenLogprobs | list[TokenLogprobs] | None],
                counts: Sequence[int] | None = None) -> list[RequestOutput]:
        """One delta per sampling sequence of a step, after :meth:`Scheduler.postprocess
        <runner_service.scheduler.Scheduler.postprocess>` appended its token: the token, its new
        text and logprobs. The token goes to the detokenizer unless a stop token or EOS finished
        the sequence (``STOP``); a stop string it completes makes the delta's ``finish_reason``
        ``STOP`` (also over ``LENGTH``), and the caller must then finish the sequence if the
        scheduler has not. Otherwise ``finish_reason`` is the scheduler's (``None``: running).

        ``counts`` (a speculative step): sequence ``i`` appended its last ``counts[i]`` tokens,
        ``logprobs[i]`` a list of theirs; they go to the detokenizer in order, and a stop string
        one of them completes drops the tokens after it from the delta and from the sequence
        (as if it had been decoded one token per step). Queues nothing: hand each delta to
        :meth:`publish` or :meth:`finish`."""
        outs = []
        if counts is None:
            for seq, lp in zip(seqs, logprobs, strict=True):
                state = self._requests[seq.request_id]
                token = seq.last_token
                reason = seq.finish_reason
                if reason is not FinishReason.STOP and state.detok.push(token):
                    reason = FinishReason.STOP
                outs.append(RequestOutput(state.stream.request_id, [token], state.detok.delta(),
                                          [lp] if lp is not None else [], reason, seq.num_prompt_tokens,
                                          seq.num_completion_tokens, state.index))
            return outs
        for seq, lps, m in zip(seqs, logprobs, counts, strict=True):
            state = self._requests[seq.request_id]
            tokens = seq.token_ids[len(seq.token_ids) - m:]
            reason = seq.finish_reason
            pushed = tokens[:-1] if reason is FinishReason.STOP else tokens  # the stop token / EOS is not text
            for j, token in enumerate(pushed):
                if state.detok.push(token):
                    reason = FinishReason.STOP
                    del seq.token_ids[len(seq.token_ids) - (m - j - 1):]
                    tokens = tokens[:j + 1]
                    break
            outs.append(RequestOutput(state.stream.request_id, tokens, state.detok.delta(),
                                      list(lps or [])[:len(tokens)], reason, seq.num_prompt_tokens,
                                      seq.num_completion_tokens, state.index))
        return outs

    def publish(self, seq: Seq, out: RequestOutput) -> None:
        """Queue a delta of ``seq``, still running."""
        self._requests[seq.request_id].stream.queue.put(out)

    def finish(self, seq: Seq, reason: FinishReason, out: RequestOutput | None = None) -> str | None:
        """Queue ``seq``'s final delta (``out``, else an empty one) with the text held back so
        far, ``reason`` and the usage counts, and forget the sequence. Free its blocks first.
        Returns the request's id when this was its last choice in flight, else ``None``."""
        state = self._requests.pop(seq.request_id)
        stream = state.stream
        if out is None:
            out = RequestOutput(stream.request_id, prompt_tokens=seq.num_prompt_tokens, index=state.index)
        out.text += state.detok.flush()
        out.finish_reason = reason
        out.completion_tokens = seq.num_completion_tokens
        stream.queue.put(out)
        if stream.n > 1 and any(s.stream is stream for s in self._requests.values()):
            return None
        return stream.request_id
