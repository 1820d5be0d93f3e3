"""DeepSeek V4 served on paged caches, checked against transformers' ``DeepseekV4ForCausalLM``
(``use_cache=False``, each sequence alone: padded batches are no reference for this model).

Every test goes the whole way a user's checkpoint goes: a tiny release-named checkpoint
(``tests/deepseek_v4_tiny.py``), packed into a sidecar by the weight service, loaded by the
runner. Sequences run past the window (8), the HCA rate (8) and give the CSA indexer more entries
than its top-k (2), so eviction from the ring, compression and selection are all exercised.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_tiny import TINY_ALL_KINDS, TINY_HC4, write_tiny_deepseek_v4
from runner_tiny import tiny_config

from model_families.deepseek_v4 import FAMILY
from runner_service.engine import LLMEngine
from runner_service.kv_cache import KVCache
from runner_service.sampling_params import SamplingParams
from weight_service.loader import load_sidecar
from weight_service.prepare import prepare

PRESETS = {"all_kinds_hc2": TINY_ALL_KINDS, "hc4_2layers": TINY_HC4}
WINDOW, HCA_RATE = 8, 8
#: Generated tokens: at least 3x the window plus 2x the HCA rate.
GENERATED = 3 * WINDOW + 2 * HCA_RATE


@pytest.fixture(scope="module", params=sorted(PRESETS))
def packed(request, tmp_path_factory):
    """(transformers reference, sidecar directory) for one preset."""
    root = tmp_path_factory.mktemp(f"dsv4-{request.param}")
    reference = write_tiny_deepseek_v4(root / "ckpt", PRESETS[request.param])
    handle = prepare(str(root / "ckpt"), root=root / "sidecars")
    assert handle.family == "deepseek_v4"
    return reference, handle.path


def _weights(path):
    """The sidecar's config and weights (copies: the sidecar's mapping closes on return)."""
    with load_sidecar(path) as sidecar:
        config = FAMILY.config_from_dict(sidecar.config)
        tensors = {name: t.clone() for name, t in sidecar.tensors.items()}
    return config, FAMILY.load_weights(config, tensors, torch.float32, torch.device("cpu"))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, 120, (n,), generator=g)]


def _reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids]), use_cache=False).logits[0].float()


def _reference_greedy(reference, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(reference(torch.tensor([out]), use_cache=False).logits[0, -1].argmax()))
    return out[len(ids):]


def _run_chunks(model, kv, ids: list[int], table: list[int], chunk: int) -> dict[int, torch.Tensor]:
    """Prefill ``ids`` into ``kv`` in chunks of ``chunk`` tokens; logits [V] of each chunk's
    last position, by position."""
    out, start, n = {}, 0, len(ids)
    bt = torch.tensor([table])
    while start < n:
        end = min(n, start + chunk)
        s = end - start
        with torch.inference_mode():
            logits = model(kv.tensors, torch.tensor([ids[start:end]]), torch.arange(start, end)[None],
                           torch.zeros(1, s, dtype=torch.int64), bt, torch.tensor([end]), torch.tensor([s - 1]))
        out[end - 1] = logits[0]
        start = end
    return out


def _fresh_cache(config, block_size=4, blocks=64):
    return KVCache(FAMILY.cache_specs(config, block_size), blocks, block_size, torch.float32, torch.device("cpu"))


@pytest.mark.usefixtures("one_torch_thread")
def test_logits_at_every_position_match_transformers(packed):
    """Prompts of several lengths followed by GENERATED greedy tokens: the logits of every
    position, computed one token per step (the decode path), and of whole and chunked prefills,
    equal transformers' within 1e-4."""
    reference, path = packed
    config, weights = _weights(path)
    model = FAMILY.build_model(config, weights, 256)
    layout = FAMILY.block_layout(config, 4, 256)
    for n in (1, 6, 13):
        prompt = _prompt(n, n)
        ids = prompt + _reference_greedy(reference, prompt, GENERATED)
        want = _reference_logits(reference, ids)
        table = list(range(1, 1 + layout.blocks_needed(len(ids))))
        per_token = _run_chunks(model, _fresh_cache(config), ids, table, 1)
        assert sorted(per_token) == list(range(len(ids)))
        got = torch.stack([per_token[p] for p in range(len(ids))])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for chunk in (3, 7, len(ids)):
            for p, logits in _run_chunks(model, _fresh_cache(config), ids, table, chunk).items():
                torch.testing.assert_close(logits, want[p], atol=1e-4, rtol=0)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_leaves_the_same_caches_as_one_prefill(packed, chunk):
    """Chunk boundaries off the compressor windows (rates 4 and 8) give the same ring rows,
    compressed entries and indexer keys as one whole prefill."""
    _, path = packed
    config, weights = _weights(path)
    model = FAMILY.build_model(config, weights, 256)
    ids = _prompt(45, 7)
    table = list(range(1, 1 + FAMILY.block_layout(config, 4, 256).blocks_needed(len(ids))))
    whole, chunked = _fresh_cache(config), _fresh_cache(config)
    _run_chunks(model, whole, ids, table, len(ids))
    _run_chunks(model, chunked, ids, table, chunk)
    for spec, a, b in zip(whole.specs, whole.tensors, chunked.tensors, strict=True):
        # block 0 is scratch (padding and non-closing windows write there); the rest must agree
        torch.testing.assert_close(b[:, 1:], a[:, 1:], atol=1e-5, rtol=0, msg=lambda m, s=spec.name: f"{s}: {m}")
    assert any(t[:, 1:].abs().sum() > 0 for t in whole.tensors)


