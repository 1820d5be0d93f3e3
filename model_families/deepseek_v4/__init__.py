"""The DeepSeek V4 family (``DeepseekV4ForCausalLM``): config (:mod:`.config`), sidecar layout
(:mod:`.pack`), weights (:mod:`.weights`), caches (:mod:`.cache_layout`) and forward
(:mod:`.model`). Design notes: ``docs/deepseek_v4.md``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from model_families import block_layout as _block_layout
from model_families import custom_ops, invariant, kv_write, linear, native, prepack, quant, quantized_weights
from model_families import family as _family
from model_families.deepseek_v4 import attention as _attention
from model_families.deepseek_v4 import cache_layout as _cache_layout
from model_families.deepseek_v4 import checkpoint_names as _checkpoint_names
from model_families.deepseek_v4 import config as _config
from model_families.deepseek_v4 import hyper_connections as _hyper_connections
from model_families.deepseek_v4 import model as _model
from model_families.deepseek_v4 import moe as _moe
from model_families.deepseek_v4 import norm_rope as _norm_rope
from model_families.deepseek_v4 import pack as _pack
from model_families.deepseek_v4 import quantized as _quantized
from model_families.deepseek_v4 import weights as _weights
from model_families.deepseek_v4.config import ARCHITECTURES, DeepseekV4Config
from model_families.deepseek_v4.model import DeepseekV4Model
from model_families.deepseek_v4.weights import DeepseekV4Weights
from model_families.family import CacheSpec, Checkpoint, ModelFamily, TensorSpec


class DeepseekV4Family(ModelFamily):
    """Sliding-window attention with compressed history (CSA / HCA), MoE, hyper-connections;
    caches on a ring of window blocks plus paged compressed pools (:mod:`.cache_layout`)."""

    name = "deepseek_v4"
    architectures = ARCHITECTURES
    pack_version = _pack.PACK_VERSION
    config_class = DeepseekV4Config
    weights_dtypes = _pack.WEIGHTS_DTYPES
    stacked_prefixes = _pack.STACKED_PREFIXES
    #: Not supported: the window ring overwrites its blocks as the window slides, and a block
    #: holds compressed entries and ring rows of different token spans, so a block's content is
    #: not a function of the tokens up to its end (the precondition of block sharing).
    supports_prefix_caching = False
    #: Decode only: ``torch.export`` bounds a prefill chunk's token count by the ring read-back
    #: span (the unfolded compressor windows over ``ctx + S`` rows), so a dynamic-length prefill
    #: does not export; prefill chunks run eager, decode steps compiled.
    compiled_prefill = False
    #: Prompt-lookup drafts and the checkpoint's MTP block's, verified by
    #: :meth:`DeepseekV4Model.verify` (compiled in ``aoti`` mode: ``compiled_verify``) or, for
    #: ``mtp``, ``streams`` (eager) over a ring with spare slots for the drafts
    #: (:func:`.cache_layout.ring_tokens`).
    speculative_methods = ("ngram", "mtp")

    def config_from_hf(self, hf: Mapping[str, Any], has_tensor: Callable[[str], bool] = lambda _n: False
                       ) -> DeepseekV4Config:
        return DeepseekV4Config.from_hf(hf)

    def tensor_shapes(self, config: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
        return _pack.tensor_shapes(config)

    def tensor_specs(self, config: DeepseekV4Config, weights_dtype: str) -> dict[str, TensorSpec]:
        return _pack.tensor_specs(config, weights_dtype)

    def global_tensors(self, ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        return _pack.global_tensors(ckpt, weights_dtype)

    def layer_tensors(self, ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        return _pack.layer_tensors(ckpt, layer, weights_dtype)

    def stack_index(self, config: DeepseekV4Config, name: str, layer: int) -> int:
        return _pack.stack_index(config, name, layer)

    def layout_facts(self, config: DeepseekV4Config) -> dict[str, Any]:
        return _pack.layout_facts(config)

    def load_weights(self, config: DeepseekV4Config, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, weights_dtype: str = "f32") -> DeepseekV4Weights:
        return DeepseekV4Weights.from_tensors(tensors, config, dtype, device, weights_dtype)

    def random_weights(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, seed: int = 0,
                       device: torch.device | str = "cpu", weights_dtype: str = "f32") -> DeepseekV4Weights:
        """Random weights as the base class draws them, with ``hash.tid2eid`` k distinct
        experts per token."""
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, spec in self.tensor_specs(config, weights_dtype).items():
            if name == "hash.tid2eid":
                L, V, k = spec.shape
                tensors[name] = torch.rand(L * V, config.n_routed_experts, generator=g).argsort(-1)[:, :k] \
                    .reshape(L, V, k).to(torch.int32)
                continue
            t = torch.randn(spec.shape, generator=g)
            tensors[name] = 1.0 + 0.1 * t if name.endswith("norm") else 0.02 * t
        return self.load_weights(config, tensors, dtype, torch.device(device), weights_dtype)

    def cache_specs(self, config: DeepseekV4Config, block_size: int) -> tuple[CacheSpec, ...]:
        return _cache_layout.cache_specs(config, block_size)

    def draft_cache_specs(self, config: DeepseekV4Config, block_size: int, method: str) -> tuple[CacheSpec, ...]:
        """``mtp``: the MTP blocks' window ring ``mtp_win`` [N_mtp, num_blocks, block_size, hd]."""
        if method != "mtp" or not config.num_nextn_predict_layers:
            return ()
        return (CacheSpec("mtp_win", config.num_nextn_predict_layers, (block_size, config.head_dim)),)

    def block_layout(self, config: DeepseekV4Config, block_size: int, max_model_len: int,
                     draft_tokens: int = 0) -> _block_layout.BlockLayout:
        return _cache_layout.block_layout(config, block_size, max_model_len, draft_tokens)

    def build_model(self, config: DeepseekV4Config, weights: DeepseekV4Weights, max_model_len: int,
                    draft_tokens: int = 0) -> DeepseekV4Model:
        return DeepseekV4Model(config, weights, max_model_len, draft_tokens)

    def program_sources(self) -> list[ModuleType]:
        return [_model, _weights, _cache_layout, _norm_rope, _hyper_connections, _attention, _moe, _config, _pack,
                _checkpoint_names, _quantized, kv_write, linear, quantized_weights, prepack, custom_ops, native, quant,
                _block_layout, invariant, _family]


FAMILY = DeepseekV4Family()
