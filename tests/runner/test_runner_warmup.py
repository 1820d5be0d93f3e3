"""The start-up warm-up (issue 24 item 3): which steps it runs, from the scheduler's config and
the installed programs, and that it touches only the scratch block (no KV block allocated, no
sequence's cache written, outputs unchanged). Spy programs stand in for compiled ones: they
record the shapes they are called with and compute what the eager model does."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.kv_cache import KVCache
from runner_service.model_runner import WARMUP_PREFILL_TOKENS, ModelRunner, WarmupPlan
from runner_service.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args()
WEIGHTS = LLAMA.random_weights(ARGS, seed=7)
BLOCKS = 40


def _runner(**cfg) -> ModelRunner:
    config = tiny_config(**cfg)
    max_len = config.resolved_max_model_len(ARGS)
    kv = KVCache(LLAMA.cache_specs(ARGS, config.block_size), BLOCKS, config.block_size, torch.float32,
                 torch.device("cpu"))
    return ModelRunner(ARGS, WEIGHTS, kv, config, max_len, torch.device("cpu"))


def _spies(runner: ModelRunner) -> list[tuple]:
    """Install decode and prefill programs that record ``(kind, input shapes, tables, slots)``
    and run the eager modules; returns the record."""
    calls: list[tuple] = []

    def decode(caches, ids, pos, slots, tables, lens):
        calls.append(("decode", tuple(tables.shape), tables.unique().tolist(), slots.unique().tolist()))
        return runner.decode_module(caches, ids, pos, slots, tables, lens)

    def prefill(caches, ids, pos, slots, tables, lens, last):
        calls.append(("prefill", (*ids.shape, tables.shape[1]), tables.unique().tolist(), slots.unique().tolist()))
        return (runner.model(caches, ids, pos, slots, tables, lens, last),)

    runner.install_program("decode", decode)
    runner.install_program("prefill", prefill)
    return calls


def _padded_bucket(n: int, max_num_seqs: int) -> int:
    """The batch a decode step of ``n`` sequences runs at: the smallest power of two >= n, or
    ``max_num_seqs`` when that is smaller (the buckets' definition, written out again)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_num_seqs)


def test_eager_and_aoti_decode_warm_bucket_1_and_a_compiled_prefill_warms_a_chat_length_prompt():
    eager = _runner(max_num_seqs=8)
    assert eager.warmup_plan() == WarmupPlan(decode=((1, 1),), prefill=())  # no prefill program: none
    aoti = _runner(max_num_seqs=8, compile="aoti")
    _spies(aoti)
    assert aoti.warmup_plan() == WarmupPlan(decode=((1, 1),), prefill=((1, WARMUP_PREFILL_TOKENS),))
    assert aoti.warmup_plan().describe() == f"decode buckets [1] width 1; prefill 1 x {WARMUP_PREFILL_TOKENS} tokens"
    # the step's token budget caps the prompt, and so does the context (a prompt leaves one token to generate)
    small = _runner(compile="aoti", max_num_batched_tokens=20)
    _spies(small)
    assert small.warmup_plan().prefill == ((1, 20),)
    short = _runner(compile="aoti", max_model_len=10)
    _spies(short)
    assert short.warmup_plan().prefill == ((1, 9),)


@pytest.mark.parametrize("max_num_seqs", [1, 6, 8])
def test_inductor_warms_every_bucket_a_decode_batch_can_run_at_both_width_classes(max_num_seqs):
    runner = _runner(max_num_seqs=max_num_seqs, compile="inductor")
    plan = runner.warmup_plan()
    every_batch = {_padded_bucket(n, max_num_seqs) for n in range(1, max_num_seqs + 1)}
    assert {b for b, _ in plan.decode} == every_batch
    assert set(plan.decode) == {(b, w) for b in every_batch for w in (1, 2)}  # 256 tokens: 64 blocks a row
    assert plan.prefill == ()  # inductor keeps prefill eager


def test_warmup_runs_the_plan_on_the_scratch_block_only():
    runner = _runner(max_num_seqs=4, compile="aoti")
    calls = _spies(runner)
    plan = runner.warmup_plan()
    runner.warmup(plan)
    # one decode row at width 1, one prefill row of 48 tokens over ceil(48 / 4) = 12 blocks, all block 0
    assert calls == [("decode", (1, 1), [0], [0]), ("prefill", (1, WARMUP_PREFILL_TOKENS, 12), [0], [0])]
    for pool in runner.kv.tensors:  # zero-filled at allocation: only the scratch block may change
        assert not pool[:, 1:].any()
        assert pool[:, 0].any()


def test_engine_warmup_reports_its_steps_leaks_no_block_and_changes_no_output():
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 2, 44, 17], list(range(3, 40))]
    results = {}
    for warm in (False, True):
        eng = LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, BLOCKS), warmup=warm))
        phase = eng.startup_report.phases[-1]
        assert phase.name == "warmup"
        assert phase.detail == ("decode buckets [1] width 1" if warm else "skipped")
        assert eng.block_manager.num_used_blocks == 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
        streams = [eng.add_request(params, token_ids=p) for p in prompts]
        eng.run_until_done()
        results[warm] = [s.result(timeout=0).token_ids for s in streams]
        assert eng.block_manager.num_used_blocks == 0
        eng.close()
    assert results[True] == results[False]
