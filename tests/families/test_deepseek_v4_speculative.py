"""Speculative decoding on DeepSeek V4 (``--speculative ngram``), float32 tiny random models of
both presets: greedy output equal to plain decoding, token for token, for K = 1 .. 4 over 8
concurrent sequences of different lengths; forced drafts (all right, all wrong, mixed) whose
rejections must leave the window ring, the compressed entries and the rolling compressor state
as plain decoding leaves them (the text after them still matches), with exact block accounting.

Sequences run past the window (8), both compress rates (4, 8) and give the CSA indexer more
entries than its top-k, so every piece of state a rejected draft touches is exercised."""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_tiny import TINY_ALL_KINDS, TINY_HC4
from runner_tiny import ScriptedDrafter, tiny_config

from model_families.deepseek_v4 import FAMILY
from model_families.deepseek_v4.cache_layout import ring_span, ring_tokens
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PRESETS = {"all_kinds_hc2": TINY_ALL_KINDS, "hc4_2layers": TINY_HC4}
GENERATED = 100


@pytest.fixture(scope="module", params=sorted(PRESETS))
def model(request):
    config = FAMILY.config_from_hf(PRESETS[request.param])
    return config, FAMILY.random_weights(config, seed=3)


def _engine(model, **cfg) -> LLMEngine:
    config, weights = model
    return LLMEngine(config, weights, tiny_config(compile="off", max_model_len=256, **cfg), family=FAMILY)


def _prompts() -> list[list[int]]:
    """8 prompts of 5 .. 40 tokens: spans repeated (prompt lookup finds drafts) and random ones."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        span = torch.randint(3, 120, (3 + i,), generator=g).tolist()
        out.append((span * 4)[: 5 + 5 * i] if i % 2 == 0 else torch.randint(3, 120, (5 + 5 * i,), generator=g).tolist())
    return out


def _run(engine, prompts, n=GENERATED):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    streams = [engine.add_request(params, token_ids=p) for p in prompts]
    steps = engine.run_until_done()
    return [s.result(timeout=0).token_ids for s in streams], steps


@pytest.fixture(scope="module")
def plain(model):
    return _run(_engine(model), _prompts())[0]


def test_the_ring_keeps_a_spare_slot_per_draft_token(model):
    config, _ = model
    for k in range(5):
        assert ring_tokens(config, 4, k) >= ring_span(config) + k
        assert FAMILY.block_layout(config, 4, 256, k).ring_tokens == ring_tokens(config, 4, k)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_output_with_ngram_drafts_equals_plain_decoding(model, plain, k):
    engine = _engine(model, speculative="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                     prompt_lookup_max=3)
    got, _ = _run(engine, _prompts())
    assert got == plain
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("k", [1, 4])
def test_forced_drafts_roll_back_every_piece_of_state(model, plain, k):
    """All right: k + 1 tokens a step; all wrong: one a step; a fifth wrong: partial acceptance
    at every offset. Each run's text equals the plain run's to the end (100 tokens), so no
    rejected draft left anything a later step reads."""
    prompts = _prompts()
    outputs = {tuple(p): o for p, o in zip(prompts, plain, strict=True)}
    # every row decodes its 99 tokens after the first; the longest prompt's prefill is one step
    for wrong, steps in ((0.0, 1 + -(-99 // (k + 1))), (1.0, 1 + 99), (0.2, None)):
        engine = _engine(model, speculative="ngram", num_speculative_tokens=k)
        engine.drafter = ScriptedDrafter(k, outputs, 128, wrong=wrong)
        got, ran = _run(engine, prompts)
        assert got == plain, wrong
        if steps is not None:
            assert ran == steps, (wrong, ran)
            assert engine.stats()["spec_decode_acceptance_rate"] == 1.0 - wrong
        else:
            assert 0 < engine.stats()["spec_decode_acceptance_rate"] < 1
        assert engine.block_manager.num_used_blocks == 0


def test_preemption_in_the_middle_of_speculation_keeps_outputs_and_blocks_exact(model, plain):
    prompts = _prompts()
    outputs = {tuple(p): o for p, o in zip(prompts, plain, strict=True)}
    config, _ = model
    per_block = sum(s.bytes_per_block(torch.float32) for s in FAMILY.cache_specs(config, 4))
    # room for about 3 of the 8 sequences at full length (140 tokens)
    blocks = FAMILY.block_layout(config, 4, 256, 3).blocks_needed(140) * 3
    engine = _engine(model, speculative="ngram", num_speculative_tokens=3, kv_cache_bytes=per_block * blocks)
    engine.drafter = ScriptedDrafter(3, outputs, 128, wrong=0.3)
    got, _ = _run(engine, prompts)
    assert got == plain
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0
