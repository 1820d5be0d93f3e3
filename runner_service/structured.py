"""Structured output: a request's ``StructuredOutput`` compiled into a grammar over the engine's
tokenizer, and the token masks that keep its output inside that grammar (``docs/architecture.md``
§8 "Structured output").

Engine: `llguidance <https://github.com/guidance-ai/llguidance>`_ (Rust, no Python dependencies):
it builds its token trie from the ``tokenizer.json`` the runner already holds (a GGUF's exported
one too), compiles JSON schemas, regexes and Lark grammars (GBNF converted to Lark), and computes
a next-token bitmask in microseconds. It is imported on the first constrained request only.

**Compile** (:class:`GrammarCompiler`, on the request's own thread: :meth:`LLMEngine.add_request
<runner_service.engine.LLMEngine.add_request>` runs on a gRPC handler thread, never on the
stepping one): the spec becomes llguidance's grammar, a matcher is built under
:data:`PARSER_LIMITS`, and its first mask is computed (the lexer's start-up work, so that it is
paid here and errors surface here). A grammar that is invalid, over
:data:`~services.structured.MAX_STRUCTURED_BYTES`, over a parser limit, or slower to compile
than :data:`COMPILE_SECONDS` is ``InvalidArgument`` naming the problem, raised before the
sequence is queued (no KV block is taken). Matchers at their start state are kept in an LRU of
:data:`COMPILE_CACHE_SIZE` entries keyed by (kind, text, choices, tokenizer identity), refusals
too; each request steps its own copy (``deep_copy``, microseconds), held by its sequence
(``Sequence.grammar``).

**Whitespace policy**: JSON (``json_schema``, ``json_object``) is generated with
:data:`JSON_OPTIONS`: no free whitespace (``whitespace_flexible`` false) and fixed separators
``", "`` and ``": "`` (Python's ``json.dumps`` layout), so a model cannot loop on spaces or
newlines inside a document and its output is one line. Regexes and grammars allow exactly the
whitespace they spell out.

**Masking** (:class:`GrammarMasks`, the stepping thread's): right before sampling, the rows
that have a grammar get their mask filled into one persistent ``int32`` bitmask buffer (one row
per sampled position, allocated on first use) and applied to their logits in place: every token
the grammar does not allow next is ``-inf``, the model's padding ids past the tokenizer's
vocabulary included, so greedy and sampled rows alike never pick one. EOS is allowed only where
the grammar accepts. Logprobs are therefore those of the masked distribution. Rows without a
grammar are not touched, and a batch without one pays nothing. After sampling each row's tokens
are consumed into its matcher; when the matcher is stopped (the grammar is complete and nothing
can follow, or EOS was consumed) the request finishes with ``STOP`` (:func:`consume`,
:func:`finish_completed`).

**Speculative decoding**: a constrained row's drafts are walked through its matcher before
verification: the mask is computed at each position and the draft consumed if allowed; the
drafts are cut at the first one the grammar refuses (:meth:`GrammarMasks.apply_verify`), every
verified position's logits are masked, and after :meth:`Sampler.verify
<runner_service.sampler.Sampler.verify>` the matcher is rolled back by the drafts not accepted
and the emitted correction or bonus token consumed (or dropped, when the accepted drafts
completed the grammar). Accepted drafts and corrections therefore
obey the grammar as one-token-per-step decoding does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from runner_service.output_processor import RequestOutput
from runner_service.sequence import FinishReason
from runner_service.sequence import Sequence as Seq
from runner_service.tokenizer import Tokenizer
from services.errors import InvalidArgument
from services.structured import MAX_STRUCTURED_BYTES, StructuredSpec

log = logging.getLogger(__name__)

#: llguidance's ``LLParserLimits``, as keyword arguments: the lexer's fuel for building its regexes
#: (~50k/ms) and per mask (~14k/ms), Earley items per mask (~20k/ms), lexer states (1-2 kB each),
#: grammar symbols. A grammar over one of them is refused at compile, or (a step over its fuel)
#: ends the request: its matcher then allows EOS only.
PARSER_LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                 "max_items_in_row": 20_000, "max_lexer_states": 100_000, "max_grammar_size": 200_000,
                 "verbose_errors": False}
#: Wall-clock bound of one compile (the grammar, its matcher, its first mask): one slower than this
#: is refused (and remembered as refused), since each of its steps would be paid by the batch.
COMPILE_SECONDS = 2.0
#: Compiled grammars (and refusals) kept, least recently used dropped first.
COMPILE_CACHE_SIZE = 128
#: llguidance's JSON options: the whitespace policy of the module docstring.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Longest llguidance error message kept in a refusal.
_MAX_ERROR_CHARS = 500


def _llguidance():
    """The llguidance module (imported on first use: ~40 ms alone, kept off the runner's start-up)."""
    import llguidance

    return llguidance


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for ``spec`` (JSON schemas with :data:`JSON_OPTIONS`). Raises
    ``InvalidArgument`` for a schema that is not JSON or a grammar that is neither Lark nor GBNF."""
    llg = _llguidance()
    if spec.kind in ("json_schema", "json_object"):
        schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidArgument(f"the structured output's JSON schema is not a JSON object: {e}") from None
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
    try:
        return llg.grammar_from("grammar", spec.text)  # Lark as is; GBNF converted to Lark
    except ValueError as e:
        raise InvalidArgument(f"the structured output's grammar is neither Lark nor GBNF: {e}") from None


class _Cache:
    """The process's compile cache: key -> pristine matcher or the ``InvalidArgument`` refusing it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.entries: OrderedDict[tuple, object] = OrderedDict()

    def get(self, key: tuple) -> object | None:
        with self.lock:
            value = self.entries.get(key)
            if value is not None:
                self.entries.move_to_end(key)
            return value

    def put(self, key: tuple, value: object) -> None:
        with self.lock:
            self.entries[key] = value
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)


