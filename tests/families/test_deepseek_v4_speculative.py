"""Speculative decoding on DeepSeek V4 (``--speculative ngram`` and ``mtp``), float32 tiny random
models of both presets: greedy output equal to plain decoding, token for token, for K = 1 .. 4
over 8 concurrent sequences of different lengths; forced drafts (all right, all wrong, mixed)
whose rejections must leave the window ring, the compressed entries and the rolling compressor
state as plain decoding leaves them (the text after them still matches), with exact block
accounting; the MTP drafts made while decoding equal the MTP block's prediction computed afresh
over the final text (so its own window ring rolls back too).

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
from runner_service.kv_cache import KVCache
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import FinishReason
from services.errors import InvalidArgument

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


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_cancelling_in_the_middle_of_speculation_frees_every_block_and_keeps_the_others_exact(model, plain, method):
    """Half the requests cancelled after a few speculative steps: they end CANCELLED, the others
    still give plain decoding's tokens, and every KV block (main pools and the MTP ring alike) is
    free at the end."""
    engine = _engine(model, speculative=method, num_speculative_tokens=3)
    prompts = _prompts()
    params = SamplingParams(max_tokens=GENERATED, temperature=0, ignore_eos=True)
    streams = [engine.add_request(params, token_ids=p) for p in prompts]
    for _ in range(40):  # until some drafts were verified, and a few steps more
        engine.step()
        if engine.stats()["spec_decode_num_drafts"] >= 8:
            break
    assert engine.block_manager.num_used_blocks > 0 and engine.stats()["spec_decode_num_drafts"] >= 8
    for s in streams[::2]:
        s.cancel()
    engine.run_until_done()
    results = [s.result(timeout=0) for s in streams]
    assert [r.finish_reason for r in results[::2]] == [FinishReason.CANCELLED] * 4
    assert [r.token_ids for r in results[1::2]] == plain[1::2]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_output_with_mtp_drafts_equals_plain_decoding(model, plain, k):
    engine = _engine(model, speculative="mtp", num_speculative_tokens=k)
    got, _ = _run(engine, _prompts())
    assert got == plain
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_mtp_drafts_while_decoding_equal_the_block_run_afresh_over_the_final_text(model):
    """Each step's first MTP draft (made from chunked prefill and verify steps' streams, the
    block's ring rewritten over its own drafting rows) is the argmax of the block run once over
    the whole final text from empty caches, at the same position (where that argmax is clear)."""
    config, _ = model
    engine = _engine(model, speculative="mtp", num_speculative_tokens=3, max_num_batched_tokens=16)
    drafter, seen = engine.drafter, {}
    observe = drafter.observe

    def recording(seqs, starts, lengths, streams):
        observe(seqs, starts, lengths, streams)
        for seq in seqs:
            if seq.draft_token_ids:  # the draft of the token after the last one
                seen.setdefault(tuple(seq.token_ids[:seq.num_prompt_tokens]), {})[seq.num_tokens] = \
                    seq.draft_token_ids[0]

    drafter.observe = recording
    prompts = _prompts()
    outs, _ = _run(engine, prompts, 40)
    m, checked = engine.runner.model, 0
    for prompt, out in zip(prompts, outs, strict=True):
        full = prompt + out
        S = len(full)
        table = torch.tensor([list(range(1, 1 + engine.block_layout.blocks_needed(S + 4)))])
        kv = KVCache(FAMILY.cache_specs(config, 4), 200, 4, torch.float32, torch.device("cpu"))
        pool = torch.zeros(config.num_nextn_predict_layers, 200, 4, config.head_dim)
        with torch.inference_mode():
            _, streams = m.streams(kv.tensors, torch.tensor([full]), torch.arange(S)[None],
                                   torch.zeros(1, S, dtype=torch.int64), table, torch.tensor([S]))
            logits, _ = m.mtp(pool, streams[:, :-1], torch.tensor([full[1:]]), torch.arange(S - 1)[None], table,
                              torch.tensor([S - 1]))
        for nt, draft in seen[tuple(prompt)].items():
            top = logits[0, nt - 2].topk(2).values
            if top[0] - top[1] > 1e-3:
                assert draft == int(logits[0, nt - 2].argmax()), (prompt, nt)
                checked += 1
    assert checked > 200


def test_mtp_needs_the_checkpoint_block():
    config = FAMILY.config_from_hf({**TINY_HC4, "num_nextn_predict_layers": 0})
    with pytest.raises(InvalidArgument, match="needs the checkpoint's MTP block"):
        _engine((config, FAMILY.random_weights(config, seed=1)), speculative="mtp")


def test_a_sequence_still_in_prefill_gets_no_mtp_drafts(model):
    """A prompt chunked so that its first chunk ends one token before the prompt's end: the
    block runs over the chunk, but the sequence drafts only once its prompt is done."""
    prompt = _prompts()[6][:17]
    engine = _engine(model, speculative="mtp", num_speculative_tokens=3, max_num_batched_tokens=16)
    plain = _engine(model, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    stream = engine.add_request(params, token_ids=prompt)
    engine.step()  # the first 16-token chunk
    seq = engine.scheduler.running[0] if engine.scheduler.running else engine.scheduler.waiting[0]
    assert seq.num_computed_tokens == 16 and seq.drafter_state.processed == 16 and seq.draft_token_ids == []
    engine.run_until_done()
    want = plain.add_request(params, token_ids=prompt)
    plain.run_until_done()
    assert stream.result(timeout=0).token_ids == want.result(timeout=0).token_ids


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tied_indexer_scores_verify_as_plain_decoding_does(preset):
    """4 indexer heads, so indexer scores tie at exactly 0 across the top-k boundary: a verify
    step's queries pick from rows of their own closed entries, as a decode step's do, so
    forced drafts (three in ten wrong) under preemption and MTP drafts give plain decoding's
    text. (With the top-k over the table's capacity, the rows' length followed the block
    table, and these runs differed from plain decoding.)"""
    config = FAMILY.config_from_hf(dict(PRESETS[preset], index_n_heads=4))
    model = (config, FAMILY.random_weights(config, seed=3))
    prompts = _prompts()
    plain, _ = _run(_engine(model), prompts)
    outputs = {tuple(p): o for p, o in zip(prompts, plain, strict=True)}
    per_block = sum(s.bytes_per_block(torch.float32) for s in FAMILY.cache_specs(config, 4))
    blocks = FAMILY.block_layout(config, 4, 256, 3).blocks_needed(140) * 3
    engine = _engine(model, speculative="ngram", num_speculative_tokens=3, kv_cache_bytes=per_block * blocks)
    engine.drafter = ScriptedDrafter(3, outputs, 128, wrong=0.3)
    assert _run(engine, prompts)[0] == plain
    assert engine.scheduler.num_preemptions > 0
    assert _run(_engine(model, speculative="mtp", num_speculative_tokens=2), prompts)[0] == plain