def _engine(path, **cfg) -> LLMEngine:
    return LLMEngine.from_sidecar(path, tiny_config(compile="off", **cfg))


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    streams = [engine.add_request(params, token_ids=p) for p in prompts]
    while engine.step():
        pass
    return [s.result(timeout=5).token_ids for s in streams]


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_greedy_batched_equals_transformers_alone(packed):
    """8 sequences of unequal lengths decoded together give transformers' greedy tokens of each
    sequence alone; the engine reports the family and frees every block at the end."""
    reference, path = packed
    engine = _engine(path)
    prompts = [_prompt(n, 100 + n) for n in (3, 9, 17, 30, 5, 12, 21, 1)]
    got = _greedy(engine, prompts, GENERATED)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == _reference_greedy(reference, prompt, GENERATED), len(prompt)
    assert engine.family == "deepseek_v4"
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_engine_chunked_prefill_equals_whole(packed, chunk):
    """A prefill budget of ``chunk`` tokens per step splits every prompt off the compressor
    windows; the greedy tokens equal those of whole prefills."""
    _, path = packed
    prompts = [_prompt(n, 200 + n) for n in (19, 26)]
    whole = _greedy(_engine(path), prompts, 20)
    assert _greedy(_engine(path, max_num_batched_tokens=chunk), prompts, 20) == whole


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_preemption_recomputes_exactly(packed):
    """A cache too small for all sequences at once forces recompute preemption; the tokens
    equal an unconstrained run's, and no block leaks."""
    _, path = packed
    prompts = [_prompt(n, 300 + n) for n in (14, 22, 9, 31)]
    free = _engine(path)
    want = _greedy(free, prompts, 30)
    config = free.args
    per_block = sum(s.bytes_per_block(torch.float32) for s in FAMILY.cache_specs(config, 4))
    tight = _engine(path, kv_cache_bytes=per_block * 12)
    assert _greedy(tight, prompts, 30) == want
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_used_blocks == 0


@pytest.mark.usefixtures("one_torch_thread")
def test_cancel_frees_every_block(packed):
    _, path = packed
    engine = _engine(path)
    stream = engine.add_request(SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                                token_ids=_prompt(20, 5))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    stream.cancel()
    while engine.step():
        pass
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
