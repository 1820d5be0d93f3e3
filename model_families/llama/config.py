"""The Llama-family architecture config: one schema, parsed once, shared by the weight service
(it is the sidecar's ``config.json``) and the runner.

Field names and semantics are Hugging Face's (``LlamaConfig`` / ``Qwen2Config``). Sizes are
element counts: ``hidden_size`` H, ``intermediate_size`` I, ``head_dim`` hd,
``num_attention_heads`` nh query heads, ``num_key_value_heads`` nkv key/value heads (GQA:
nh % nkv == 0), ``vocab_size`` V. ``rope_scaling`` is ``None`` or the HF dict (``rope_type`` plus
that type's parameters); ``eos_token_id`` is an int, a list of ints or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from model_families.family import FamilyConfig, check_positive_ints
from services.errors import InvalidArgument

#: HF architecture names this family computes (RMSNorm, RoPE, GQA, SwiGLU; Qwen2's q/k/v bias).
ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

#: ``rope_scaling["rope_type"]`` values :func:`model_families.llama.model.rope_inv_freq` computes.
ROPE_TYPES = ("default", "linear", "llama3")

#: Defaults where an HF ``config.json`` leaves a key out (transformers' own defaults).
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6


@dataclass(frozen=True)
class LlamaConfig(FamilyConfig):
    """Llama-family architecture (see the module docstring); validated at construction
    (``InvalidArgument`` with one sentence)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "max_position_embeddings"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise InvalidArgument("model config rms_norm_eps and rope_theta must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise InvalidArgument(f"model config rope_scaling must be an object or null, got {self.rope_scaling!r}")
        if self.rope_type not in ROPE_TYPES:
            raise InvalidArgument(f"rope scaling type {self.rope_type!r} is not supported (supported: {ROPE_TYPES})")
        if self.architecture not in ARCHITECTURES:
            raise InvalidArgument(f"architecture {self.architecture!r} is not a Llama-family model "
                                  f"({', '.join(sorted(ARCHITECTURES))})")

    @property
    def rope_type(self) -> str:
        """``default`` when there is no scaling, else the HF ``rope_type`` (or legacy ``type``)."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: ``(nh + 2 * nkv) * hd``."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim


def _rope(data: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from either transformers 5's ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling`` keys (legacy ``type`` renamed ``rope_type``;
    ``default`` means no scaling)."""
    params = data.get("rope_parameters")
    theta = data.get("rope_theta")
    scaling = data.get("rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") == "default":
            scaling = None
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA), scaling


def config_from_hf(data: Mapping[str, Any], has_tensor: Callable[[str], bool]) -> LlamaConfig:
    """A :class:`LlamaConfig` from an HF ``config.json`` dict with HF defaults: ``head_dim`` =
    H / nh, ``num_key_value_heads`` = nh, rope from ``rope_parameters`` or ``rope_theta`` /
    ``rope_scaling``, ``attention_bias`` true when the config says so or the checkpoint has q
    biases (Qwen2 configs do not say so), ``tie_word_embeddings`` false when absent. The
    architecture is ``architectures[0]`` (or our ``architecture`` key). Raises
    ``InvalidArgument`` for a missing or bad value."""
    archs = data.get("architectures") or [data.get("architecture")]
    n_head, hidden = data.get("num_attention_heads"), data.get("hidden_size")
    if not isinstance(n_head, int) or not isinstance(hidden, int) or n_head < 1:
        raise InvalidArgument("model config lacks hidden_size or num_attention_heads")
    theta, scaling = _rope(data)
    bias = bool(data.get("attention_bias", False)) or has_tensor("model.layers.0.self_attn.q_proj.bias")
    return LlamaConfig(
        vocab_size=data.get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=data.get("intermediate_size"),
        num_hidden_layers=data.get("num_hidden_layers"),
        num_attention_heads=n_head,
        num_key_value_heads=data.get("num_key_value_heads") or n_head,
        head_dim=data.get("head_dim") or hidden // n_head,
        rms_norm_eps=float(data.get("rms_norm_eps", _DEFAULT_RMS_EPS)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=data.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention_bias=bias,
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=data.get("eos_token_id"),
        architecture=str(archs[0]),
    )
