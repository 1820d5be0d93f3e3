"""Sampler checked from first principles: greedy is argmax; top-k / top-p keep exactly the sets
their definitions give; temperature reshapes probabilities to p^(1/T); empirical frequencies
match the renormalised distribution; seeds make draws reproducible and independent of the
other rows in the batch; logprobs are log-softmax of the raw logits."""

from __future__ import annotations

import math

import pytest
import torch

from runner_service.sampler import Sampler, filter_logits
from runner_service.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])


def _logits(probs=PROBS, rows=1):
    return probs.log().repeat(rows, 1)


def _kept(top_k=0, top_p=1.0, temperature=1.0):
    out = filter_logits(_logits(), torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    return set((out[0] > float("-inf")).nonzero().flatten().tolist())


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_top_k_and_top_p_keep_the_defined_sets():
    assert _kept() == {0, 1, 2, 3}
    assert _kept(top_k=1) == {0}
    assert _kept(top_k=2) == {0, 1}
    assert _kept(top_k=10) == {0, 1, 2, 3}
    # top-p: smallest most-likely set with mass >= p (0.4 < 0.5 <= 0.4 + 0.3)
    assert _kept(top_p=0.3) == {0}
    assert _kept(top_p=0.5) == {0, 1}
    assert _kept(top_p=0.75) == {0, 1, 2}
    assert _kept(top_p=1.0) == {0, 1, 2, 3}
    assert _kept(top_k=3, top_p=0.5) == {0, 1}


def test_greedy_rows_take_the_argmax_and_top_k_1_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    tokens, _ = Sampler()(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)], [None, None])
    assert tokens == [1, 0]
    for seed in range(20):
        tokens, _ = Sampler()(logits[:1], [SamplingParams(temperature=1.5, top_k=1)], [_gen(seed)])
        assert tokens == [1]


def _frequencies(params, n=6000, probs=PROBS):
    tokens, _ = Sampler()(_logits(probs, n), [params] * n, [_gen(s) for s in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    return counts / n


def _assert_close_to(freq, expected, n=6000):
    for f, p in zip(freq.tolist(), expected, strict=True):
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(f - p) <= 4.5 * sigma + 1e-12, (freq, expected)


def test_frequencies_follow_the_filtered_renormalised_distribution():
    _assert_close_to(_frequencies(SamplingParams(temperature=1.0)), [0.4, 0.3, 0.2, 0.1])
    _assert_close_to(_frequencies(SamplingParams(temperature=1.0, top_p=0.75)), [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0])
    _assert_close_to(_frequencies(SamplingParams(temperature=1.0, top_k=2)), [0.4 / 0.7, 0.3 / 0.7, 0, 0])


def test_temperature_reshapes_probabilities_to_the_power_one_over_t():
    root = PROBS.sqrt()
    expected = (root / root.sum()).tolist()
    _assert_close_to(_frequencies(SamplingParams(temperature=2.0)), expected)


def test_seeded_draws_repeat_and_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(5)]
    first, _ = Sampler()(logits, params, [_gen(s) for s in range(5)])
    again, _ = Sampler()(logits, params, [_gen(s) for s in range(5)])
    assert first == again
    # Row 3 alone, and with greedy rows around it, draws the same token.
    alone, _ = Sampler()(logits[3:4], params[3:4], [_gen(3)])
    mixed, _ = Sampler()(logits[[0, 3, 1]], [SamplingParams(temperature=0), params[3], SamplingParams(temperature=0)],
                         [None, _gen(3), None])
    assert alone[0] == first[3] == mixed[1]
    # A sequence of draws from one generator is reproducible too.
    g1, g2 = _gen(42), _gen(42)
    run1 = [Sampler()(logits[:1], params[:1], [g1])[0][0] for _ in range(20)]
    run2 = [Sampler()(logits[:1], params[:1], [g2])[0][0] for _ in range(20)]
    assert run1 == run2 and len(set(run1)) > 1


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, lps = Sampler()(logits, [SamplingParams(temperature=0, logprobs=3)], [None])
    z = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0)))
    assert tokens == [1]
    assert math.isclose(lps[0].logprob, 3.0 - z, rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [1, 2, 0]
    for (_, lp), raw in zip(lps[0].top, (3.0, 2.0, 1.0), strict=True):
        assert math.isclose(lp, raw - z, rel_tol=1e-6)
    _, none = Sampler()(logits, [SamplingParams(temperature=0)], [None])
    assert none == [None]
