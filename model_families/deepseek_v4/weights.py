"""The DeepSeek V4 weights as the forward takes them: one field per sidecar tensor
(:mod:`model_families.deepseek_v4.pack`). See ``docs/deepseek_v4.md``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from model_families.deepseek_v4.config import DeepseekV4Config
from model_families.deepseek_v4.pack import FLOAT32_SUFFIXES, tensor_specs
from model_families.family import FamilyWeights
from services.errors import InvalidArgument


def field_name(sidecar_name: str) -> str:
    """The :class:`DeepseekV4Weights` field of a sidecar tensor: ``layers.`` and ``hash.``
    dropped, other dots to underscores (``csa.wkv_gate`` -> ``csa_wkv_gate``)."""
    return sidecar_name.removeprefix("layers.").removeprefix("hash.").replace(".", "_")


@dataclass
class DeepseekV4Weights(FamilyWeights):
    """The model's weights in the sidecar layout of :mod:`model_families.deepseek_v4.pack`
    (field = :func:`field_name` of the sidecar name; shapes in that module's table). Float
    tensors in the compute dtype except the :data:`FLOAT32_SUFFIXES` ones (float32);
    ``tid2eid`` int64. Group fields are ``None`` when the model has no layer of that kind."""

    embed: torch.Tensor
    head: torch.Tensor
    final_norm: torch.Tensor
    hc_head_fn: torch.Tensor
    hc_head_base: torch.Tensor
    hc_head_scale: torch.Tensor
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn_fn: torch.Tensor
    hc_attn_base: torch.Tensor
    hc_attn_scale: torch.Tensor
    hc_ffn_fn: torch.Tensor
    hc_ffn_base: torch.Tensor
    hc_ffn_scale: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: torch.Tensor
    attn_sink: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor
    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor
    tid2eid: torch.Tensor | None = None
    csa_wkv_gate: torch.Tensor | None = None
    csa_ape: torch.Tensor | None = None
    csa_norm: torch.Tensor | None = None
    csa_idx_wkv_gate: torch.Tensor | None = None
    csa_idx_ape: torch.Tensor | None = None
    csa_idx_norm: torch.Tensor | None = None
    csa_idx_wq_b: torch.Tensor | None = None
    csa_idx_weights: torch.Tensor | None = None
    hca_wkv_gate: torch.Tensor | None = None
    hca_ape: torch.Tensor | None = None
    hca_norm: torch.Tensor | None = None
    #: The MTP blocks (``mtp.*``, stacked over ``num_nextn_predict_layers``; ``None`` without).
    mtp_e_proj: torch.Tensor | None = None
    mtp_h_proj: torch.Tensor | None = None
    mtp_enorm: torch.Tensor | None = None
    mtp_hnorm: torch.Tensor | None = None
    mtp_norm: torch.Tensor | None = None
    mtp_hc_head_fn: torch.Tensor | None = None
    mtp_hc_head_base: torch.Tensor | None = None
    mtp_hc_head_scale: torch.Tensor | None = None
    mtp_attn_norm: torch.Tensor | None = None
    mtp_ffn_norm: torch.Tensor | None = None
    mtp_hc_attn_fn: torch.Tensor | None = None
    mtp_hc_attn_base: torch.Tensor | None = None
    mtp_hc_attn_scale: torch.Tensor | None = None
    mtp_hc_ffn_fn: torch.Tensor | None = None
    mtp_hc_ffn_base: torch.Tensor | None = None
    mtp_hc_ffn_scale: torch.Tensor | None = None
    mtp_wq_a: torch.Tensor | None = None
    mtp_q_norm: torch.Tensor | None = None
    mtp_wq_b: torch.Tensor | None = None
    mtp_wkv: torch.Tensor | None = None
    mtp_kv_norm: torch.Tensor | None = None
    mtp_wo_a: torch.Tensor | None = None
    mtp_wo_b: torch.Tensor | None = None
    mtp_attn_sink: torch.Tensor | None = None
    mtp_gate: torch.Tensor | None = None
    mtp_gate_bias: torch.Tensor | None = None
    mtp_shared_gate_up: torch.Tensor | None = None
    mtp_shared_down: torch.Tensor | None = None
    mtp_experts_gate_up: torch.Tensor | None = None
    mtp_experts_down: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], config: DeepseekV4Config, dtype: torch.dtype,
                     device: torch.device, weights_dtype: str = "f32") -> DeepseekV4Weights:
        """Take the tensors of a sidecar (names and shapes of
        :func:`~model_families.deepseek_v4.pack.tensor_specs`; other names are ignored): float ones zero-copy when dtype and device already match. Raises
        ``InvalidArgument`` on a missing name or a wrong shape."""
        out = {}
        for name, spec in tensor_specs(config, weights_dtype).items():
            if name not in tensors:
                raise InvalidArgument(f"sidecar lacks tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != spec.shape:
                raise InvalidArgument(f"sidecar tensor {name!r} has shape {tuple(t.shape)}, expected {spec.shape}")
            out[field_name(name)] = t
        return cls(**out).to(dtype, torch.device(device))

    def to(self, dtype: torch.dtype, device: torch.device) -> DeepseekV4Weights:
        """A copy in compute dtype ``dtype`` on ``device`` (:data:`FLOAT32_SUFFIXES` tensors
        float32, ``tid2eid`` int64); tensors already right are kept, not copied."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                continue
            want = (torch.int64 if not t.is_floating_point() else
                    torch.float32 if f.name.endswith(FLOAT32_SUFFIXES) else dtype)
            out[f.name] = t.to(device=device, dtype=want)
        return type(self)(**out)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the token embedding)."""
        return self.embed.dtype
