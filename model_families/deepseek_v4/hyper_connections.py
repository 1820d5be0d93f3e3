"""DeepSeek V4's hyper-connections: ``hc_mult`` residual streams collapsed into one block input,
the block output mixed back in, and the head's collapse (transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``). See ``docs/deepseek_v4.md``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_families.deepseek_v4.config import DeepseekV4Config
from model_families.deepseek_v4.norm_rope import rms_norm_f32_scale


def hyper_connection(c: DeepseekV4Config, h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M: ``DeepseekV4HyperConnection.forward``: streams ``h`` [T, n, H] -> ``post`` [T, n],
    ``comb`` [T, n, n] (Sinkhorn-normalised, float32) and the collapsed block input [T, H]."""
    n = c.hc_mult
    flat = rms_norm_f32_scale(h.flatten(1).float(), None, c.rms_norm_eps)
    mixed = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + c.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + c.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + c.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
    return post, comb, collapsed


def mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``post ⊗ out + combᵀ @ h`` (M: ``DeepseekV4DecoderLayer.forward``), streams [T, n, H]."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def hyper_head(c: DeepseekV4Config, last: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """M: ``DeepseekV4HyperHead``: streams ``last`` [B, n, H] collapsed to [B, H] by sigmoid
    weights (+ ``hc_eps``) of the unweighted-RMSNormed streams (float32 math, cast back)."""
    flat = rms_norm_f32_scale(last.flatten(1).float(), None, c.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + c.hc_eps
    return (pre.unsqueeze(-1) * last).sum(dim=1).to(last.dtype)
