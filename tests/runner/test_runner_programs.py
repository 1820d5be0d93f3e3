"""Compiled decode programs (runner_service/programs/) on a tiny random Llama.

Each cold compile runs the C++ compiler (~20-30 s on 2 cores), so the tests share one AOTI
build (module fixture) and compile again only where a MISS is the point of the test. The eager
decode step they compare against is checked against transformers in tests/families/test_llama_model.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from runner_tiny import tiny_args, tiny_config

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.fingerprint import UNKNOWN
from model_families import native
from model_families.llama import FAMILY as LLAMA
from runner_service.kv_cache import KVCache
from runner_service.model_runner import ModelRunner
from runner_service.programs.aoti import read_own_constants
from runner_service.programs.cache import open_kernel_cache
from runner_service.programs.key import (
    CODEGEN_ENV_PREFIXES,
    codegen_environment,
    program_key,
    program_sources,
)
from runner_service.programs.load import ProgramsReport, load_programs
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import ScheduledBatch
from runner_service.sequence import Sequence

# Builds AOTInductor programs (minutes on 2 cores): not in `make check`.
pytestmark = pytest.mark.slow

TESTS_DIR = Path(__file__).resolve().parents[1]  # tests/: runner_tiny.py lives there
NUM_BLOCKS = 48


def make_runner(*, dtype: torch.dtype = torch.float32, block_size: int = 4, max_num_seqs: int = 4,
                max_model_len: int = 64, compile: str = "aoti", layers: int = 2, seed: int = 3,
                weights_dtype: str = "f32", activations: str = "int8") -> ModelRunner:
    """A runner over a tiny random model (``weights_dtype`` layout; its shapes fit int4) with a
    KV cache of ``NUM_BLOCKS`` random-filled blocks (deterministic in ``seed``), so attention
    reads real history from the pool."""
    args = tiny_args(vocab=96, hidden=32, inter=64, layers=layers, heads=4, kv_heads=2, head_dim=8, max_pos=128)
    weights = LLAMA.random_weights(args, dtype=dtype, seed=seed, weights_dtype=weights_dtype)
    kv = KVCache(LLAMA.cache_specs(args, block_size), NUM_BLOCKS, block_size, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed + 1)
    kv.pools["k"].copy_(torch.randn(kv.pools["k"].shape, generator=g).to(dtype))
    kv.pools["v"].copy_(torch.randn(kv.pools["v"].shape, generator=g).to(dtype))
    config = tiny_config(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len,
                         dtype="bf16" if dtype == torch.bfloat16 else "f32", compile=compile, device="cpu",
                         quantized_activations=activations)
    return ModelRunner(args, weights, kv, config, max_model_len, torch.device("cpu"))


def load(runner: ModelRunner, **kw) -> ProgramsReport:
    """:func:`load_programs` of ``runner``'s spec, installing into ``runner``."""
    return load_programs(runner.program_spec(), runner.install_program, **kw)


