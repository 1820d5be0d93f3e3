"""Prefix caching in the engine, on tiny random Llama models: greedy output identical with and
without it (also under a forced hash collision, preemption and cancellation), a shared system
prompt computed once, no step ever writing into a shared or cached block, blocks shared only
between sequences with the same token history, exact block counts, the metrics, and a family
that declares prefix caching unsupported never hitting."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from model_families.llama import LlamaFamily
from runner_service import block_manager
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import FinishReason

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args()
WEIGHTS = LLAMA.random_weights(ARGS, seed=11)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, ARGS.vocab_size, (n,), generator=g).tolist()


SYSTEM = _tokens(41, 100)  # 10 full blocks of 4 and one token
USERS = [_tokens(3 + i, 200 + i) for i in range(6)]


class _Watch:
    """Wraps ``engine.runner.run``: before each step, checks that every position the step writes
    lies in a block its sequence alone holds and that is not cached, and that sequences sharing
    a block agree on every token up to that block's end. Counts the tokens each step computes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prefill_tokens: list[int] = []
        self.shared_reads = 0
        run = engine.runner.run

        def checked(batch):
            self.check(batch)
            if batch.is_prefill:
                self.prefill_tokens.append(batch.total_tokens)
            return run(batch)

        engine.runner.run = checked

    def check(self, batch) -> None:
        bm = self.engine.block_manager
        bs = bm.block_size
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_tokens, strict=True):
            for p in range(start, start + n):
                block = seq.block_table[p // bs]
                assert bm.ref_count(block) == 1 and not bm.is_cached(block), (seq, p, block)
        live = [*self.engine.scheduler.running, *self.engine.scheduler.waiting]
        owner: dict[int, tuple] = {}
        for seq in live:
            for i, block in enumerate(seq.block_table):
                history = tuple(seq.token_ids[:(i + 1) * bs])
                if block in owner:
                    self.shared_reads += 1
                    assert owner[block] == history, f"block {block} shared across different histories"
                else:
                    owner[block] = history


def _engine(*, caching=True, blocks=400, family=None, **cfg):
    return LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, blocks), enable_prefix_caching=caching,
                                                **cfg), family=family)


