"""The engine's serving limits (:class:`EngineConfig`): a frozen dataclass validated at
construction; a bad value raises :class:`services.errors.InvalidArgument` with one sentence.
The model's architecture is its family's config (:mod:`model_families`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernel_cache_service.leases import MAX_LEASE_TTL_S, MIN_LEASE_TTL_S
from runner_service import options as opt
from runner_service.sampling_params import check_default_max_tokens
from services.errors import InvalidArgument

if TYPE_CHECKING:
    from model_families.family import FamilyConfig


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits of one engine; validated at construction. The defaults and choices of the
    fields a ``runner serve`` flag sets are that flag's (:mod:`runner_service.options`).

    - ``max_num_seqs``: sequences resident at once (decode batch size at most); with ``compile``
      on, at most :data:`~runner_service.options.MAX_PROGRAM_BATCH`.
    - ``max_num_batched_tokens``: tokens one scheduler step may compute (prefill chunk budget);
      ``None`` = ``max(2048, max_model_len)``.
    - ``max_model_len``: context length in tokens (prompt + generated); ``None`` = the model's
      ``max_position_embeddings`` capped at 2048.
    - ``block_size``: tokens per KV block.
    - ``kv_cache_bytes``: bytes for K and V of all layers; ``None`` = ``kv_cache_memory_fraction``
      of the device's free memory, capped at what ``max_num_seqs`` full-length sequences need.
    - ``dtype``: compute and KV dtype, ``"f32"``, ``"bf16"`` or ``"auto"`` (bf16 where the
      device computes it natively, :func:`runner_service.device.resolve_dtype`). The library
      default stays ``"f32"``; the runner CLI defaults to ``auto``.
    - ``compile``: ``"off"`` (eager), ``"inductor"`` or ``"aoti"`` (programs from
      :mod:`runner_service.programs`).
    - ``device``: ``"auto"``, ``"cpu"``, ``"cuda[:N]"`` or ``"npu[:N]"``.
    - ``default_max_tokens``: used when a request leaves ``max_tokens`` unset (or 0) and the model's
      ``generation_config.json`` gives no ``max_new_tokens``; capped to what the context leaves.
    - ``num_threads``: CPU threads for torch ops (``torch.set_num_threads``, process-wide);
      ``None`` keeps torch's default. On a shared, oversubscribed host 1 thread avoids OpenMP
      barrier stalls.
    - ``enable_prefix_caching``: reuse full KV blocks across requests that share a token prefix
      (:mod:`runner_service.block_manager`); on by default, and effective only for a model family
      that declares :attr:`~model_families.family.ModelFamily.supports_prefix_caching`.
    - ``quantized_activations``: :data:`~model_families.dtypes.QUANTIZED_ACTIVATIONS`: with bf16
      compute, ``int8`` multiplies int4 matrices and a quantized sidecar's int8 head copy by each
      row's activations quantized per group of 32 (``warmserve::int4_mm_tiles_a8``,
      ``docs/quantization.md``) where the CPU has AVX512-VNNI; ``bf16`` by the activations as they are.
    - ``batch_invariant``: every request's tokens are bitwise the same whatever else is in its
      steps, however its prompt is chunked and whether its prefix comes from the prefix cache
      (:mod:`model_families.invariant`); greedy and seeded sampling alike. The steps run eager
      (``compile`` is then treated as ``"off"``: the engine's config says so), for a family that
      declares :attr:`~model_families.family.ModelFamily.supports_batch_invariance`.
    - ``background_compile``: with ``compile="aoti"``, when the programs are not all in the
      kernel cache, serve eager at once and fetch/compile them in a background thread at lower
      CPU priority; each is installed between two engine steps (:meth:`LLMEngine.call_between_steps`).
    - ``max_prompt_bytes``: the largest text or chat prompt, in UTF-8 bytes; a larger one is
      refused before it is tokenized (:func:`runner_service.limits.check_prompt_bytes`).
    - ``speculative``: :data:`~runner_service.options.SPECULATIVE_METHODS` (``off``, or
      ``ngram``: prompt-lookup drafts, :mod:`runner_service.ngram`), for a family that lists the
      method in :attr:`~model_families.family.ModelFamily.speculative_methods`;
      ``num_speculative_tokens`` (``K``, 1 .. :data:`~runner_service.options.MAX_SPECULATIVE_TOKENS`)
      drafts at most per sequence and step; ``prompt_lookup_min`` / ``prompt_lookup_max``: the
      suffix lengths (tokens) the n-gram lookup tries, longest first (at most
      :data:`~runner_service.options.MAX_PROMPT_LOOKUP`).
    - ``build_lease_s``: TTL in seconds of the kernel-cache build lease a runner holds while it
      compiles a program others wait for (renewed every third of it; a runner that dies loses
      it after this long and a waiter takes the build over).
    """

    max_num_seqs: int = opt.MAX_NUM_SEQS.default
    max_num_batched_tokens: int | None = opt.MAX_NUM_BATCHED_TOKENS.default
    max_model_len: int | None = opt.MAX_MODEL_LEN.default
    block_size: int = opt.BLOCK_SIZE.default
    kv_cache_bytes: int | None = opt.KV_CACHE_BYTES.default
    kv_cache_memory_fraction: float = 0.25
    dtype: str = opt.DTYPE.default
    quantized_activations: str = opt.ACTIVATIONS.default
    compile: str = opt.COMPILE.default
    device: str = opt.DEVICE.default
    default_max_tokens: int = 64
    runner_id: str = "runner-0"
    warmup: bool = True
    num_threads: int | None = opt.THREADS.default
    enable_prefix_caching: bool = opt.PREFIX_CACHING.default
    batch_invariant: bool = opt.BATCH_INVARIANT.default
    background_compile: bool = opt.COMPILE_IN_BACKGROUND.default
    build_lease_s: float = opt.BUILD_LEASE_TTL.default
    max_prompt_bytes: int = opt.MAX_PROMPT_BYTES.default
    speculative: str = opt.SPECULATIVE.default
    num_speculative_tokens: int = opt.NUM_SPECULATIVE_TOKENS.default
    prompt_lookup_max: int = opt.PROMPT_LOOKUP_MAX.default
    prompt_lookup_min: int = opt.PROMPT_LOOKUP_MIN.default

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidArgument(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidArgument(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgument(f"max_model_len must be >= 2 tokens, got {self.max_model_len}")
        if self.block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1 token, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise InvalidArgument(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise InvalidArgument(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.dtype not in opt.DTYPES:
            raise InvalidArgument(f"dtype must be one of {opt.DTYPES}, got {self.dtype!r}")
        if self.quantized_activations not in opt.ACTIVATIONS.choices:
            raise InvalidArgument(f"quantized_activations must be one of {opt.ACTIVATIONS.choices}, "
                                  f"got {self.quantized_activations!r}")
        if self.compile not in opt.COMPILE_MODES:
            raise InvalidArgument(f"compile must be one of {opt.COMPILE_MODES}, got {self.compile!r}")
        opt.check_program_batch(self.compile, self.max_num_seqs)
        if self.max_prompt_bytes < 1:
            raise InvalidArgument(f"max_prompt_bytes must be >= 1, got {self.max_prompt_bytes}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidArgument(f"num_threads must be >= 1, got {self.num_threads}")
        if not MIN_LEASE_TTL_S <= self.build_lease_s <= MAX_LEASE_TTL_S:
            raise InvalidArgument(f"build_lease_s must be in [{MIN_LEASE_TTL_S:g}, {MAX_LEASE_TTL_S:g}] seconds, "
                                  f"got {self.build_lease_s}")
        check_default_max_tokens(self.default_max_tokens)
        if self.speculative not in opt.SPECULATIVE_METHODS:
            raise InvalidArgument(f"speculative must be one of {opt.SPECULATIVE_METHODS}, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= opt.MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(f"num_speculative_tokens must be in [1, {opt.MAX_SPECULATIVE_TOKENS}], "
                                  f"got {self.num_speculative_tokens}")
        opt.check_prompt_lookup(self.prompt_lookup_min, self.prompt_lookup_max)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per sequence and step: ``num_speculative_tokens`` when speculating, else 0."""
        return 0 if self.speculative == "off" else self.num_speculative_tokens

    def resolved_max_model_len(self, args: FamilyConfig) -> int:
        """Context length in tokens for the model ``args``; raises ``InvalidArgument`` past its
        ``max_position_embeddings``."""
        if self.max_model_len is None:
            return min(args.max_position_embeddings, 2048)
        if self.max_model_len > args.max_position_embeddings:
            raise InvalidArgument(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{args.max_position_embeddings}")
        return self.max_model_len

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """Per-step token budget (prefill chunk size limit)."""
        if self.max_num_batched_tokens is None:
            return max(2048, max_model_len)
        return self.max_num_batched_tokens
