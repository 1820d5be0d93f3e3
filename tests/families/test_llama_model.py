"""The runner's Llama forward against transformers (independent reference) on tiny random models:
prefill, chunked prefill and paged decode, GQA/MHA, tied/untied head, QKV bias (Qwen2), llama3
and linear RoPE scaling, and bfloat16."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import hf_reference, tiny_args, weights_from_hf

from model_families.llama import FAMILY as LLAMA
from runner_service.config import EngineConfig
from runner_service.kv_cache import KVCache
from runner_service.model_runner import ModelRunner
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import ScheduledBatch
from runner_service.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {
    "gqa-tied": dict(),
    "mha-untied-llama3": dict(heads=4, kv_heads=4, tied=False, rope_scaling=LLAMA3),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2-bias": dict(bias=True, architecture="Qwen2ForCausalLM", head_dim=16, heads=4, kv_heads=2),
}


def _runner(args, weights, num_blocks=64, block_size=4, max_num_seqs=4, dtype=torch.float32):
    cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=128, warmup=False)
    kv = KVCache(LLAMA.cache_specs(args, block_size), num_blocks, block_size, dtype, torch.device("cpu"))
    return ModelRunner(args, weights, kv, cfg, 128, torch.device("cpu"))


def _seq(ids, runner, first_block):
    s = Sequence(f"s{first_block}", ids, SamplingParams(max_tokens=8), 128)
    n = -(-len(ids) // runner.block_size)
    s.block_table = list(range(first_block, first_block + n))  # hand-assigned, disjoint blocks
    return s


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    args = tiny_args(**CASES[request.param])
    model = hf_reference(args)
    return args, model, weights_from_hf(model, args)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_prefill_batch_matches_transformers(case):
    args, model, weights = case
    runner = _runner(args, weights)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 1)]
    seqs = [_seq(p, runner, 1 + 10 * i) for i, p in enumerate(prompts)]
    batch = ScheduledBatch(True, seqs, [len(p) for p in prompts], [0, 0, 0])
    logits = runner.run_prefill(batch)
    for i, p in enumerate(prompts):
        ref = _hf_logits(model, p)[-1]
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_paged_decode_matches_transformers(case):
    args, model, weights = case
    runner = _runner(args, weights)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, args.vocab_size, (14,), generator=g).tolist()
    b = torch.randint(0, args.vocab_size, (9,), generator=g).tolist()
    ref_a, ref_b = _hf_logits(model, a), _hf_logits(model, b)
    sa, sb = _seq(a, runner, 1), _seq(b, runner, 20)
    # a: chunks [0, 5) and [5, 9); b: [0, 6) in the same batch as a's second chunk.
    out = runner.run_prefill(ScheduledBatch(True, [sa], [5], [0]))
    torch.testing.assert_close(out[0], ref_a[4], atol=1e-4, rtol=1e-4)
    out = runner.run_prefill(ScheduledBatch(True, [sa, sb], [4, 6], [5, 0]))
    torch.testing.assert_close(out[0], ref_a[8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref_b[5], atol=1e-4, rtol=1e-4)
    # Decode the rest one token at a time; the token fed at position p is a[p] / b[p].
    sa.token_ids, sb.token_ids = a[:10], b[:7]
    for _ in range(3):
        logits = runner.run_decode([sa, sb])
        for seq, lg in zip([sa, sb], logits, strict=True):
            full, ref = (a, ref_a) if seq is sa else (b, ref_b)
            torch.testing.assert_close(lg, ref[seq.num_tokens - 1], atol=1e-4, rtol=1e-4)
            seq.token_ids = full[: seq.num_tokens + 1]


def test_bfloat16_close_to_float32_reference(case):
    args, model, weights = case
    w16 = type(weights)(**{k: (None if getattr(weights, k) is None else getattr(weights, k).to(torch.bfloat16))
                           for k in weights.__dataclass_fields__})
    runner = _runner(args, w16, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    p = torch.randint(0, args.vocab_size, (11,), generator=g).tolist()
    logits = runner.run_prefill(ScheduledBatch(True, [_seq(p, runner, 1)], [11], [0]))[0]
    ref = _hf_logits(model, p)[-1]
    assert logits.dtype == torch.float32
    # bfloat16 keeps 8 mantissa bits: errors of a few percent of the logit range are expected.
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert logits.argmax() == ref.argmax()
