"""DeepSeek V4's mixture of experts: router (top-k or hash), routed experts and the shared
expert, with clamped SwiGLU (transformers' ``DeepseekV4SparseMoeBlock``). See
``docs/deepseek_v4.md``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_families.custom_ops import grouped_experts
from model_families.deepseek_v4.config import HASH_MOE
from model_families.family import FamilyModel
from model_families.linear import float_linear


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU (M: ``DeepseekV4Experts._apply_gate``): gate rows first, gate clamped
    above at ``limit``, up to ``[-limit, limit]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe(model: FamilyModel, i: int, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Layer ``i``'s MoE on ``x`` [T, H] (M: ``DeepseekV4SparseMoeBlock``) with the weights of
    ``model`` (a :class:`~model_families.deepseek_v4.model.DeepseekV4Model`; ``token_ids`` [T] for
    hash routing): router scores, top-k by ``scores + gate_bias`` (or ``tid2eid[token]`` in a
    hash layer), weights from the unbiased scores normalised and scaled; each picked expert runs
    once on the tokens that picked it (:func:`~model_families.custom_ops.grouped_experts`, a
    custom op in a compiled program), plus the shared expert. Returns [T, H]."""
    c = model.config
    limit = c.swiglu_limit
    logits = float_linear(x, model.gate[i])
    if c.scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif c.scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    if c.mlp_layer_types[i] == HASH_MOE:
        idx = model.tid2eid[model.hash_rank[i]][token_ids]
    else:
        idx = torch.topk(scores + model.gate_bias[i], c.num_experts_per_tok, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    shared = float_linear(swiglu(float_linear(x, model.shared_gate_up[i]), limit), model.shared_down[i])
    return grouped_experts(x, idx, w, model.experts_gate_up[i], model.experts_down[i], limit) + shared
