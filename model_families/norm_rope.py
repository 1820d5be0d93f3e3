"""RMSNorm and rotate-half RoPE as the Llama family computes them (transformers'
``LlamaRMSNorm`` / ``rotate_half``); DeepSeek V4's variants are in
:mod:`model_families.deepseek_v4.norm_rope`. See ``docs/architecture.md`` §7."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32 (as transformers' ``LlamaRMSNorm``):
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, n, hd] by per-token ``cos``/``sin`` [B, S, hd] (HF ``rotate_half``
    convention: first half / second half of each head)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin

