"""The compiled verify program of speculative decoding (kind ``verify``) on a tiny random Llama:
built through the kernel cache only while speculating, keyed by the method and ``K``, equal to
the eager verify step, and serving greedy output equal to plain compiled decoding.

One engine builds its decode, prefill and verify programs cold (C++ compiles: the slow part);
the plain engine beside it finds its decode and prefill programs in the same cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

from kernel_cache_service.client import KernelCacheClient
from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.programs.key import program_key
from runner_service.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ARGS = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=128)
WEIGHTS = LLAMA.random_weights(ARGS, seed=5)
SPEC = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
BLOCKS = 120


def _engine(kc, **kw) -> LLMEngine:
    config = tiny_config(max_model_len=128, kv_cache_bytes=kv_bytes(ARGS, BLOCKS), compile="aoti",
                         background_compile=False, **kw)
    return LLMEngine(ARGS, WEIGHTS, config, kernel_cache=str(kc))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A speculating engine whose three programs were compiled cold into a fresh kernel cache."""
    root = tmp_path_factory.mktemp("spec-programs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMSERVE_HOME", str(root / "home"))
        engine = _engine(root / "kc", **SPEC)
        yield root, engine
        engine.close()


def _verify_inputs(n: int, S: int, nb: int, seed: int, block_size: int = 4) -> tuple[torch.Tensor, ...]:
    """A verify step of ``n`` rows of ``S`` tokens each over distinct random blocks (row ``i``'s
    first position random in its ``nb`` blocks, leaving room for the ``S`` tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS.vocab_size, (n, S), generator=g)
    pos = torch.zeros((n, S), dtype=torch.int64)
    slots = torch.zeros((n, S), dtype=torch.int64)
    tables = torch.zeros((n, nb), dtype=torch.int64)
    lens = torch.zeros(n, dtype=torch.int64)
    blocks = torch.randperm(BLOCKS - 1, generator=g)[: n * nb].view(n, nb) + 1
    for i in range(n):
        p0 = int(torch.randint(0, nb * block_size - S + 1, (), generator=g))
        p = torch.arange(p0, p0 + S)
        pos[i], tables[i], lens[i] = p, blocks[i], p0 + S
        slots[i] = blocks[i][p // block_size] * block_size + p % block_size
    return ids, pos, slots, tables, lens


def test_the_verify_program_is_built_keyed_by_method_and_k_and_equals_the_eager_step(built):
    root, engine = built
    runner = engine.runner
    assert runner.verify_program is not None and "verify=aoti#" in runner.computed_by()
    programs = {p.name: p.detail for p in engine.startup_report.phases}["programs"]
    assert "llama.verify.aoti" in programs, programs
    entries = KernelCacheClient(root=root / "kc").list("llama.verify")
    spec = runner.program_spec()
    assert [(e.name, e.fingerprint) for e in entries] == [program_key(spec, "aoti", kind="verify")]
    assert runner.warmup_plan().verify == ((1, 2),)
    runner.warmup(runner.warmup_plan())

    # K and the method are in the verify key; decode's and prefill's do not change with them
    off = dataclasses.replace(spec, speculative="off", num_draft_tokens=0, verify_module=None)
    assert off.kinds() == ("decode", "prefill") and spec.kinds() == ("decode", "prefill", "verify")
    verify_keys = {program_key(dataclasses.replace(spec, **change), "aoti", kind="verify")[1]
                   for change in ({}, {"num_draft_tokens": 2}, {"num_draft_tokens": 4}, {"speculative": "mtp"})}
    assert len(verify_keys) == 4
    for kind in ("decode", "prefill"):
        assert program_key(off, "aoti", kind=kind) == program_key(spec, "aoti", kind=kind)
    with pytest.raises(ValueError):
        program_key(off, "aoti", kind="verify")

    # the program against the eager step, over the same random-filled pools
    g = torch.Generator().manual_seed(7)
    for pool in runner.kv.tensors:
        pool.copy_(torch.randn(pool.shape, generator=g))
    before = [p.clone() for p in runner.kv.tensors]
    for n, (rows, S, nb) in enumerate([(1, 2, 1), (1, 4, 3), (3, 3, 2), (5, 4, 6), (8, 2, 5)]):
        inputs = _verify_inputs(rows, S, nb, seed=n)
        with torch.inference_mode():
            got = runner.verify(*inputs)
            compiled_pools = [p.clone() for p in runner.kv.tensors]
            for pool, old in zip(runner.kv.tensors, before, strict=True):
                pool.copy_(old)
            want = runner.verify_module(runner.kv.tensors, *inputs)[0]
        assert got.shape == want.shape == (rows, S, ARGS.vocab_size) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for a, b in zip(compiled_pools, runner.kv.tensors, strict=True):
            torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-5, rtol=0)  # block 0: the scratch block
        before = [p.clone() for p in runner.kv.tensors]


def test_greedy_output_through_the_compiled_verify_equals_plain_compiled_decoding(built):
    root, engine = built
    g = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(8):  # copy-heavy prompts (drafts found) of different lengths, and random ones
        span = torch.randint(2, ARGS.vocab_size, (3 + i,), generator=g).tolist()
        prompts.append(span * 3 if i % 2 == 0 else torch.randint(2, ARGS.vocab_size, (10 + i,), generator=g).tolist())
    requests = [(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)) for p in prompts]

    def run(e):
        streams = [e.add_request(params, token_ids=ids) for ids, params in requests]
        e.run_until_done()
        return [s.result(timeout=0) for s in streams]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMSERVE_HOME", str(root / "home-plain"))
        plain_engine = _engine(root / "kc")
    try:
        assert plain_engine.runner.decode_program is not None and plain_engine.runner.verify_program is None
        plain = run(plain_engine)
    finally:
        plain_engine.close()
    engine.gate = None  # every step with drafts verifies them (the gate would decline some)
    got = run(engine)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for a, b in zip(got, plain, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-3
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0
