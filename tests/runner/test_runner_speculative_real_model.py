"""Speculative decoding on the real SmolLM2 weights (float32 sidecar): prompt-lookup drafts
leave the greedy text of the chats unchanged, and on answers that copy their prompt most drafts
are accepted."""

from __future__ import annotations

import pytest
from real_model_prompts import CHATS, COPY_CHATS

from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


def _generate(sidecar, **spec) -> tuple[list[list[int]], dict]:
    cfg = EngineConfig(max_num_seqs=8, max_model_len=512, kv_cache_bytes=96 << 20, warmup=False, **spec)
    with LLMEngine.from_sidecar(sidecar, cfg) as engine:
        streams = [engine.add_request(GREEDY, messages=m) for m in [*CHATS, *COPY_CHATS]]
        engine.run_until_done()
        return [s.result(timeout=0).token_ids for s in streams], engine.stats()


def test_ngram_drafts_keep_the_greedy_text_and_are_accepted_on_copying_answers(smollm2_sidecar):
    plain, _ = _generate(smollm2_sidecar)
    spec, stats = _generate(smollm2_sidecar, speculative="ngram", num_speculative_tokens=4)
    assert spec == plain
    assert stats["spec_decode_num_drafts"] >= 5
    assert stats["spec_decode_mean_acceptance_length"] > 2, stats
