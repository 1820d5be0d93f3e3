"""Per-request sampling parameters, validated at construction (``InvalidArgument``), and the
defaults that resolve their unset fields (``docs/architecture.md`` §8)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from runner_service.limits import check_stops
from services.errors import InvalidArgument
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
        check_stops(self.stop, self.stop_token_ids)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
        refuse it, rather than silently generating fewer tokens than asked)."""
        left = max_model_len - prompt_tokens
        default = params.default_max_tokens or self.max_tokens
        if params.max_tokens is not None and params.max_tokens > left:
            raise InvalidArgument(
                f"max_tokens {params.max_tokens} is more than the context leaves: the prompt has {prompt_tokens} "
                f"of the {max_model_len}-token context, so at most {left} can be generated; ask for at most "
                f"{left}, or leave max_tokens unset (the default, {default}, is capped to what the context leaves)")
        return replace(params, max_tokens=min(default, left) if params.max_tokens is None else params.max_tokens,
                       temperature=self.temperature if params.temperature is None else params.temperature,
                       top_k=self.top_k if params.top_k is None else params.top_k,
                       top_p=self.top_p if params.top_p is None else params.top_p)
