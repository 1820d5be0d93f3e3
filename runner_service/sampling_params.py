"""Per-request sampling parameters, validated at construction (``InvalidArgument``), and the
defaults that resolve their unset fields (``docs/architecture.md`` §8)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from runner_service.limits import check_stops
from services.errors import InvalidArgument
from services.sampling_keys import (
    LOGIT_BIAS_MAX,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    PENALTY_MAX,
    REPETITION_PENALTY_MAX,
)
from services.structured import StructuredSpec

#: Most top-n logprobs a request may ask for per token.
MAX_LOGPROBS = 20


def check_default_max_tokens(value: int | None) -> None:
    """Raise ``InvalidArgument`` unless ``value`` (a ``default_max_tokens``: the runner's, or a
    request's) is ``None`` or >= 1."""
    if value is not None and value < 1:
        raise InvalidArgument(f"default_max_tokens must be >= 1 when set (leave it unset for the engine's "
                              f"default), got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``None`` in ``max_tokens``, ``temperature``, ``top_k`` or ``top_p`` (the proto's unset) is
    the engine's default: :meth:`SamplingDefaults.resolve`, which :meth:`LLMEngine.add_request`
    applies.

    - ``max_tokens``: tokens to generate at most (>= 1), and at most what the context leaves after
      the prompt (more is ``InvalidArgument``, as vLLM and the OpenAI API refuse it); ``None``
      (the proto's unset or 0) is ``default_max_tokens``, else the engine's default, capped to
      what the context leaves.
    - ``temperature``: >= 0; 0 means greedy (argmax), otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens (0 = no limit).
    - ``top_p``: keep the smallest most-likely set whose probability reaches ``top_p``, in (0, 1].
    - ``seed``: seeds this request's own ``torch.Generator`` so its samples do not depend on
      what else is in the batch; ``None`` draws a fresh random seed (``secrets.randbits(63)``) per request.
    - ``stop``: strings that end generation; the matched text is not returned (at most 16, of at
      most 256 bytes each: :func:`runner_service.limits.check_stops`).
    - ``stop_token_ids``: token ids that end generation (the token is returned; at most 64).
    - ``logprobs``: top-n log-probabilities to return per generated token (0..20).
    - ``ignore_eos``: keep generating past the model's EOS tokens.
    - ``default_max_tokens``: what an unset ``max_tokens`` becomes instead of the engine's
      default (>= 1; ``None``: the engine's), capped the same way; for front doors whose API has
      its own default (OpenAI completions: 16).
    - ``disable_speculative_decoding``: decode this request one token per step even when the
      runner speculates (``--speculative``); its output is the same either way (greedy) or
      distributed the same (sampled).
    - ``presence_penalty``, ``frequency_penalty``: in ``[-2, 2]`` (0 = off), vLLM's and OpenAI's
      definitions: a token's logit loses ``presence_penalty`` once if it was generated so far,
      and ``frequency_penalty`` times the number of times it was.
    - ``repetition_penalty``: in ``(0, 2]`` (``None`` or 1 = off): the logit of every token of the
      prompt or generated so far is divided by it when positive, multiplied by it otherwise.
    - ``logit_bias``: token id -> bias in ``[-100, 100]`` added to its logit (at most 300 entries;
      a mapping or ``(id, bias)`` pairs, kept as pairs sorted by id; the ids are checked against
      the vocabulary by :meth:`LLMEngine.add_request <runner_service.engine.LLMEngine.add_request>`).
    - ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled until
      this many tokens were generated (>= 0, at most ``max_tokens``). Stop strings are still
      matched before then.

    The logits are processed as vLLM does (:mod:`runner_service.penalties`): ``min_tokens``'
    mask, then ``logit_bias``, then repetition, frequency and presence penalties, on the raw
    logits before temperature, top-k and top-p (and before greedy's argmax). Returned logprobs
    are those of the raw logits (vLLM's default), not of the processed ones.

    Speculative decoding: a request with a penalty or ``min_tokens`` is never drafted
    (:attr:`may_speculate` is false: each of its tokens changes the next one's logits); one with
    ``logit_bias`` alone is, the bias added at every verified position (it does not depend on it).
    - ``n``: choices to generate for the prompt, 1..:data:`~services.sampling_keys.MAX_N`
      (:meth:`LLMEngine.add_request <runner_service.engine.LLMEngine.add_request>` fans them out;
      with a ``seed`` s choice i samples with seed s + i, mod 2^64).
    - ``structured``: constrain the output to a JSON schema, any JSON object, a regex, one of
      some strings or a grammar (:class:`~services.structured.StructuredSpec`; ``None``: free
      text). The engine compiles it when the request is added (:mod:`runner_service.structured`).
    """

    max_tokens: int | None = None
    temperature: float | None = 1.0
    top_k: int | None = 0
    top_p: float | None = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    default_max_tokens: int | None = None
    disable_speculative_decoding: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] = ()
    min_tokens: int = 0
    n: int = 1
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_default_max_tokens(self.default_max_tokens)
        if self.temperature is not None and not self.temperature >= 0:  # also rejects NaN
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must be in [0, 2^64), got {self.seed}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 1 <= self.n <= MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}] (choices per request), got {self.n}")
        check_stops(self.stop, self.stop_token_ids)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_MAX <= value <= PENALTY_MAX:  # also rejects NaN
                raise InvalidArgument(f"{name} must be in [{-PENALTY_MAX:g}, {PENALTY_MAX:g}] (0 turns it off), "
                                      f"got {value}")
        rp = self.repetition_penalty
        if rp is not None and not 0 < rp <= REPETITION_PENALTY_MAX:
            raise InvalidArgument(f"repetition_penalty must be in (0, {REPETITION_PENALTY_MAX:g}] (1 or unset turns "
                                  f"it off), got {rp}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"min_tokens {self.min_tokens} is more than max_tokens {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on: the request needs its token
        counts (a :class:`runner_service.penalties.PenaltyState` slot)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or (self.repetition_penalty is not None and self.repetition_penalty != 1))

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are processed before sampling (a penalty, ``logit_bias`` or
        ``min_tokens``); a batch where no row does skips the processing entirely."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def may_speculate(self) -> bool:
        """Whether a drafter may propose draft tokens for this request: not when it opted out
        (``disable_speculative_decoding``), has a penalty or ``min_tokens`` (see the class
        docstring)."""
        return not (self.disable_speculative_decoding or self.penalized or self.min_tokens > 0)


def check_logit_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """``bias`` (a mapping or ``(token id, bias)`` pairs; a repeated id keeps its last bias) as
    ``(id, bias)`` pairs sorted by id. Raises ``InvalidArgument`` for more than
    :data:`~services.sampling_keys.MAX_LOGIT_BIAS_ENTRIES` entries or a bias that is not a
    finite number in ``[-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]``. The ids are the engine's to check
    against its vocabulary."""
    pairs = dict(bias.items() if isinstance(bias, Mapping) else bias)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out = []
    for token, value in sorted((int(t), v) for t, v in pairs.items()):
        if not (math.isfinite(value) and -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX):
            raise InvalidArgument(f"logit_bias of token {token} must be a finite number in [{-LOGIT_BIAS_MAX:g}, "
                                  f"{LOGIT_BIAS_MAX:g}], got {value}")
        out.append((token, float(value)))
    return tuple(out)


@dataclass(frozen=True)
class SamplingDefaults:
    """The one place a request's unset sampling fields are resolved (:meth:`resolve`). The
    values are the model's generation config where it has one
    (:meth:`runner_service.generation_config.GenerationConfig.sampling_defaults`), else the
    runner's own: ``EngineConfig.default_max_tokens``, temperature 0 (greedy, what an unset
    temperature has always meant on the wire), no top-k, top-p 1.0. Validated like
    :class:`SamplingParams` (``InvalidArgument``)."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                       top_p=self.top_p)

    def resolve(self, params: SamplingParams, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """``params`` with nothing unset: ``temperature``, ``top_k``, ``top_p`` left ``None`` take
        these defaults; ``max_tokens`` ``None`` becomes the request's ``default_max_tokens``, else
        :attr:`max_tokens`, capped to the ``max_model_len - prompt_tokens`` tokens the context
        leaves. A ``max_tokens`` above that raises ``InvalidArgument`` (as vLLM and the OpenAI API
        refuse it, rather than silently generating fewer tokens than asked), and so does a
        ``min_tokens`` above the resolved ``max_tokens``."""
        left = max_model_len - prompt_tokens
        default = params.default_max_tokens or self.max_tokens
        if params.max_tokens is not None and params.max_tokens > left:
            raise InvalidArgument(
                f"max_tokens {params.max_tokens} is more than the context leaves: the prompt has {prompt_tokens} "
                f"of the {max_model_len}-token context, so at most {left} can be generated; ask for at most "
                f"{left}, or leave max_tokens unset (the default, {default}, is capped to what the context leaves)")
        max_tokens = min(default, left) if params.max_tokens is None else params.max_tokens
        if params.min_tokens > max_tokens:
            raise InvalidArgument(
                f"min_tokens {params.min_tokens} is more than max_tokens {max_tokens}"
                + ("" if params.max_tokens is not None else f" (unset: the default, {default})" if default <= left
                   else f" (unset: the default {default}, capped to the {left} tokens the context leaves)"))
        return replace(params, max_tokens=max_tokens,
                       temperature=self.temperature if params.temperature is None else params.temperature,
                       top_k=self.top_k if params.top_k is None else params.top_k,
                       top_p=self.top_p if params.top_p is None else params.top_p)
