"""Batch-invariant mode (``EngineConfig.batch_invariant``) on a tiny random Llama: 32 prompts of
mixed lengths, greedy and seeded, give bitwise the same tokens run one at a time (one chunk, no
prefix cache) as run together with chunked prefill and prefix-cache hits, in f32 and bf16; and
the prefix cache never hands a block computed by one program to another."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from services.errors import InvalidArgument

ARGS = tiny_args()
WEIGHTS = LLAMA.random_weights(ARGS, seed=5)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, ARGS.vocab_size, (n,), generator=g).tolist()


SYSTEM = _tokens(37, 1)
#: 32 prompts of 3 to 70 tokens; every other one opens with a prefix of SYSTEM (cache hits).
PROMPTS = [(SYSTEM[:9 + 2 * i] if i % 2 else []) + _tokens(3 + (7 * i) % 31, 100 + i) for i in range(32)]


def _params(i: int) -> SamplingParams:
    if i % 3:
        return SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)


def _engine(dtype: str, **cfg) -> LLMEngine:
    return LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, 2000), dtype=dtype,
                                                batch_invariant=True, **cfg))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_every_token_is_the_same_alone_and_batched_chunked_and_cached(dtype: str) -> None:
    alone = []
    with _engine(dtype, max_num_seqs=1, enable_prefix_caching=False, max_num_batched_tokens=256) as eng:
        for i, p in enumerate(PROMPTS):
            stream = eng.add_request(_params(i), token_ids=p)
            eng.run_until_done()
            alone.append(stream.result(timeout=0).token_ids)
    with _engine(dtype, max_num_seqs=32, max_num_batched_tokens=24) as eng:
        first = [4, 9]  # run first, so that the later SYSTEM prompts hit their blocks
        streams = {i: eng.add_request(_params(i), token_ids=PROMPTS[i]) for i in first}
        eng.run_until_done()
        streams |= {i: eng.add_request(_params(i), token_ids=p) for i, p in enumerate(PROMPTS) if i not in first}
        eng.run_until_done()
        batched = [streams[i].result(timeout=0).token_ids for i in range(len(PROMPTS))]
        stats = eng.stats()
    assert stats["prefix_cache_tokens_saved"] > 0 and stats["prefix_cache_tokens_saved"] < sum(map(len, PROMPTS))
    assert [len(t) for t in alone] == [10] * 32
    assert batched == alone


def test_the_mode_runs_eager_and_refuses_quantized_weights() -> None:
    with _engine("f32", compile="aoti") as eng:
        assert eng.config.compile == "off" and eng.programs.state == "off"
        assert eng.runner.invariance is not None
    with pytest.raises(InvalidArgument, match="float weights"):
        LLMEngine(ARGS, _QuantizedStub(WEIGHTS), tiny_config(batch_invariant=True))


class _QuantizedStub:
    """Weights that say they are quantized (the engine checks before it uses them)."""

    def __init__(self, weights) -> None:
        self._w = weights

    def __getattr__(self, name):
        return getattr(self._w, name)

    quantization = "int4"


def test_prefix_blocks_computed_eagerly_are_not_reused_by_a_program_installed_later() -> None:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, 400))) as eng:
        eng.add_request(params, token_ids=SYSTEM + [5])
        eng.run_until_done()
        runner = eng.runner
        eng.call_between_steps(lambda: runner.install_program(
            "prefill", lambda caches, *inputs: (runner.model(caches, *inputs),)))
        eng.add_request(params, token_ids=SYSTEM + [6])
        eng.run_until_done()
        assert eng.stats()["prefix_cache_tokens_saved"] == 0  # a different program: no hit
        eng.add_request(params, token_ids=SYSTEM + [7])
        eng.run_until_done()
        assert eng.stats()["prefix_cache_tokens_saved"] == 36  # what the program computed: hits
