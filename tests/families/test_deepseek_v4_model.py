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


def _run_decode(model, kv, ids: list[int], table: list[int]) -> torch.Tensor:
    """Every position of ``ids`` through the read-only decode step (:meth:`decode`: rows and
    their slots returned, then written as the runner writes them); logits [len(ids), V]."""
    from model_families.kv_write import write_kv_rows

    bt, out = torch.tensor([table]), []
    for p, token in enumerate(ids):
        with torch.inference_mode():
            logits, *rest = model.decode(kv.tensors, torch.tensor([token]), torch.tensor([p]),
                                         torch.zeros(1, dtype=torch.int64), bt, torch.tensor([p + 1]))
            n = len(rest) // 2
            for pool, rows, slots in zip(kv.tensors, rest[:n], rest[n:], strict=True):
                write_kv_rows(pool, slots, rows)
        out.append(logits[0])
    return torch.stack(out)


def _fresh_cache(config, block_size=4, blocks=64):
    return KVCache(FAMILY.cache_specs(config, block_size), blocks, block_size, torch.float32, torch.device("cpu"))


@pytest.mark.usefixtures("one_torch_thread")
def test_logits_at_every_position_match_transformers(packed):
    """Prompts of several lengths followed by GENERATED greedy tokens: the logits of every
    position, computed one token per step by the read-only decode step and by one-token
    prefill chunks, and those of whole and chunked prefills, equal transformers' within 1e-4."""
    reference, path = packed
    config, weights = _weights(path)
    model = FAMILY.build_model(config, weights, 256)
    layout = FAMILY.block_layout(config, 4, 256)
    for n in (1, 6, 13):
        prompt = _prompt(n, n)
        ids = prompt + _reference_greedy(reference, prompt, GENERATED)
        want = _reference_logits(reference, ids)
        table = list(range(1, 1 + layout.blocks_needed(len(ids))))
        torch.testing.assert_close(_run_decode(model, _fresh_cache(config), ids, table), want, atol=1e-4, rtol=0)
        per_token = _run_chunks(model, _fresh_cache(config), ids, table, 1)
        assert sorted(per_token) == list(range(len(ids)))
        torch.testing.assert_close(torch.stack([per_token[p] for p in range(len(ids))]), want, atol=1e-4, rtol=0)
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