_CACHE = _Cache(COMPILE_CACHE_SIZE)
#: LLTokenizers by tokenizer identity (shared by engines over the same tokenizer).
_LLTOKENIZERS: dict[str, object] = {}
_LLTOKENIZERS_LOCK = threading.Lock()


class GrammarCompiler:
    """Compiles :class:`StructuredSpec` for one engine's tokenizer (any thread). ``vocab_size``:
    the model's (its logits' width; may exceed the tokenizer's, the rest are padding ids, always
    masked); ``eos_token_ids``: the tokens the grammar allows once it accepts."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size) if tokenizer is not None else vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._key: str | None = None
        self._lltok = None
        self._refusal: InvalidArgument | None = None  # the tokenizer llguidance cannot read, once seen

    @property
    def mask_words(self) -> int:
        """``int32`` words of one mask row (32 tokens each)."""
        return (self.vocab_size + 31) // 32

    def _lltokenizer(self):
        """(identity, LLTokenizer), built on first use (~0.2 s for a 49k vocabulary). Raises
        ``InvalidArgument`` when there is no tokenizer or llguidance cannot read it (remembered)."""
        with self._lock:
            if self._refusal is not None:
                raise InvalidArgument(str(self._refusal))
            if self._lltok is None:
                if self._tokenizer is None:
                    raise InvalidArgument("structured output needs the model's tokenizer, and this engine has none")
                if not self._eos:
                    raise InvalidArgument("structured output needs an EOS token, and this model has none")
                text = self._tokenizer.to_json()
                key = hashlib.sha256(f"{self.vocab_size}|{self._eos}|".encode() + text.encode()).hexdigest()
                with _LLTOKENIZERS_LOCK:
                    lltok = _LLTOKENIZERS.get(key)
                    if lltok is None:
                        try:
                            lltok = _llguidance().LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos)
                        except Exception as e:  # llguidance's ValueError for a tokenizer it cannot map to bytes
                            self._refusal = InvalidArgument(
                                f"structured output is not available for this model: its tokenizer is one "
                                f"llguidance cannot read ({e})")
                            raise InvalidArgument(str(self._refusal)) from None
                        _LLTOKENIZERS[key] = lltok
                self._key, self._lltok = key, lltok
            return self._key, self._lltok

    def compile(self, spec: StructuredSpec):
        """A matcher for ``spec`` at its start state, this request's own (see the module
        docstring). Raises ``InvalidArgument`` (reason ``structured`` for a limit)."""
        key, lltok = self._lltokenizer()
        cache_key = (spec.kind, spec.text, spec.choices, key)
        cached = _CACHE.get(cache_key)
        if cached is None:
            cached = self._build(spec, lltok)
            _CACHE.put(cache_key, cached)
        if isinstance(cached, InvalidArgument):
            raise InvalidArgument(str(cached), reason=cached.reason)
        return cached.deep_copy()

    def _build(self, spec: StructuredSpec, lltok):
        """A pristine matcher, its first mask computed, or the ``InvalidArgument`` refusing ``spec``."""
        llg = _llguidance()
        what = f"the structured output's {spec.kind.replace('_', ' ')}"
        t0 = time.perf_counter()
        try:
            grammar = grammar_text(spec)
        except InvalidArgument as e:
            return e
        if len(grammar.encode()) > 4 * MAX_STRUCTURED_BYTES:
            return InvalidArgument(f"{what} compiles to a grammar over {4 * MAX_STRUCTURED_BYTES} bytes",
                                   reason="structured")
        matcher = llg.LLMatcher(lltok, grammar, log_level=0, limits=llg.LLParserLimits(**PARSER_LIMITS))
        if not matcher.is_error():
            mask = torch.empty(self.mask_words, dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if matcher.is_error():
            return InvalidArgument(f"{what} is not valid or is over a limit: "
                                   f"{_first_lines(matcher.get_error())}", reason="structured")
        seconds = time.perf_counter() - t0
        if seconds > COMPILE_SECONDS:
            return InvalidArgument(f"{what} took {seconds:.1f} s to compile; at most {COMPILE_SECONDS} s",
                                   reason="structured")
        return matcher


def _first_lines(error: str) -> str:
    """llguidance's error on one line, without its parser-state dump and source excerpts (the
    ``  1 | ...`` and ``^`` lines), at most :data:`_MAX_ERROR_CHARS`."""
    lines = [ln.strip() for ln in error.split("\n<state>")[0].splitlines()]
    text = " ".join(ln for ln in lines if ln and not ln.startswith("^") and not re.match(r"\d+ \|", ln))
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def constrained(seqs: Sequence[Seq]) -> bool:
    """Whether any of ``seqs`` has a grammar."""
    return any(s.grammar is not None for s in seqs)


class GrammarMasks:
    """The bitmask buffer of one engine (``rows`` mask rows: every sampled position of a step)
    and the per-step masking (the stepping thread's only)."""

    def __init__(self, rows: int, words: int) -> None:
        self.rows, self.words = rows, words
        self._buf: torch.Tensor | None = None

    def _buffer(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.zeros(self.rows, self.words, dtype=torch.int32)
        return self._buf

    def _fill(self, r: int, matcher) -> None:
        row = self._buffer()[r]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)

    def _mask(self, targets: list[torch.Tensor]) -> None:
        """Set ``-inf`` in ``targets[r]`` (a [V] view of the logits) wherever filled row ``r``
        disallows the token (bit 0, or past the mask: ids the tokenizer does not have)."""
        n, vocab = len(targets), targets[0].shape[-1]
        words = self._buffer()[:n].numpy().view(np.uint8)  # little-endian int32 words: bit b of byte k is id 8k + b
        bits = np.unpackbits(words, axis=1, count=vocab, bitorder="little")
        disallowed = (torch.from_numpy(bits) == 0).to(targets[0].device)
        with torch.inference_mode():  # the model's logits are inference tensors
            for r, row in enumerate(targets):
                row.masked_fill_(disallowed[r], float("-inf"))

    def apply(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> None:
        """Mask ``logits`` [n, V] in place: row ``i`` to what ``seqs[i]``'s grammar allows next
        (rows without one untouched)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        for r, i in enumerate(rows):
            self._fill(r, seqs[i].grammar)
        self._mask([logits[i] for i in rows])

    def apply_verify(self, logits: torch.Tensor, seqs: Sequence[Seq],
                     drafts: Sequence[list[int]]) -> tuple[list[list[int]], list[int]]:
        """A speculative step: walk each constrained row's drafts through its matcher (masking
        each position, consuming each draft the grammar allows, stopping at the first it does not),
        mask ``logits`` [n, S, V] at positions ``0 .. k_i`` in place. Returns the drafts to verify
        (each constrained row's cut to its ``k_i`` allowed ones) and ``k_i`` per row (0 for rows
        without a grammar): the drafts each matcher consumed, for :func:`consume`."""
        verified, walked, pairs = [], [], []
        for i, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
            m = seq.grammar
            if m is None:
                verified.append(d)
                walked.append(0)
                continue
            k = m.validate_tokens(d) if d else 0
            for j in range(k + 1):
                self._fill(len(pairs), m)
                pairs.append((i, j))
                if j < k:
                    m.consume_token(d[j])
                    if m.is_stopped():  # the grammar is complete: the drafts after it are moot
                        k = j + 1
                        break
            verified.append(list(d[:k]))
            walked.append(k)
        if pairs:
            self._mask([logits[i, j] for i, j in pairs])
        return verified, walked


def consume(seqs: Sequence[Seq], emitted: list[list[int]], walked: Sequence[int] | None = None) -> list[list[int]]:
    """After sampling, before :meth:`Scheduler.postprocess
    <runner_service.scheduler.Scheduler.postprocess>`: each constrained row consumes what it
    emitted (``emitted[i]``: its one sampled token; with ``walked`` (:meth:`GrammarMasks.apply_verify`)
    its accepted drafts and the target model's token: the matcher is rolled back by the walked
    drafts not accepted, then consumes the last). Returns ``emitted``, where a row whose accepted
    drafts already completed the grammar drops the token after them (one token per step would
    have finished there)."""
    out = list(emitted)
    for i, (seq, e) in enumerate(zip(seqs, emitted, strict=True)):
        m = seq.grammar
        if m is None:
            continue
        if walked is not None:
            m.rollback(walked[i] - (len(e) - 1))
            if len(e) > 1 and m.is_stopped():
                out[i] = e[:-1]
                continue
        if not m.consume_token(e[-1]):
            log.warning("request %s: its grammar refused token %d (%s); finishing it", seq.request_id, e[-1],
                        _first_lines(m.get_error()))
    return out


def finish_completed(seqs: Sequence[Seq], outs: list[RequestOutput]) -> None:
    """After :meth:`OutputProcessor.process <runner_service.output_processor.OutputProcessor.process>`:
    a constrained row whose matcher is stopped finishes: ``STOP`` when its grammar is complete
    (or EOS consumed), ``ABORTED`` when the matcher failed (a parser limit hit in the middle of
    generation, which a compile cannot always foresee: the output would not be what was asked,
    so it is not reported as a normal stop). The caller finishes the sequence, as for a stop
    string."""
    for seq, out in zip(seqs, outs, strict=True):
        m = seq.grammar
        if m is None or not m.is_stopped():
            continue
        if m.is_error():
            log.warning("request %s: its grammar failed while generating (%s); aborting it", seq.request_id,
                        _first_lines(m.get_error()))
            out.finish_reason = FinishReason.ABORTED
        elif out.finish_reason is not FinishReason.STOP:
            out.finish_reason = FinishReason.STOP
