"""The DeepSeek V4 architecture config (``DeepseekV4ForCausalLM``), parsed once from an HF
``config.json`` dict and validated.

Field names and semantics are transformers' (``transformers/models/deepseek_v4/
configuration_deepseek_v4.py``, ``DeepseekV4Config``; the reference is transformers 5.23).
Sizes are element counts: ``hidden_size`` H, ``head_dim`` hd (one shared K=V head,
``num_key_value_heads`` = 1), ``num_attention_heads`` nh, ``q_lora_rank`` qr,
``moe_intermediate_size`` I (routed and shared experts), ``n_routed_experts`` E,
``vocab_size`` V, ``hc_mult`` n_hc residual streams. Lengths (``sliding_window``,
``compress_rates``, ``index_topk``) are in tokens or compressed entries, as stated per field.

Accepted spellings (as transformers' ``__post_init__`` folds them): ``layer_types`` or the
legacy per-layer ``compress_ratios`` (0 = window-only, the CSA rate, the HCA rate);
``compress_rates`` or legacy ``compress_rate_csa`` / ``compress_rate_hca``; ``mlp_layer_types``
or legacy ``num_hash_layers``; ``partial_rotary_factor`` or legacy ``qk_rope_head_dim``;
``rope_parameters`` nested ``{"main": ..., "compress": ...}`` or flat (``rope_parameters`` /
``rope_scaling``, applied to the compress rope only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from model_families.family import FamilyConfig, check_positive_int
from services.errors import InvalidArgument

#: The HF architecture name.
ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM"})

#: Layer kinds (transformers' ``layer_types`` values): sliding-window only, compressed sparse
#: attention (window + compressed entries picked by the lightning indexer), heavily compressed
#: attention (window + all compressed entries).
WINDOW = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_KINDS = (WINDOW, CSA, HCA)

#: MLP kinds (``mlp_layer_types``): hash-routed MoE (``tid2eid[token]`` picks the experts) and
#: learned top-k MoE.
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_KINDS = (HASH_MOE, MOE)

#: Rope labels (keys of the nested ``rope_parameters``): ``main`` for window-only layers,
#: ``compress`` for CSA/HCA layers, their compressors and the indexer.
ROPE_LABELS = ("main", "compress")
ROPE_TYPES = ("default", "yarn")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

#: transformers' defaults (``DeepseekV4Config`` class attributes) where a key is absent.
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6,
    "swiglu_limit": 10.0, "sliding_window": 128, "num_nextn_predict_layers": 1, "hidden_act": "silu",
    "rms_norm_eps": 1.0e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
#: Keys with no default: a config.json must give them.
REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "o_groups", "o_lora_rank",
            "index_n_heads", "index_head_dim", "index_topk")


@dataclass(frozen=True)
class DeepseekV4Config(FamilyConfig):
    """DeepSeek V4 architecture (see the module docstring), validated at construction
    (``InvalidArgument`` with one sentence). Build it with :meth:`from_hf` from a config.json
    dict (defaults and legacy keys resolved) or :meth:`from_dict` from :meth:`to_dict` output."""

    vocab_size: int
    hidden_size: int
    #: I: width of every routed expert and of the one shared expert (``intermediate_size``).
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    #: hd: width of each query head and of the single shared K=V head (512 in the release).
    head_dim: int
    #: qr: rank of the query low-rank projection (``wq_a`` [qr,H], ``wq_b`` [nh*hd,qr]).
    q_lora_rank: int
    #: rd: trailing rope channels of each head (``int(head_dim * partial_rotary_factor)``);
    #: the leading ``hd - rd`` channels get no rope. Interleaved pairs (``x[2i], x[2i+1]``).
    qk_rope_head_dim: int
    #: k: routed experts per token.
    num_experts_per_tok: int
    #: E: routed experts per layer.
    n_routed_experts: int
    #: g: head groups of the grouped output projection (``wo_a`` [g*o_lora_rank, nh*hd/g]).
    o_groups: int
    #: per-group rank of the grouped output projection.
    o_lora_rank: int
    #: lightning-indexer query heads (CSA layers only).
    index_n_heads: int
    #: lightning-indexer head width (its compressor and queries; rope on the trailing rd channels).
    index_head_dim: int
    #: compressed entries each query keeps in a CSA layer (top-k of the indexer's scores).
    index_topk: int
    #: one of :data:`LAYER_KINDS` per layer (transformers' ``layer_types``).
    layer_types: tuple[str, ...]
    #: one of :data:`MLP_KINDS` per layer (transformers' ``mlp_layer_types``).
    mlp_layer_types: tuple[str, ...]
    #: ``{CSA: m, HCA: m'}``: source tokens per compressed entry (release: 4 and 128).
    compress_rates: dict
    #: nested ``{"main": {...}, "compress": {...}}``; each has ``rope_type`` (default/yarn),
    #: ``rope_theta``, ``partial_rotary_factor`` and, for yarn, ``factor``,
    #: ``original_max_position_embeddings``, ``beta_fast``/``beta_slow``, ``attention_factor``.
    rope_parameters: dict
    #: n_win: tokens of the sliding window, the current token included (a query at p sees keys
    #: p-n_win+1 .. p; transformers' ``create_sliding_window_causal_mask``).
    sliding_window: int = 128
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    #: n_hc: parallel residual streams (mHC); hidden state per token is [n_hc, H].
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    #: clamp on the SwiGLU gate (max) and up (both sides) pre-activations, routed and shared.
    swiglu_limit: float = 10.0
    #: MTP layers in the release checkpoint (``mtp.N.*``); not used for serving.
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    architecture: str = "DeepseekV4ForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok",
                     "n_routed_experts", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                     "index_topk", "sliding_window", "max_position_embeddings", "hc_mult", "hc_sinkhorn_iters"):
            check_positive_int(name, getattr(self, name))
        if self.architecture not in ARCHITECTURES:
            raise InvalidArgument(f"architecture {self.architecture!r} is not DeepSeek V4 (DeepseekV4ForCausalLM)")
        if self.num_key_value_heads != 1:
            raise InvalidArgument(f"DeepSeek V4 has one shared K=V head; num_key_value_heads must be 1, "
                                  f"got {self.num_key_value_heads!r}")
        if self.n_shared_experts != 1:
            raise InvalidArgument(f"DeepSeek V4 has one shared expert of width moe_intermediate_size; "
                                  f"n_shared_experts must be 1, got {self.n_shared_experts!r}")
        if self.hidden_act != "silu":
            raise InvalidArgument(f"DeepSeek V4 hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise InvalidArgument(f"scoring_func {self.scoring_func!r} is not one of {SCORING_FUNCS}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise InvalidArgument(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at most head_dim "
                                  f"({self.head_dim})")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise InvalidArgument(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be at most index_head_dim "
                                  f"({self.index_head_dim}): the indexer ropes its trailing channels too")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise InvalidArgument(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                                  f"({self.n_routed_experts})")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise InvalidArgument(f"num_attention_heads * head_dim ({self.num_attention_heads * self.head_dim}) must "
                                  f"be a multiple of o_groups ({self.o_groups})")
        for name, kinds, allowed in (("layer_types", self.layer_types, LAYER_KINDS),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_KINDS)):
            if not isinstance(kinds, tuple) or len(kinds) != self.num_hidden_layers:
                raise InvalidArgument(f"{name} must list one entry per layer ({self.num_hidden_layers}), got "
                                      f"{kinds!r}")
            bad = sorted({k for k in kinds if k not in allowed})
            if bad:
                raise InvalidArgument(f"{name} entries must be one of {allowed}, got {bad}")
        if not isinstance(self.compress_rates, dict) or set(self.compress_rates) != {CSA, HCA}:
            raise InvalidArgument(f"compress_rates must map exactly {CSA!r} and {HCA!r} to a rate, got "
                                  f"{self.compress_rates!r}")
        for kind, rate in self.compress_rates.items():
            check_positive_int(f"compress_rates[{kind!r}]", rate)
        if not isinstance(self.rope_parameters, dict) or set(self.rope_parameters) != set(ROPE_LABELS):
            raise InvalidArgument(f"rope_parameters must be nested as {{'main': ..., 'compress': ...}}, got "
                                  f"{self.rope_parameters!r}")
        for label in ROPE_LABELS:
            rope = self.rope_parameters[label]
            if not isinstance(rope, dict) or rope.get("rope_type") not in ROPE_TYPES:
                raise InvalidArgument(f"rope_parameters[{label!r}] rope_type must be one of {ROPE_TYPES}, got "
                                      f"{rope!r}")
            if not _positive_number(rope.get("rope_theta")):
                raise InvalidArgument(f"rope_parameters[{label!r}] needs a positive rope_theta, got {rope!r}")
            if rope["rope_type"] == "yarn" and not (_positive_number(rope.get("factor")) and rope["factor"] >= 1):
                raise InvalidArgument(f"rope_parameters[{label!r}] is yarn and needs a factor >= 1, got {rope!r}")
        if not _positive_number(self.rms_norm_eps) or not _positive_number(self.hc_eps):
            raise InvalidArgument("model config rms_norm_eps and hc_eps must be positive")
        if not _positive_number(self.swiglu_limit) or not _positive_number(self.routed_scaling_factor):
            raise InvalidArgument("model config swiglu_limit and routed_scaling_factor must be positive")

    # ---- FamilyConfig ----

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict with exactly the dataclass fields (tuples become lists)."""
        data = super().to_dict()
        data["layer_types"] = list(self.layer_types)
        data["mlp_layer_types"] = list(self.mlp_layer_types)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeepseekV4Config:
        """From a dict with this class's keys (e.g. :meth:`to_dict` output, or an HF config.json
        that already spells every derived field); anything else goes through :meth:`from_hf`.
        Raises ``InvalidArgument`` for a missing key or a bad value."""
        required = [f.name for f in fields(cls) if f.default is MISSING]
        if any(n not in data for n in required):
            return cls.from_hf(data)
        values = dict(data)
        values["layer_types"] = _as_tuple("layer_types", values["layer_types"])
        values["mlp_layer_types"] = _as_tuple("mlp_layer_types", values["mlp_layer_types"])
        return super().from_dict(values)

    @classmethod
    def from_hf(cls, data: Mapping[str, Any]) -> DeepseekV4Config:
        """From an HF config.json dict, resolving defaults and legacy keys exactly as
        transformers' ``DeepseekV4Config.__post_init__`` does. ``InvalidArgument`` when a
        required key is missing or a value is bad."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"model config must be an object, got {type(data).__name__}")
        missing = [k for k in REQUIRED if data.get(k) is None]
        if missing:
            raise InvalidArgument(f"DeepSeek V4 model config lacks {', '.join(repr(k) for k in missing)}")
        for key in ("attention_bias", "mlp_bias"):
            if data.get(key):
                raise InvalidArgument(f"DeepSeek V4 has no {key.split('_')[0]} biases; {key} must be false")
        get = lambda key: data[key] if data.get(key) is not None else _DEFAULTS[key]  # noqa: E731
        n = data["num_hidden_layers"]
        check_positive_int("num_hidden_layers", n)
        head_dim = data["head_dim"]
        check_positive_int("head_dim", head_dim)

        rates = dict(data.get("compress_rates") or DEFAULT_COMPRESS_RATES)
        if data.get("compress_rate_csa") is not None:
            rates[CSA] = data["compress_rate_csa"]
        if data.get("compress_rate_hca") is not None:
            rates[HCA] = data["compress_rate_hca"]

        layer_types = data.get("layer_types")
        if layer_types is None and data.get("compress_ratios") is not None:
            by_rate = {0: WINDOW, rates.get(CSA): CSA, rates.get(HCA): HCA}
            ratios = _as_tuple("compress_ratios", data["compress_ratios"])
            bad = sorted({r for r in ratios if r not in by_rate}, key=str)
            if bad:
                raise InvalidArgument(f"compress_ratios entries must be 0 (window-only), the CSA rate "
                                      f"({rates.get(CSA)}) or the HCA rate ({rates.get(HCA)}), got {bad}")
            layer_types = [by_rate[r] for r in ratios]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = _as_tuple("layer_types", layer_types)[:n]

        mlp_types = data.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = data.get("num_hash_layers")
            n_hash = DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
            if not isinstance(n_hash, int) or isinstance(n_hash, bool) or n_hash < 0:
                raise InvalidArgument(f"num_hash_layers must be a non-negative integer, got {n_hash!r}")
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        mlp_types = _as_tuple("mlp_layer_types", mlp_types)[:n]

        factor = data.get("partial_rotary_factor")
        if factor is None:
            legacy_rd = data.get("qk_rope_head_dim")
            factor = legacy_rd / head_dim if legacy_rd is not None else DEFAULT_PARTIAL_ROTARY_FACTOR
        if not _positive_number(factor) or factor > 1:
            raise InvalidArgument(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
        rope_theta, compress_theta = get("rope_theta"), get("compress_rope_theta")
        rope = _rope_parameters(data, rope_theta, compress_theta, factor)

        return super().from_dict({
            "vocab_size": data["vocab_size"], "hidden_size": data["hidden_size"],
            "moe_intermediate_size": data["moe_intermediate_size"], "num_hidden_layers": n,
            "num_attention_heads": data["num_attention_heads"], "head_dim": head_dim,
            "q_lora_rank": data["q_lora_rank"], "qk_rope_head_dim": int(head_dim * factor),
            "num_experts_per_tok": data["num_experts_per_tok"], "n_routed_experts": data["n_routed_experts"],
            "o_groups": data["o_groups"], "o_lora_rank": data["o_lora_rank"],
            "index_n_heads": data["index_n_heads"], "index_head_dim": data["index_head_dim"],
            "index_topk": data["index_topk"], "layer_types": layer_types, "mlp_layer_types": mlp_types,
            "compress_rates": rates, "rope_parameters": rope,
            **{k: get(k) for k in _DEFAULTS},
            "architecture": str((data.get("architectures") or [data.get("architecture") or
                                                               "DeepseekV4ForCausalLM"])[0]),
        })

    # ---- what serving needs, derived ----

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Per layer: source tokens per compressed entry, 0 for window-only layers (the
        release's ``compress_ratios``)."""
        return tuple(0 if kind == WINDOW else self.compress_rates[kind] for kind in self.layer_types)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of ``kind`` (one of :data:`LAYER_KINDS`), ascending."""
        if kind not in LAYER_KINDS:
            raise InvalidArgument(f"layer kind {kind!r} is not one of {LAYER_KINDS}")
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)

    @property
    def hash_layers(self) -> tuple[int, ...]:
        """Indices of the hash-routed MoE layers (``tid2eid`` [V, k] in their gate)."""
        return tuple(i for i, k in enumerate(self.mlp_layer_types) if k == HASH_MOE)

    @property
    def csa_compress_rate(self) -> int:
        """m: source tokens per CSA compressed entry (entries overlap: width 2m, stride m)."""
        return self.compress_rates[CSA]

    @property
    def hca_compress_rate(self) -> int:
        """m': source tokens per HCA compressed entry (non-overlapping windows)."""
        return self.compress_rates[HCA]

    @property
    def qk_nope_head_dim(self) -> int:
        """Leading channels of each head that get no rope (``hd - rd``)."""
        return self.head_dim - self.qk_rope_head_dim

    def rope_label(self, layer: int) -> str:
        """``main`` for a window-only layer, ``compress`` for CSA/HCA (attention, compressor and
        indexer of that layer; ``DeepseekV4Attention.rope_layer_type``)."""
        return "main" if self.layer_types[layer] == WINDOW else "compress"

    def rope_attention_factor(self, label: str) -> float:
        """The cos/sin multiplier of rope ``label``: 1 for ``default``; for ``yarn`` the
        ``attention_factor`` key (transformers sets 1.0 when it builds the nested dict from a flat
        one), else transformers' yarn default ``0.1 ln(factor) + 1`` (mscale keys honoured)."""
        rope = self.rope_parameters[label]
        if rope["rope_type"] != "yarn":
            return 1.0
        if rope.get("attention_factor") is not None:
            return float(rope["attention_factor"])
        factor, mscale, mscale_all = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
        get_mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
        if mscale and mscale_all:
            return get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        return get_mscale(factor)

    @property
    def hc_mix_size(self) -> int:
        """Outputs of one hyper-connection projection: ``(2 + n_hc) * n_hc`` (pre, post, comb)."""
        return (2 + self.hc_mult) * self.hc_mult


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _as_tuple(name: str, value: Any) -> tuple:
    if not isinstance(value, list | tuple):
        raise InvalidArgument(f"model config {name} must be a list, got {value!r}")
    return tuple(value)


def _rope_parameters(data: Mapping[str, Any], rope_theta: float, compress_theta: float, factor: float) -> dict:
    """Nested ``{"main", "compress"}`` rope parameters as transformers builds them: kept when
    config.json already nests both; otherwise ``main`` is plain rope at ``rope_theta`` and
    ``compress`` takes the flat ``rope_parameters`` / ``rope_scaling`` (yarn) at
    ``compress_rope_theta``, with ``attention_factor`` 1.0 for yarn (the release does not scale
    cos/sin by yarn's mscale)."""
    params = data.get("rope_parameters")
    if params is None:
        params = data.get("rope_scaling")
    params = dict(params or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        nested = {label: dict(params[label]) for label in ROPE_LABELS}
        for rope in nested.values():
            if "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type", "default")
        return nested
    flat = {k: v for k, v in params.items() if k not in ROPE_LABELS}
    if "type" in flat and "rope_type" not in flat:
        flat["rope_type"] = flat.pop("type")
    flat.pop("type", None)
    main = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": factor}
    compress = {**flat, "rope_theta": compress_theta, "partial_rotary_factor": factor}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}
