"""Runner configuration: the model's architecture (:class:`ModelArgs`, from the sidecar's
``config.json``) and the engine's serving limits (:class:`EngineConfig`).

Both are frozen dataclasses validated at construction; a bad value raises
:class:`services.errors.InvalidArgument` with one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.errors import InvalidArgument

#: Architectures this runner computes (the Llama family: RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "llama", "MistralForCausalLM", "Qwen2ForCausalLM")

#: ``rope_scaling["rope_type"]`` values understood by :func:`runner_service.model.rope_inv_freq`.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

COMPILE_MODES = ("off", "inductor", "aoti")
DTYPES = ("f32", "bf16")


@dataclass(frozen=True)
class ModelArgs:
    """Llama-family architecture, in the spirit of gpt-fast's ``ModelArgs``.

    Sizes are element counts: ``hidden_size`` H, ``intermediate_size`` I, ``head_dim`` hd,
    ``num_heads`` nh query heads, ``num_kv_heads`` nkv key/value heads (GQA: nh % nkv == 0),
    ``vocab_size`` V. ``rope_scaling`` is ``None`` or the HF dict (``rope_type`` / ``type`` plus
    that type's parameters). ``eos_token_ids`` is a tuple (HF allows an int or a list).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise InvalidArgument(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise InvalidArgument(
                f"rope scaling type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise InvalidArgument(f"architecture {self.architecture!r} is not a Llama-family model")

    @property
    def rope_type(self) -> str:
        """``default`` when there is no scaling, else the HF ``rope_type`` (or legacy ``type``)."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: ``(nh + 2 * nkv) * hd``."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from the sidecar's ``config.json`` dict (keys as in the weight-service contract:
        ``vocab_size``, ``hidden_size``, ..., ``eos_token_id`` int or list, ``architecture``).
        Raises ``InvalidArgument`` when a required key is missing or a value is unsupported."""
        try:
            eos = config.get("eos_token_id")
            eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list | tuple)
                                               else (int(eos),))
            nh = int(config["num_attention_heads"])
            hd = config.get("head_dim") or int(config["hidden_size"]) // nh
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=nh,
                num_kv_heads=int(config.get("num_key_value_heads") or nh),
                head_dim=int(hd),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                rope_scaling=dict(config["rope_scaling"]) if config.get("rope_scaling") else None,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                attention_bias=bool(config.get("attention_bias", False)),
                bos_token_id=None if config.get("bos_token_id") is None else int(config["bos_token_id"]),
                eos_token_ids=eos_ids,
                architecture=str(config.get("architecture", "LlamaForCausalLM")),
            )
        except KeyError as e:
            raise InvalidArgument(f"model config lacks the key {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidArgument):
                raise
            raise InvalidArgument(f"model config has a bad value: {e}") from e


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits of one engine; validated at construction.

    - ``max_num_seqs``: sequences resident at once (decode batch size at most).
    - ``max_num_batched_tokens``: tokens one scheduler step may compute (prefill chunk budget);
      ``None`` = ``max(2048, max_model_len)``.
    - ``max_model_len``: context length in tokens (prompt + generated); ``None`` = the model's
      ``max_position_embeddings`` capped at 2048.
    - ``block_size``: tokens per KV block.
    - ``kv_cache_bytes``: bytes for K and V of all layers; ``None`` = ``kv_cache_memory_fraction``
      of the device's free memory, capped at what ``max_num_seqs`` full-length sequences need.
    - ``dtype``: compute and KV dtype, ``"f32"`` or ``"bf16"``.
    - ``compile``: ``"off"`` (eager), ``"inductor"`` or ``"aoti"`` (programs from
      :mod:`runner_service.programs`).
    - ``device``: ``"auto"``, ``"cpu"``, ``"cuda[:N]"`` or ``"npu[:N]"``.
    - ``default_max_tokens``: used when a request asks for 0 tokens.
    - ``num_threads``: CPU threads for torch ops (``torch.set_num_threads``, process-wide);
      ``None`` keeps torch's default. On a shared, oversubscribed host 1 thread avoids OpenMP
      barrier stalls (measured: 10x faster decode on this 2-core machine under contention).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    dtype: str = "f32"
    compile: str = "off"
    device: str = "auto"
    default_max_tokens: int = 64
    runner_id: str = "runner-0"
    warmup: bool = True
    num_threads: int | None = None

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
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compile not in COMPILE_MODES:
            raise InvalidArgument(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidArgument(f"num_threads must be >= 1, got {self.num_threads}")
        if self.default_max_tokens < 1:
            raise InvalidArgument(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")

    def resolved_max_model_len(self, args: ModelArgs) -> int:
        """Context length in tokens for ``args``; raises ``InvalidArgument`` past the model's limit."""
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