def _generate(engine, prompts, params=GREEDY, waves=1):
    """Greedy outputs of ``prompts``, submitted in ``waves`` consecutive groups (each group runs to
    completion before the next is added, so later groups can hit what earlier ones cached)."""
    out = []
    size = -(-len(prompts) // waves)
    for w in range(0, len(prompts), size):
        streams = [engine.add_request(params, token_ids=p) for p in prompts[w:w + size]]
        engine.run_until_done()
        out += [s.result(timeout=0).token_ids for s in streams]
    return out


def _reference(prompts, params=GREEDY):
    with _engine(caching=False) as eng:
        return _generate(eng, prompts, params)


def test_greedy_output_is_identical_with_and_without_prefix_caching():
    prompts = [SYSTEM + u for u in USERS] + [SYSTEM[:17] + USERS[0], USERS[1] + SYSTEM]
    expected = _reference(prompts)
    with _engine() as eng:
        watch = _Watch(eng)
        got = _generate(eng, prompts, waves=4)
        stats = eng.stats()
    assert got == expected
    assert stats["prefix_caching"] == 1 and stats["prefix_cache_tokens_saved"] > 0 and watch.shared_reads > 0
    assert 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["prefix_cache_hit_rate"] == pytest.approx(
        stats["prefix_cache_tokens_saved"] / stats["prefix_cache_queried_tokens"])


def test_a_shared_system_prompt_is_computed_once():
    with _engine() as eng:
        watch = _Watch(eng)
        first, second = SYSTEM + USERS[0], SYSTEM + USERS[1]
        _generate(eng, [first])
        assert watch.prefill_tokens == [len(first)]
        _generate(eng, [second])
        # 40 tokens (10 full blocks) of the system prompt hit; the rest is computed
        assert watch.prefill_tokens[-1] == len(second) - 40
        s = eng.stats()
        assert (s["prefix_cache_queried_tokens"], s["prefix_cache_tokens_saved"]) == (len(first) + len(second), 40)
        assert s["kv_blocks_used"] == 0 and s["prefix_cache_blocks"] > 10  # freed, yet still cached


def test_a_repeated_prompt_still_computes_its_last_token_and_matches():
    aligned, unaligned = SYSTEM[:40], SYSTEM  # 10 full blocks; 10 full blocks and one token
    expected = _reference([aligned, unaligned])
    with _engine() as eng:
        watch = _Watch(eng)
        got = _generate(eng, [aligned, aligned, unaligned, unaligned], waves=4)
        assert got == [expected[0], expected[0], expected[1], expected[1]]
        # the repeated aligned prompt recomputes its last block (the hit stops one token short
        # of the end, and only full blocks hit); the unaligned one computes its last token only
        assert watch.prefill_tokens == [40, 4, 1, 1]


def test_a_forced_hash_collision_never_shares_blocks_and_outputs_stay_identical(monkeypatch):
    prompts = [SYSTEM + u for u in USERS[:4]] + [USERS[2] + SYSTEM, SYSTEM[:9] + USERS[3]]
    expected = _reference(prompts)
    for blind in (lambda parent, ids: b"collide", lambda parent, ids: repr(list(ids)).encode()):
        monkeypatch.setattr(block_manager, "hash_block", blind)
        with _engine() as eng:
            _Watch(eng)
            assert _generate(eng, prompts, waves=3) == expected
            if blind(b"a", [1]) == b"collide":
                assert eng.block_manager.num_cached_blocks <= 1


def test_preemption_and_cancellation_keep_block_counts_exact_and_outputs_identical():
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [SYSTEM[:20 + 4 * (i % 5)] + USERS[i % 6] for i in range(24)]
    expected = _reference(prompts, params)
    # 30 blocks of 4 tokens: a few sequences at a time, 8 admitted at once
    with _engine(blocks=30, max_num_seqs=8) as eng:
        watch = _Watch(eng)
        baseline = eng.block_manager.num_free_blocks
        assert _generate(eng, prompts, params, waves=2) == expected
        assert eng.scheduler.num_preemptions > 0 and eng.stats()["prefix_cache_tokens_saved"] > 0
        assert eng.block_manager.num_free_blocks == baseline and eng.block_manager.num_used_blocks == 0
        assert watch.shared_reads > 0
        # cancel requests mid-prefill and mid-decode: every block returns
        streams = [eng.add_request(params, token_ids=p) for p in prompts[:6]]
        for _ in range(4):
            eng.step()
        for s in streams[::2]:
            s.cancel()
        eng.run_until_done()
        reasons = [s.result(timeout=0).finish_reason for s in streams]
        assert reasons[::2] == [FinishReason.CANCELLED] * 3 and reasons[1::2] == [FinishReason.LENGTH] * 3
        assert eng.block_manager.num_free_blocks == baseline and eng.block_manager.num_used_blocks == 0


class _NoPrefixLlama(LlamaFamily):
    supports_prefix_caching = False


def test_prefix_caching_is_off_for_a_family_that_does_not_support_it_or_when_configured_off():
    prompts = [SYSTEM + USERS[0], SYSTEM + USERS[1]]
    expected = _reference(prompts)
    for eng in (_engine(family=_NoPrefixLlama()), _engine(caching=False)):
        with eng:
            watch = _Watch(eng)
            assert not eng.prefix_caching and not eng.block_manager.enable_prefix_caching
            assert _generate(eng, prompts, waves=2) == expected
            assert watch.prefill_tokens == [len(p) for p in prompts]
            s = eng.stats()
            assert (s["prefix_caching"], s["prefix_cache_queried_tokens"], s["prefix_cache_tokens_saved"],
                    s["prefix_cache_blocks"], s["prefix_cache_hit_rate"]) == (0, 0, 0, 0, 0.0)
            assert "prefix caching off" in eng.startup_report.line()
    with _engine() as on:
        assert on.prefix_caching and "prefix caching on" in on.startup_report.line()