def decode_inputs(runner: ModelRunner, batch: int, active: int, nb: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Decode inputs for ``batch`` rows of which ``active`` are real: row i owns distinct blocks,
    decodes the token at a random position < nb * block_size; padding rows use the scratch block.
    ``block_tables`` is a strided view, as the runner's persistent buffers hand it over."""
    g = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    ids = torch.zeros(batch, dtype=torch.int64)
    pos = torch.zeros(batch, dtype=torch.int64)
    slots = torch.zeros(batch, dtype=torch.int64)
    tables = torch.zeros((batch, nb), dtype=torch.int64)
    lens = torch.ones(batch, dtype=torch.int64)
    for i in range(active):
        blocks = torch.randperm(NUM_BLOCKS - 1, generator=g)[:nb] + 1
        p = int(torch.randint(0, nb * bs, (1,), generator=g))
        ids[i] = int(torch.randint(0, runner.args.vocab_size, (1,), generator=g))
        pos[i], lens[i] = p, p + 1
        tables[i] = blocks
        slots[i] = blocks[p // bs] * bs + p % bs
    # the runner passes a [:B, :nb] view of its persistent [max_num_seqs, max_blocks] buffer
    wide = torch.zeros((batch + 1, runner.max_blocks_per_seq), dtype=torch.int64)
    wide[:batch, :nb] = tables
    return ids, pos, slots, wide[:batch, :nb], lens


def assert_compiled_matches_eager(compiled: ModelRunner, eager: ModelRunner, cases, atol: float) -> None:
    """Run each (batch, active, nb) case on both runners, 3 steps each; logits of the active
    rows and the KV pools (but the scratch block) must agree within ``atol``."""
    for n, (batch, active, nb) in enumerate(cases):
        for step in range(3):
            inputs = decode_inputs(compiled, batch, active, nb, seed=100 * n + step)
            with torch.inference_mode():
                got = compiled.decode(*inputs)
                want = eager.decode_step(*inputs)
            assert got.shape == want.shape == (batch, compiled.args.vocab_size)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got[:active], want[:active], atol=atol, rtol=0)
            # block 0 is the scratch block: padding rows all write slot 0, in no defined order
            torch.testing.assert_close(compiled.kv.pools["k"][:, 1:].float(), eager.kv.pools["k"][:, 1:].float(), atol=atol, rtol=0)
            torch.testing.assert_close(compiled.kv.pools["v"][:, 1:].float(), eager.kv.pools["v"][:, 1:].float(), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cold AOTI build of the default tiny runner, published to a fresh kernel cache."""
    root = tmp_path_factory.mktemp("programs")
    runner = make_runner()
    report = load(runner, kernel_cache=str(root / "kc"), work_dir=root / "work")
    (root / "threads").write_text(str(torch.get_num_threads()))  # part of the key: a warm launch uses the same
    return root, runner, report


def reuse_cold_build(root: Path, compiled: list[str]):
    """A :data:`~runner_service.programs.aoti.Compiler` that fetches the ``built`` fixture's
    published program of the asked key (the default tiny runner's) instead of compiling it
    again, and records each kind in ``compiled``: for the tests of what the cache does around a
    build (quarantine, eviction, a failed publish), where the compile itself is the fixture's."""
    cold = KernelCacheClient(root=root / "kc")

    def compiler(spec, kind: str, package: Path) -> Path:
        compiled.append(kind)
        assert cold.fetch(*program_key(spec, spec.mode, kind=kind), package) is not None
        return package

    return compiler


def test_aoti_cold_build_is_published_and_matches_eager(built):
    root, runner, report = built
    assert report.mode == "aoti" and report.source == "compiled", report
    assert report.published == "PUBLISHED" and len(report.fingerprint) == 64
    entries = KernelCacheClient(root=root / "kc").list("llama.decode")
    assert [(e.name, e.fingerprint) for e in entries] == [("llama.decode.aoti", report.fingerprint)]
    # one program for every bucket: the batch and block-table width are dynamic
    assert runner.decode_program is not None and runner.buckets == [1, 2, 4]
    eager = make_runner(compile="off")
    cases = [(1, 1, 1), (1, 1, 5), (2, 2, 3), (4, 3, 8), (4, 4, 16)]
    assert_compiled_matches_eager(runner, eager, cases, atol=1e-4)


def prefill_batch(chunks: list[tuple[int, int, int]], vocab: int, block_size: int, seed: int) -> ScheduledBatch:
    """A prefill batch: per row ``(prompt_len, start, n)``: the chunk ``[start, start + n)`` of a
    random prompt, over distinct blocks (1 + 8 i onwards; block 0 is the scratch block)."""
    g = torch.Generator().manual_seed(seed)
    batch = ScheduledBatch(is_prefill=True)
    for i, (length, start, n) in enumerate(chunks):
        seq = Sequence(f"r{i}", torch.randint(0, vocab, (length,), generator=g).tolist(),
                       SamplingParams(max_tokens=1), max_model_len=64)
        seq.block_table = list(range(1 + 8 * i, 1 + 8 * i + -(-length // block_size)))
        batch.seqs.append(seq)
        batch.starts.append(start)
        batch.num_tokens.append(n)
    return batch


def test_compiled_prefill_matches_eager_including_one_token_and_later_chunks(built):
    root, _, report = built
    assert report.prefill_source == "compiled" and "llama.prefill.aoti" in report.detail, report
    runner = make_runner()  # the built runner's pools were written by other tests: load fresh ones
    assert load(runner, kernel_cache=str(root / "kc"), work_dir=root / "work3").prefill_source == "hit"
    assert runner.prefill_program is not None
    entries = KernelCacheClient(root=root / "kc").list("llama.prefill")
    assert [e.name for e in entries] == ["llama.prefill.aoti"]
    eager = make_runner(compile="off")
    # rows: a whole 7-token prompt, a 1-token prompt, the second chunk of a prompt (its first 9
    # tokens' K/V come from the random-filled pool), and a 1-token last chunk
    cases = [[(7, 0, 7)], [(1, 0, 1)], [(7, 0, 7), (13, 9, 4), (1, 0, 1), (10, 9, 1)]]
    for n, chunks in enumerate(cases):
        batch = prefill_batch(chunks, runner.args.vocab_size, runner.block_size, seed=n)
        got, want = runner.run_prefill(batch), eager.run_prefill(batch)
        assert got.shape == want.shape == (len(chunks), runner.args.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(runner.kv.pools["k"][:, 1:], eager.kv.pools["k"][:, 1:], atol=1e-4, rtol=0)
        torch.testing.assert_close(runner.kv.pools["v"][:, 1:], eager.kv.pools["v"][:, 1:], atol=1e-4, rtol=0)


class _FullDiskCache(KernelCacheClient):
    """An embedded store whose publishes hit a full disk (as a read-only or full directory does)."""

    def publish(self, name, fingerprint, path, *, producer=""):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_the_thread_count_is_in_the_key_and_a_null_rope_scaling_entry_is_not_unknown():
    runner = make_runner()
    threads = torch.get_num_threads()
    base = program_key(runner.program_spec(), "aoti")
    try:
        torch.set_num_threads(threads + 1)
        more_threads = program_key(runner.program_spec(), "aoti")
    finally:
        torch.set_num_threads(threads)
    assert more_threads != base and program_key(runner.program_spec(), "aoti") == base
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    with_null = make_runner()
    with_null.args = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8,
                               max_pos=128, rope_scaling={**scaling, "truncate": None})
    without = make_runner()
    without.args = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8,
                             max_pos=128, rope_scaling=scaling)
    key = program_key(with_null.program_spec(), "aoti")[1]
    assert key != UNKNOWN and key == program_key(without.program_spec(), "aoti")[1] != base[1]


def test_every_module_of_the_programs_package_is_in_the_key():
    import pkgutil

    import runner_service.programs as package

    hashed = {m.__name__ for m in program_sources(make_runner().program_spec())}
    from runner_service.programs.key import NOT_IN_KEY

    own = {f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__) if m.name not in NOT_IN_KEY}
    assert own and own <= hashed and "model_families.llama.model" in hashed
    assert not {f"{package.__name__}.{m}" for m in NOT_IN_KEY} & hashed


def test_environment_variables_inductor_reads_are_in_the_key(monkeypatch):
    runner = make_runner()
    for name in [k for k in os.environ if k.startswith(CODEGEN_ENV_PREFIXES) or k in ("CXX", native.DISABLE_ENV)]:
        monkeypatch.delenv(name)
    base = program_key(runner.program_spec(), "aoti")
    for name, value in (("TORCHINDUCTOR_MAX_AUTOTUNE", "1"), ("TORCHINDUCTOR_CPP_WRAPPER", "1"),
                        ("AOT_INDUCTOR_ENABLE_LTO", "1"), ("TORCHINDUCTOR_FREEZING", "1"), ("CXX", "clang++"),
                        (native.DISABLE_ENV, "0")):
        monkeypatch.setenv(name, value)
        assert program_key(runner.program_spec(), "aoti") != base, name  # changes the code: another program
        monkeypatch.delenv(name)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS", "OMP_PROC_BIND", "HOME"):
        monkeypatch.setenv(name, "/elsewhere" if name.endswith("DIR") or name == "HOME" else "3")
        assert program_key(runner.program_spec(), "aoti") == base, name  # same code: the same key
    assert codegen_environment({"TORCHINDUCTOR_FREEZING": "1", "PATH": "/bin", "CXX": "g++",
                                         "TORCHINDUCTOR_CACHE_DIR": "/x"}) == {"CXX": "g++",
                                                                             "TORCHINDUCTOR_FREEZING": "1"}


def test_whether_the_native_kernels_load_is_in_the_key(monkeypatch):
    """A program that calls warmserve's C++ ops is another program than one that does not, even
    where the environment says nothing (a host where they do not build or load)."""
    runner = make_runner()
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    keys = set()
    for loads in ({"int4_tiles_supported", "decode_attention_supported"}, {"int4_tiles_supported"}, set()):
        monkeypatch.setattr(native, "_supported", lambda op, loads=loads: op in loads)
        keys.add(program_key(runner.program_spec(), "aoti"))
    assert len(keys) == 3


def test_a_failed_publish_is_a_warning_and_the_program_compiled_here_is_used(built, tmp_path):
    compiled: list[str] = []
    runner = make_runner()
    report = load(runner, kernel_cache=_FullDiskCache(root=tmp_path / "kc"), work_dir=tmp_path / "work",
                  compiler=reuse_cold_build(built[0], compiled))
    assert (report.source, report.published, report.prefill_source) == ("compiled", "FAILED", "compiled"), report
    assert compiled == ["decode", "prefill"]
    assert runner.decode_program is not None and runner.prefill_program is not None
    assert_compiled_matches_eager(runner, make_runner(compile="off"), [(2, 2, 3)], atol=1e-4)
    assert KernelCacheClient(root=tmp_path / "kc").list("llama") == []


def test_second_load_in_process_is_a_cache_hit(built):
    root, _, cold = built
    runner = make_runner()
    report = load(runner, kernel_cache=str(root / "kc"), work_dir=root / "work2")
    assert (report.source, report.fingerprint, report.published) == ("hit", cold.fingerprint, "")
    assert report.prefill_source == "hit" and report.detail.count("HIT") == 2, report
    assert_compiled_matches_eager(runner, make_runner(compile="off"), [(2, 2, 4)], atol=1e-4)


WARM_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{tests!r}, {here!r}]
    import torch
    import torch._inductor.cpp_builder as cpp_builder
    torch.set_num_threads({threads})  # as the cold build: the thread count is part of the program key

    calls = []
    def refuse(self, *a, **k):
        calls.append(str(getattr(self, "_name", self)))
        raise RuntimeError("the C++ compiler must not run on a warm launch")
    cpp_builder.CppBuilder.build = refuse

    from test_runner_programs import assert_compiled_matches_eager, load, make_runner
    runner = make_runner()
    report = load(runner, kernel_cache={kc!r}, work_dir={work!r})
    assert_compiled_matches_eager(runner, make_runner(compile="off"), [(4, 3, 6)], atol=1e-4)
    print(json.dumps({{"source": report.source, "fingerprint": report.fingerprint, "builds": calls}}))
""")


def test_warm_launch_in_a_new_process_never_runs_the_cpp_compiler(built, tmp_path):
    root, _, cold = built
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    marker = tmp_path / "compiler-was-called"
    for name in ("g++", "gcc", "c++", "cc", "clang++", "clang"):
        tool = fake_bin / name
        tool.write_text(f"#!/bin/sh\necho \"$0 $@\" >> {marker}\nexit 1\n")
        tool.chmod(0o755)
    # the fake compilers come first on PATH (CXX is not set: it names the compiler, so it is part of
    # the program key, and a warm launch under another CXX would rightly be another program)
    env = dict(os.environ, PATH=f"{fake_bin}:{os.environ['PATH']}",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "empty-inductor-cache"))
    env.pop("CXX", None)
    script = WARM_SCRIPT.format(tests=str(TESTS_DIR), here=str(Path(__file__).resolve().parent), kc=str(root / "kc"), work=str(tmp_path / "work"),
                                threads=int((root / "threads").read_text()))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"source": "hit", "fingerprint": cold.fingerprint, "builds": []}, proc.stderr[-3000:]
    assert not marker.exists(), marker.read_text()


FIRST_STEPS_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{tests!r}, {here!r}]
    import torch
    torch.set_num_threads({threads})
    from test_runner_programs import load, make_runner, prefill_batch
    runner = make_runner()
    report = load(runner, kernel_cache={kc!r}, work_dir={work!r})
    loaded = "torch._dynamo" in sys.modules
    runner.run_prefill(prefill_batch([(7, 0, 7)], runner.args.vocab_size, runner.block_size, seed=1))
    with torch.inference_mode():
        runner.decode(*runner.decode_views(2, 2))
    print(json.dumps({{"source": report.prefill_source, "dynamo_at_load": loaded,
                       "dynamo_after_steps": "torch._dynamo" in sys.modules}}))
""")


def test_a_warm_launchs_first_compiled_steps_import_no_compiler_stack(built, tmp_path):
    """A warm runner's first compiled prefill and decode steps import nothing heavy: the KV
    write op once imported ``torch._dynamo`` on its first call (custom_op's lazy wrapper), which
    cost the first request after a warm launch over a second."""
    root, _, _ = built
    script = FIRST_STEPS_SCRIPT.format(tests=str(TESTS_DIR), here=str(Path(__file__).resolve().parent),
                                       kc=str(root / "kc"), work=str(tmp_path / "work"),
                                       threads=int((root / "threads").read_text()))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "source": "hit", "dynamo_at_load": False, "dynamo_after_steps": False}


def test_fingerprint_changes_with_layout_dtype_arch_and_compile_options(built):
    base = program_key(make_runner().program_spec(), "aoti")
    assert base == program_key(make_runner(seed=9).program_spec(), "aoti")  # weights are not in the key
    # nor the runner's max_num_seqs: the program takes any batch up to MAX_PROGRAM_BATCH
    assert base == program_key(make_runner(max_num_seqs=1).program_spec(), "aoti") \
        == program_key(make_runner(max_num_seqs=8).program_spec(), "aoti")
    inductor = program_key(make_runner().program_spec(), "inductor")  # traced at batch 1 and 2 (buckets 1, 2, 4)
    assert inductor == program_key(make_runner(max_num_seqs=8).program_spec(), "inductor") \
        != program_key(make_runner(max_num_seqs=1).program_spec(), "inductor")  # batch 1 only
    variants = {
        "block_size": program_key(make_runner(block_size=8).program_spec(), "aoti"),
        "max_model_len": program_key(make_runner(max_model_len=96).program_spec(), "aoti"),
        "dtype": program_key(make_runner(dtype=torch.bfloat16).program_spec(), "aoti"),
        "arch": program_key(make_runner(layers=3).program_spec(), "aoti"),
        "mode": program_key(make_runner().program_spec(), "inductor"),
        "int4 weights": program_key(make_runner(weights_dtype="int4").program_spec(), "aoti"),
        "int8 weights": program_key(make_runner(weights_dtype="int8").program_spec(), "aoti"),
        "int4 weights, bf16": program_key(make_runner(weights_dtype="int4", dtype=torch.bfloat16).program_spec(), "aoti"),
    }
    fingerprints = [fp for _, fp in variants.values()]
    assert len({base[1], *fingerprints}) == len(variants) + 1
    assert all(len(fp) == 64 for fp in fingerprints)
    assert variants["mode"][0] == "llama.decode.inductor"
    root = built[0]
    client = KernelCacheClient(root=root / "kc")
    assert client.lookup(*base) is not None
    assert all(client.lookup(*key) is None for key in variants.values())


def test_changed_layout_and_dtype_miss_and_recompile_in_bf16(built, tmp_path):
    root, _, cold = built
    kc = tmp_path / "kc"
    shutil.copytree(root / "kc", kc)
    runner = make_runner(dtype=torch.bfloat16, block_size=8)
    report = load(runner, kernel_cache=str(kc), work_dir=tmp_path / "work")
    assert (report.source, report.published) == ("compiled", "PUBLISHED")
    assert report.fingerprint != cold.fingerprint
    assert len(KernelCacheClient(root=kc).list("llama.decode.aoti")) == 2
    # the programs phase says why it missed: the cold build's entry differs in the dtype and the layout
    assert f"MISS: nearest llama.decode.aoti entry {cold.fingerprint[:12]} differs in " in report.detail, report
    assert 'dtype ("float32" -> "bfloat16")' in report.detail and "layout.block_size (4 -> 8)" in report.detail
    eager = make_runner(dtype=torch.bfloat16, block_size=8, compile="off")
    assert_compiled_matches_eager(runner, eager, [(1, 1, 3), (4, 4, 6)], atol=3e-2)


@pytest.mark.parametrize("weights_dtype,dtype,activations", [
    ("int4", torch.bfloat16, "bf16"), ("int4", torch.bfloat16, "int8"), ("int8", torch.bfloat16, "bf16"),
    ("int4", torch.float32, "bf16")])
def test_aoti_over_quantized_weights_matches_eager_and_reloads(weights_dtype, dtype, activations, tmp_path):
    """Quantized weights export and compile (bf16: warmserve's int4 kernel, with bf16 or int8
    activations, or PyTorch's weight-only kernels; float32: the dequantize-then-matmul graph); the
    package holds no weights, yet what Inductor adds itself (PyTorch's int4 kernel: the group size
    as an int64 constant) travels with it, so a kernel-cache HIT loads and runs too."""
    kc = tmp_path / "kc"

    def runner_of(compile: str = "aoti") -> ModelRunner:
        return make_runner(dtype=dtype, weights_dtype=weights_dtype, compile=compile, activations=activations)

    runner = runner_of()
    assert runner.model.qkv_proj.format == weights_dtype
    # where the CPU lacks AVX512-VNNI, int8 falls back to bf16 activations
    assert runner.int8_activations == (activations == "int8" and native.int8_activations_enabled())
    report = load(runner, kernel_cache=str(kc), work_dir=tmp_path / "work")
    assert (report.source, report.published) == ("compiled", "PUBLISHED"), report
    atol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    eager = runner_of("off")
    assert_compiled_matches_eager(runner, eager, [(1, 1, 3), (4, 3, 6)], atol=atol)
    if (weights_dtype, dtype, activations) == ("int4", torch.bfloat16, "bf16"):
        _assert_int4_rows_pick_the_kernel_at_run_time(runner, eager)
    package = max((p for p in kc.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    own = read_own_constants(package)
    if (weights_dtype, dtype) == ("int4", torch.bfloat16) and not native.int4_tiles_enabled():
        # Inductor's lowering of PyTorch's int4 kernel adds the group size as a tensor constant
        assert own and all(t.dtype == torch.int64 and t.item() == 32 for t in own.values()), own
    elif weights_dtype == "int4":  # warmserve::int4_mm_tiles takes it as an int argument
        assert not own, own
    hit = runner_of()
    again = load(hit, kernel_cache=str(kc), work_dir=tmp_path / "work2")
    assert (again.source, again.fingerprint) == ("hit", report.fingerprint), again
    assert_compiled_matches_eager(hit, runner_of("off"), [(2, 2, 5)], atol=atol)


def _assert_int4_rows_pick_the_kernel_at_run_time(compiled: ModelRunner, eager: ModelRunner) -> None:
    """The compiled prefill calls ``warmserve::int4_tiles_linear`` (``warmserve::int4_linear`` for
    PyTorch's layout) for each int4 matrix, whose kernel picks by the rows of the call (dense from
    a threshold, here ``INT4_DENSE_MIN_ROWS`` for both, which these tiny batches reach) as eager
    steps do, and gives the eager prefill's logits on both sides of the threshold; the compiled
    decode calls the int4 kernel itself (no Python op)."""
    import model_families.custom_ops as ops
    from model_families import native
    from model_families.quantized_weights import INT4_DENSE_MIN_ROWS, int4_matmul, int4_tiles_matmul

    name, matmul = (("int4_tiles_matmul", int4_tiles_matmul) if native.int4_tiles_enabled()
                    else ("int4_matmul", int4_matmul))
    rows: list[int] = []

    def counting(x, *args, **kw):
        rows.append(x.shape[0])
        return matmul(x, *args, dense_from=INT4_DENSE_MIN_ROWS)

    setattr(ops, name, counting)
    try:
        for chunks in ([(7, 0, 7)], [(30, 0, 30), (30, 0, 30), (25, 0, 25), (12, 0, 12)]):
            batch = prefill_batch(chunks, compiled.args.vocab_size, compiled.block_size, seed=len(chunks))
            padded = len(chunks) * max(n for _, _, n in chunks)
            rows.clear()
            got, want = compiled.run_prefill(batch), eager.run_prefill(batch)
            assert rows == [padded] * 4 * compiled.args.num_hidden_layers, rows  # qkv, o, gate_up, down
            assert (padded >= INT4_DENSE_MIN_ROWS) == (len(chunks) == 4)
            torch.testing.assert_close(got, want, atol=3e-2, rtol=0)
        rows.clear()
        with torch.inference_mode():
            compiled.decode(*decode_inputs(compiled, 2, 2, 3, seed=5))
        assert rows == []
    finally:
        setattr(ops, name, matmul)


def _entry_files(kc: Path, fingerprint: str) -> list[Path]:
    return [p for p in kc.rglob("*") if p.is_file() and fingerprint in str(p.parent)]


def test_corrupt_entry_is_quarantined_then_recompiled_and_republished(built, tmp_path):
    root, _, cold = built
    kc = tmp_path / "kc"
    shutil.copytree(root / "kc", kc)
    data = max(_entry_files(kc, cold.fingerprint), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the sha256 no longer matches
    data.write_bytes(bytes(raw))
    compiled: list[str] = []
    runner = make_runner()
    report = load(runner, kernel_cache=str(kc), work_dir=tmp_path / "work", compiler=reuse_cold_build(root, compiled))
    assert (report.source, report.published) == ("compiled", "PUBLISHED"), report
    assert compiled == ["decode"]  # rebuilt; prefill's entry was intact (a HIT)
    reasons = [r.read_text() for r in (kc / "quarantine").glob("*/reason.txt")]
    assert len(reasons) == 1 and cold.fingerprint in reasons[0]
    assert KernelCacheClient(root=kc).lookup("llama.decode.aoti", cold.fingerprint) is not None
    assert_compiled_matches_eager(runner, make_runner(compile="off"), [(2, 1, 4)], atol=1e-4)


def test_entry_that_does_not_load_is_evicted_and_rebuilt(built, tmp_path):
    root, _, cold = built
    kc = tmp_path / "kc"
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"PK\x03\x04 not a real package" * 100)  # intact bytes, but no program inside
    client = KernelCacheClient(root=kc)
    assert client.publish("llama.decode.aoti", cold.fingerprint, junk) == "PUBLISHED"
    compiled: list[str] = []
    runner = make_runner()
    report = load(runner, kernel_cache=client, work_dir=tmp_path / "work", compiler=reuse_cold_build(root, compiled))
    assert (report.source, report.published) == ("compiled", "PUBLISHED"), report
    assert compiled == ["decode", "prefill"]  # the fresh cache held only the junk decode entry
    info = client.lookup("llama.decode.aoti", cold.fingerprint)
    assert info is not None and info.size_bytes > junk.stat().st_size
    assert_compiled_matches_eager(runner, make_runner(compile="off"), [(1, 1, 2)], atol=1e-4)


def test_unknown_fingerprint_compiles_locally_and_publishes_nothing_inductor(tmp_path):
    runner = make_runner(compile="inductor")
    missing = tmp_path / "no-such-source.py"
    assert program_key(runner.program_spec(), "inductor", sources=[missing])[1] == UNKNOWN
    kc = tmp_path / "kc"
    report = load(runner, kernel_cache=str(kc), work_dir=tmp_path / "work", sources=[missing])
    assert (report.mode, report.source, report.fingerprint, report.published) == (
        "inductor", "compiled", UNKNOWN, "")
    assert "UNKNOWN" in report.detail
    assert KernelCacheClient(root=kc).list() == []
    assert_compiled_matches_eager(runner, make_runner(compile="off"), [(1, 1, 3), (4, 2, 5)], atol=1e-4)


def test_off_installs_nothing_and_failures_fall_back_to_eager(tmp_path):
    runner = make_runner(compile="off")
    report = load(runner, kernel_cache=str(tmp_path / "kc"), work_dir=tmp_path / "work")
    assert (report.source, runner.decode_program) == ("eager", None)
    runner = make_runner()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")  # the work dir cannot be created: the runner must still serve
    report = load(runner, kernel_cache=None, work_dir=not_a_dir / "work")
    assert report.source == "eager" and "failed" in report.detail
    assert runner.decode_program is None


def test_kernel_cache_spec_is_a_daemon_address_or_a_store_directory(tmp_path):
    daemon = open_kernel_cache("127.0.0.1:50051")  # no connection is made until a call
    try:
        assert daemon.address == "127.0.0.1:50051"
    finally:
        daemon.close()
    store = open_kernel_cache(str(tmp_path / "kc"))
    assert store.address is None and store.list() == []
    assert (tmp_path / "kc").is_dir()
    assert open_kernel_cache(store) is store
    assert open_kernel_cache(None) is None
