"""``model_families.custom_ops.grouped_experts`` (the routed experts of an MoE layer, each picked expert
run once on its tokens) against a per-(token, pick) loop written from the formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model_families.custom_ops import grouped_experts


def _naive(x, picks, weights, gate_up, down, limit):
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(picks.shape[1]):
            e = int(picks[t, j])
            h = gate_up[e].double() @ x[t].double()
            gate, up = h[:inter].clamp(max=limit), h[inter:].clamp(min=-limit, max=limit)
            out[t] += float(weights[t, j]) * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("tokens, limit", [(1, 10.0), (5, 0.5), (33, math.inf)])
def test_grouped_experts_equal_the_formula(tokens, limit):
    g = torch.Generator().manual_seed(tokens)
    experts, k, hidden, inter = 6, 2, 16, 8
    x = torch.randn(tokens, hidden, generator=g)
    picks = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])  # expert 5 idle
    weights = torch.rand(tokens, k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    want = _naive(x, picks, weights, gate_up, down, limit).float()
    torch.testing.assert_close(grouped_experts(x, picks, weights, gate_up, down, limit), want, atol=1e-4, rtol=1e-5)
    # the custom op a compiled program calls runs the same kernel
    op = torch.ops.warmserve.grouped_experts(x, picks, weights, gate_up, down, float(limit))
    torch.testing.assert_close(op, want, atol=1e-4, rtol=1e-5)