def _reference_greedy_cached(reference, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens as its ``generate`` makes them: the prompt in one cached
    forward, then one token per forward on the cache. (With ``use_cache=False`` every forward
    rescores the earlier positions over longer indexer rows, whose ``torch.topk`` may break an
    exact tie otherwise: with few indexer heads that text differs from its own cached text.)"""
    out = list(ids)
    with torch.no_grad():
        step = reference(torch.tensor([ids]), use_cache=True)
        out.append(int(step.logits[0, -1].argmax()))
        for _ in range(n - 1):
            step = reference(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True,
                             position_ids=torch.tensor([[len(out) - 1]]))
            out.append(int(step.logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("preset, seed", [("hc4_2layers", 0), ("all_kinds_hc2", 1)])
def test_engine_greedy_with_tied_indexer_scores_equals_transformers(tmp_path, preset, seed):
    """4 indexer heads: a score (a sum of 4 ReLUs) is exactly 0 for about one entry in 16, so
    ties straddle the top-k boundary within a few dozen tokens, and ``torch.topk`` breaks them
    by the row's length. The indexer's rows are each query's closed entries, as transformers'
    cached decode scores them (``custom_ops.index_topk``), so 64 greedy tokens of each prompt,
    alone and 4 together, equal transformers' token for token. (Top-k over the table's capacity
    with the rest masked, as before: these prompts diverged after 7, 17, 36 and 60 tokens.)"""
    reference = write_tiny_deepseek_v4(tmp_path / "ckpt", PRESETS[preset], seed=seed, index_n_heads=4)
    path = prepare(str(tmp_path / "ckpt"), root=tmp_path / "sidecars").path
    prompts = [_prompt(n, 100 + n) for n in (3, 9, 17, 30)]
    want = [_reference_greedy_cached(reference, p, 64) for p in prompts]
    assert _greedy(_engine(path), prompts, 64) == want
    engine = _engine(path)
    assert [_greedy(engine, [p], 64)[0] for p in prompts] == want


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


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", [dict(naming="saved"), dict(naming="transformers", shards=2),
                                  dict(quantized=True, shards=3)], ids=["save_pretrained", "transformers", "fp8_fp4"])
def test_every_naming_and_quantized_release_give_transformers_logits(tmp_path, kind):
    """What ``save_pretrained`` writes, transformers' module naming (sharded) and a release
    checkpoint storing FP8 block-scaled matrices and FP4 experts (sharded) all serve the logits of
    the model they came from (the quantized one: the model with the dequantized values)."""
    reference = write_tiny_deepseek_v4(tmp_path / "ckpt", TINY_ALL_KINDS, seed=4, **kind)
    config, weights = _weights(prepare(str(tmp_path / "ckpt"), root=tmp_path / "sidecars").path)
    model = FAMILY.build_model(config, weights, 256)
    ids = _prompt(37, 11)
    table = list(range(1, 1 + FAMILY.block_layout(config, 4, 256).blocks_needed(len(ids))))
    want = _reference_logits(reference, ids)
    for p, logits in _run_chunks(model, _fresh_cache(config), ids, table, 5).items():
        torch.testing.assert_close(logits, want[p], atol=1e-4, rtol=0)


def _runner(config, weights, compile_mode: str, seed: int = 5):
    """A runner over a 64-block cache filled with random rows (deterministic in ``seed``), so
    decode reads real-looking history from every pool."""
    from runner_service.model_runner import ModelRunner

    kv = _fresh_cache(config)
    g = torch.Generator().manual_seed(seed)
    for pool in kv.tensors:
        pool.copy_(torch.randn(pool.shape, generator=g))
    cfg = tiny_config(max_num_seqs=4, block_size=4, max_model_len=128, compile=compile_mode, device="cpu")
    return ModelRunner(config, weights, kv, cfg, 128, torch.device("cpu"))


@pytest.mark.slow  # builds an AOTInductor program
@pytest.mark.usefixtures("one_torch_thread")
def test_aoti_decode_program_equals_eager(tmp_path):
    """The decode step compiled by AOTInductor through the kernel cache (weights kept out of the
    package) gives eager's logits and cache writes within 1e-4, at several batch sizes, block
    widths and positions (windows closing and not; rows at different positions, whose indexer
    rows differ in length: ``warmserve::index_topk`` groups them at run time). 4 indexer heads,
    so indexer scores tie at 0."""
    from kernel_cache_service.client import KernelCacheClient
    from runner_service.programs.load import load_programs

    write_tiny_deepseek_v4(tmp_path / "ckpt", TINY_ALL_KINDS, seed=2, index_n_heads=4)
    config, weights = _weights(prepare(str(tmp_path / "ckpt"), root=tmp_path / "sidecars").path)
    compiled, eager = _runner(config, weights, "aoti"), _runner(config, weights, "off")
    report = load_programs(compiled.program_spec(), compiled.install_program, kernel_cache=str(tmp_path / "kc"), work_dir=tmp_path / "work")
    assert report.mode == "aoti" and report.source == "compiled" and report.published == "PUBLISHED", report
    assert report.prefill_source == "eager"
    entries = KernelCacheClient(root=tmp_path / "kc").list("deepseek_v4.decode")
    assert [e.name for e in entries] == ["deepseek_v4.decode.aoti"]
    package = max((p for p in (tmp_path / "kc").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    assert weights.experts_gate_up[1, 2].numpy().tobytes() not in package.read_bytes()  # weights kept out
    hit = _runner(config, weights, "aoti")
    again = load_programs(hit.program_spec(), hit.install_program, kernel_cache=str(tmp_path / "kc"), work_dir=tmp_path / "work2")
    assert (again.source, again.fingerprint) == ("hit", report.fingerprint), again
    g = torch.Generator().manual_seed(9)
    for batch, nb, position in ((1, 3, 9), (4, 5, 19), (2, 12, 47), (4, 12, 31), (4, 12, (23, 47, 31, 39))):
        ids = torch.randint(0, config.vocab_size, (batch,), generator=g)
        pos = torch.tensor(position) if isinstance(position, tuple) else torch.full((batch,), position)
        tables = torch.stack([torch.randperm(63, generator=g)[:nb] + 1 for _ in range(batch)])
        inputs = (ids, pos, torch.zeros(batch, dtype=torch.int64), tables, pos + 1)
        with torch.inference_mode():
            got = compiled.decode(*inputs)
            from_hit = hit.decode(*inputs)
            want = eager.decode_step(*inputs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(from_hit, want, atol=1e-4, rtol=0)
        for a, b in zip(compiled.kv.tensors, eager.kv.tensors, strict=True):
            torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-4, rtol=0)


@pytest.mark.slow  # builds an AOTInductor program
@pytest.mark.usefixtures("one_torch_thread")
def test_aoti_verify_program_equals_eager_and_returns_the_streams_for_mtp(tmp_path):
    """The speculative verify step (1 + k tokens a row, written in place) compiled by AOTInductor
    gives eager's logits of every position and cache writes within 1e-4, across window and
    compression boundaries (rows 3 positions apart, 4 indexer heads: indexer rows of several
    lengths a step, ties at 0). Built for ``mtp`` it also returns the residual streams the MTP
    drafter reads, equal to eager's; ``ngram``'s verify step is the same step without them (its
    own program key: the method is in it). One CSA layer, hc_mult 4: the layer kind with a window,
    compression and the indexer (compile time grows with the layers; the decode program's test
    above compiles every kind)."""
    import dataclasses

    from runner_service.model_runner import ModelRunner
    from runner_service.programs.aoti import AotiProgram, compile_program
    from runner_service.programs.key import program_key

    config = FAMILY.config_from_hf(dict(TINY_HC4, index_n_heads=4, num_hidden_layers=1,
                                        layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"]))
    weights = FAMILY.random_weights(config, seed=4)

    def runner(compile_mode, method="mtp"):
        cfg = tiny_config(max_num_seqs=4, block_size=4, max_model_len=128, compile=compile_mode, device="cpu",
                          speculative=method, num_speculative_tokens=3)
        kv = KVCache(FAMILY.cache_specs(config, 4), 64, 4, torch.float32, torch.device("cpu"))
        g = torch.Generator().manual_seed(6)
        for pool in kv.tensors:
            pool.copy_(torch.randn(pool.shape, generator=g))
        return ModelRunner(config, weights, kv, cfg, 128, torch.device("cpu"))

    compiled, eager, ngram = runner("aoti"), runner("off"), runner("off", "ngram")
    spec = compiled.program_spec()
    assert spec.kinds() == ("decode", "verify")  # prefill stays eager for this family
    assert compiled.verify_module.with_streams and not ngram.verify_module.with_streams
    assert program_key(spec, "aoti", kind="verify") != program_key(
        dataclasses.replace(spec, speculative="ngram"), "aoti", kind="verify")
    program = AotiProgram(compile_program(spec, "verify", tmp_path / "verify.pt2"), compiled.verify_module,
                          compiled.device)
    compiled.install_program("verify", program)
    g = torch.Generator().manual_seed(9)
    for batch, S, nb, start in ((1, 2, 3, 6), (3, 4, 8, 13), (2, 3, 12, 29), (4, 4, 12, 44)):
        ids = torch.randint(0, config.vocab_size, (batch, S), generator=g)
        pos = torch.arange(start, start + S) + 3 * torch.arange(batch)[:, None]
        tables = torch.stack([torch.randperm(63, generator=g)[:nb] + 1 for _ in range(batch)])
        inputs = (ids, pos, torch.zeros(batch, S, dtype=torch.int64), tables, pos[:, -1] + 1)
        with torch.inference_mode():
            (got, got_streams), (want, want_streams) = compiled.verify_outputs(*inputs), eager.verify_outputs(*inputs)
            plain = ngram.verify_outputs(*inputs)
        assert got.shape == (batch, S, config.vocab_size)
        assert got_streams.shape == want_streams.shape == (batch, S, config.hc_mult, config.hidden_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got_streams, want_streams, atol=1e-4, rtol=0)
        assert len(plain) == 1 and torch.equal(plain[0], want)
        for a, b in zip(compiled.kv.tensors, eager.kv.tensors, strict=True):
            torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-4, rtol=0)


def test_the_number_of_speculative_tokens_and_the_method_are_in_every_key_they_change():
    """K sizes the window ring's spare slots (the block layout, rounded up to whole blocks), so
    the decode key changes with the ring's size, and a verify program is keyed by its method and K: a program built for K = 2 is never
    loaded for K = 3, nor an ngram verify for mtp. Without speculation no verify key exists."""
    from model_families.deepseek_v4.cache_layout import ring_tokens
    from runner_service.model_runner import ModelRunner
    from runner_service.programs.key import program_key

    config = FAMILY.config_from_hf(TINY_HC4)
    weights = FAMILY.random_weights(config, seed=2)

    def keys(method: str, k: int) -> dict[str, str]:
        cfg = tiny_config(max_num_seqs=4, block_size=4, max_model_len=128, compile="aoti", device="cpu",
                          speculative=method, num_speculative_tokens=k)
        kv = KVCache(FAMILY.cache_specs(config, 4), 64, 4, torch.float32, torch.device("cpu"))
        spec = ModelRunner(config, weights, kv, cfg, 128, torch.device("cpu")).program_spec()
        return {kind: program_key(spec, "aoti", kind=kind)[1] for kind in spec.kinds()}

    off, k2, k3, mtp3 = keys("off", 1), keys("ngram", 2), keys("ngram", 3), keys("mtp", 3)
    assert set(off) == {"decode"} and set(k2) == set(k3) == set(mtp3) == {"decode", "verify"}
    rings = {k: ring_tokens(config, 4, k) for k in (0, 2, 3)}
    assert rings[0] != rings[2]  # K's spare slots rounded up to whole blocks
    assert off["decode"] != k2["decode"] and (k2["decode"] == k3["decode"]) == (rings[2] == rings[3])
    assert k3["decode"] == mtp3["decode"]  # the layout depends on K, not on the method
    assert len({k2["verify"], k3["verify"], mtp3["verify"]}) == 3
    assert keys("ngram", 3) == k3


def test_program_fingerprint_covers_the_layout_dims():
    """Window, compress rates, top-k, experts, hc_mult and layer kinds each change the decode
    program's fingerprint; the same config gives the same one."""
    from model_families.deepseek_v4.config import DeepseekV4Config
    from runner_service.programs.key import program_key

    base = dict(TINY_ALL_KINDS, architectures=["DeepseekV4ForCausalLM"])

    def key(**change):
        config = DeepseekV4Config.from_hf({**base, **change})
        return program_key(_runner(config, FAMILY.random_weights(config), "aoti").program_spec(), "aoti")[1]

    variants = [dict(sliding_window=12), dict(index_topk=3), dict(n_routed_experts=8), dict(hc_mult=4),
                dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}),
                dict(layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"])]
    keys = [key(**v) for v in variants]
    assert key() == key()
    assert len({key(), *keys}) == len(variants) + 1


@pytest.mark.usefixtures("one_torch_thread")
def test_grpc_runner_serves_the_checkpoint_and_reports_its_layer_kinds(packed):
    """The runner's gRPC API over a DeepSeek V4 sidecar: ``ModelInfo`` names the family and the
    layer kinds; a streamed greedy completion of a text prompt equals transformers' greedy."""
    import grpc

    from runner_service.servicer import GenerationServicer
    from services.bootstrap import ServerConfig, ServiceServer
    from services.proto import generation_pb2 as pb
    from services.proto import generation_pb2_grpc

    reference, path = packed
    engine = _engine(path, max_num_seqs=2)
    engine.start()
    server = ServiceServer(ServerConfig(service="runner"), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, "r-dsv4"),
         "warmserve.v1.Generation")])
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.ModelInfo(pb.ModelInfoRequest())
        assert info.family == "deepseek_v4"
        assert list(info.layer_types) == list(engine.args.layer_types) == list(
            reference.config.layer_types)
        text = "w5 w17 w9 w44 w3 w60 w61 w12 w30 w8 w5"
        request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(
            max_tokens=GENERATED, temperature=0.0, ignore_eos=True))
        got = [t for delta in stub.Generate(request, timeout=60) for t in delta.token_ids]
        assert got == _reference_greedy(reference, engine.tokenizer.encode(text), GENERATED)
    finally:
        channel.close()
        server.stop()
        engine.close()
