"""DeepSeek V4's RMSNorm and RoPE (transformers' ``DeepseekV4RMSNorm`` and interleaved partial
``apply_rotary_pos_emb``), and its rope tables. They differ on purpose from the Llama family's
(:mod:`model_families.norm_rope`): the weight multiplies in float32 before the cast back, and
RoPE rotates interleaved pairs of the trailing channels only. See ``docs/deepseek_v4.md``."""

from __future__ import annotations

import math

import torch

from model_families.deepseek_v4.config import DeepseekV4Config


def rope_inv_freq(c: DeepseekV4Config, label: str) -> torch.Tensor:
    """Inverse frequencies [rd / 2] float32 of rope ``label`` (``main`` / ``compress``):
    ``1 / theta^(2i / rd)``, or YaRN's blend of interpolated and extrapolated frequencies
    (transformers' ``_compute_yarn_parameters``: ramp between the correction dims of
    ``beta_fast`` / ``beta_slow`` rotations at ``original_max_position_embeddings``)."""
    rope = c.rope_parameters[label]
    base, dim = float(rope["rope_theta"]), c.qk_rope_head_dim
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    if rope["rope_type"] != "yarn":
        return 1.0 / pos_freqs
    factor = rope["factor"]
    original = rope.get("original_max_position_embeddings") or c.max_position_embeddings
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(c: DeepseekV4Config, label: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, rd / 2] float32 of rope ``label`` (one entry per interleaved pair,
    times the label's attention factor), rows indexed by position."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(c, label)[None, :]
    scale = c.rope_attention_factor(label)
    return freqs.cos() * scale, freqs.sin() * scale


def rms_norm_f32_scale(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (M: ``DeepseekV4RMSNorm``: the float32 weight
    multiplies before the cast back); ``weight`` None: weightless (M:
    ``DeepseekV4UnweightedRMSNorm``)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def rope_interleaved_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x`` [..., D]
    (M: ``apply_rotary_pos_emb``); ``cos``/``sin`` [..., rd / 2] broadcast against ``x``'s
    leading dims (float32 math, cast back)."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)
