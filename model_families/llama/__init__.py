"""The Llama model family (Llama 2/3, SmolLM2, Mistral, Qwen2): config
(:mod:`~model_families.llama.config`), sidecar layout (:mod:`~model_families.llama.pack`) and
forward (:mod:`~model_families.llama.model`), tied together by :class:`LlamaFamily`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from model_families import (
    attention,
    block_layout,
    custom_ops,
    invariant,
    kv_write,
    linear,
    native,
    norm_rope,
    prepack,
    quant,
    quantized_weights,
)
from model_families import family as _family
from model_families.family import CacheSpec, Checkpoint, ModelFamily, TensorSpec
from model_families.llama import config as _config
from model_families.llama import model as _model
from model_families.llama import pack as _pack
from model_families.llama.config import ARCHITECTURES, LlamaConfig
from model_families.llama.model import LlamaModel, LlamaWeights


class LlamaFamily(ModelFamily):
    """RMSNorm + RoPE + GQA + SwiGLU decoder; one K and one V block pool per layer."""

    name = "llama"
    architectures = ARCHITECTURES
    pack_version = _pack.PACK_VERSION
    config_class = LlamaConfig
    weights_dtypes = _pack.WEIGHTS_DTYPES
    #: A token's K/V depend only on the tokens up to it and their positions.
    supports_prefix_caching = True
    #: Its steps are linear, paged_attention, RMSNorm, RoPE and SiLU only (:mod:`model_families.invariant`).
    supports_batch_invariance = True
    #: Rejected drafts leave K/V past the sequence length only (never read, overwritten later).
    speculative_methods = ("ngram",)

    def config_from_hf(self, hf: Mapping[str, Any], has_tensor: Callable[[str], bool] = lambda _n: False
                       ) -> LlamaConfig:
        return _config.config_from_hf(hf, has_tensor)

    def tensor_shapes(self, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        return _pack.tensor_shapes(config)

    def tensor_specs(self, config: LlamaConfig, weights_dtype: str) -> dict[str, TensorSpec]:
        return _pack.tensor_specs(config, weights_dtype)

    def global_tensors(self, ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        return _pack.global_tensors(ckpt, weights_dtype)

    def layer_tensors(self, ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        return _pack.layer_tensors(ckpt, layer, weights_dtype)

    def load_weights(self, config: LlamaConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, weights_dtype: str = "f32") -> LlamaWeights:
        return LlamaWeights.from_tensors(tensors, config, dtype, device, weights_dtype)

    def cache_specs(self, config: LlamaConfig, block_size: int) -> tuple[CacheSpec, ...]:
        """K and V pools, each ``[L, num_blocks, block_size, nkv, hd]``."""
        block = (block_size, config.num_key_value_heads, config.head_dim)
        return (CacheSpec("k", config.num_hidden_layers, block), CacheSpec("v", config.num_hidden_layers, block))

    def build_model(self, config: LlamaConfig, weights: LlamaWeights, max_model_len: int,
                    draft_tokens: int = 0) -> LlamaModel:
        return LlamaModel(config, weights, max_model_len)  # paged: rejected drafts' slots are reused as is

    def program_sources(self) -> list[ModuleType]:
        return [_model, _config, _pack, norm_rope, block_layout, attention, kv_write, linear, quantized_weights,
                prepack, custom_ops, native, quant, invariant, _family]


FAMILY = LlamaFamily()
