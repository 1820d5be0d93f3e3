"""The architecture config stored in every sidecar (``warmserve.config`` metadata, ``config.json``).

One flat, JSON-serializable record with Hugging Face names and semantics, whatever the checkpoint
format was. ``rope_scaling`` follows HF (``{"rope_type": "llama3", "factor": ..., ...}`` or
``None``); ``eos_token_id`` is an int or a list of ints.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from services.errors import InvalidArgument


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture. Sizes are element counts; ``rms_norm_eps`` and ``rope_theta`` are
    the HF values. Validated at construction (``InvalidArgument``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    architecture: str

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads {self.num_key_value_heads}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise InvalidArgument("config rms_norm_eps and rope_theta must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise InvalidArgument(f"config rope_scaling must be an object or null, got {self.rope_scaling!r}")

    def to_dict(self) -> dict:
        """Plain dict with exactly the contract's keys."""
        return asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): stable across runs, so it can enter a fingerprint."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Build from a dict with the contract's keys (extra keys ignored; ``InvalidArgument`` when
        one is missing or invalid)."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise InvalidArgument(f"config lacks {', '.join(missing)}")
        try:
            return cls(**{n: data[n] for n in names})
        except TypeError as e:
            raise InvalidArgument(f"invalid config: {e}") from e
