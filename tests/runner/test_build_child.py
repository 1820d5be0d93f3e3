"""The background build in a child process (runner_service/programs/build_child.py,
runner_service/program_installer.py) on a tiny random Llama, without a real compile: a child that
is SIGKILLed mid-build, one asked to compile for another key, and the child's
spec against the runner's. The build that completes and is installed between two steps is
tests/runner/test_runner_background_compile.py (slow)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch
from runner_tiny import kv_bytes, tiny_args, tiny_config

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.leases import OWNER
from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.kv_cache import KVCache
from runner_service.model_runner import ModelRunner
from runner_service.program_installer import BUILD_NICE, available_cpus, build_share
from runner_service.programs.build_child import BuildChild, ChildSetup
from runner_service.programs.key import program_key
from runner_service.sampling_params import SamplingParams
from services.errors import Cancelled, Internal

ARGS = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=128)
PROMPTS = [[1 + i, 5, 9 + i, 3] for i in range(4)]


def _engine(kernel_cache, **kw) -> LLMEngine:
    config = tiny_config(max_num_seqs=4, max_model_len=128, kv_cache_bytes=kv_bytes(ARGS, 100), **kw)
    return LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=3), config, kernel_cache=kernel_cache)


def _generate(eng: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    streams = [eng.add_request(params, token_ids=p) for p in PROMPTS]
    eng.run_until_done()
    return [s.result(timeout=0).token_ids for s in streams]


def _wait_for(what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return got


@pytest.mark.parametrize(("threads", "cpus", "share", "want"), [
    (2, 2, "cede", (1, 0, 1)),    # the engine's threads fill the cores: one is ceded to the build
    (4, 2, "cede", (3, 0, 1)),
    (2, 16, "cede", (2, 0, 14)),  # cores to spare: nothing ceded, the child gets the rest
    (1, 1, "cede", (1, 0, 1)),    # nothing to cede: the one CPU is shared at a fair share
    (2, 2, "nice", (2, BUILD_NICE, 0)),
    (2, 2, "fair", (2, 0, 0)),
])
def test_build_share(threads, cpus, share, want):
    assert build_share(threads, cpus, share) == want


def test_a_bad_build_share_is_refused():
    with pytest.raises(ValueError, match="build share must be one of"):
        build_share(2, 2, "greedy")


def test_a_sigkilled_build_child_leaves_the_runner_serving_eager_and_saying_why(tmp_path):
    want = _generate(_engine(None))  # the eager reference: same weights, nothing compiled
    kc = tmp_path / "kc"
    eng = _engine(str(kc), compile="aoti", background_compile=True)
    threads = torch.get_num_threads()  # this thread steps the engine: the serving count
    assert eng.programs.state == "pending"
    pid = _wait_for(lambda: eng.programs.child is not None and eng.programs.child.pid)
    assert "in a build child (nice +0, on " in eng.programs.detail
    eng.step()  # runs what the build handed over: ceding a thread when the engine's fill every core
    fills_every_core = threads >= 2 and threads >= len(available_cpus())
    assert torch.get_num_threads() == (threads - 1 if fills_every_core else threads)
    assert eng.runner.program_spec().threads == threads  # the key still names the serving count
    os.kill(pid, signal.SIGKILL)  # mid-build: it was importing, tracing or compiling
    eng.programs.join(timeout=60)
    assert not eng.programs.in_flight
    got = _generate(eng)  # the steps also run the hand-overs: threads restored, the outcome recorded
    assert got == want and all(len(t) == 12 for t in got)
    assert eng.runner.decode_program is None and eng.runner.prefill_program is None
    assert eng.programs.state == "eager"
    assert f"the build child (pid {pid}) was killed by SIGKILL while compiling llama.decode.aoti" in eng.programs.detail
    assert torch.get_num_threads() == threads
    # the lease was released: another runner becomes the builder at once (no WAIT, no takeover)
    name, fp = program_key(eng.runner.program_spec(), "aoti")
    with KernelCacheClient(root=str(kc)).claim(name, fp, holder="runner-9") as handle:
        assert handle.status == OWNER and not handle.claim.takeover
    eng.close()


def test_a_build_stopped_by_close_logs_one_info_line_and_installs_nothing(tmp_path, caplog):
    """SIGTERM mid-build (the engine closes): the killed child's compile is ``Cancelled``, not an
    ERROR with a traceback; one INFO line says so and nothing is installed or recorded after."""
    caplog.set_level("INFO", logger="runner_service")
    eng = _engine(str(tmp_path / "kc"), compile="aoti", background_compile=True)
    _wait_for(lambda: eng.programs.child is not None and eng.programs.child.pid)
    eng.close()
    assert not eng.programs.in_flight
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    cancelled = [r for r in caplog.records if r.getMessage() == "program build cancelled: shutting down"]
    assert [r.levelname for r in cancelled] == ["INFO"]
    assert not any("installed" in r.getMessage() or "failed" in r.getMessage() for r in caplog.records
                   if r.created >= cancelled[0].created)
    assert eng.runner.decode_program is None and eng.programs.state == "pending"


def test_what_a_cancelled_build_handed_over_is_not_installed_once_close_began(tmp_path, monkeypatch):
    """A program that loaded before the cancel waits in the engine's inbox: close drains it, and
    the installer's guard runs none of it (nor the record of the cancelled form)."""
    import threading

    from runner_service.programs import load

    monkeypatch.setattr(load, "programs_cached", lambda *a, **k: False)
    handed, ran, release = threading.Event(), [], threading.Event()

    def cancelled_load(spec, install, *, defer, **kw):
        defer(lambda: ran.append("decode"))  # fetched: its install is handed to the stepping thread
        handed.set()
        release.wait(30)
        raise Cancelled("the build child was stopped (the runner is shutting down)")

    monkeypatch.setattr(load, "load_programs", cancelled_load)
    eng = _engine(str(tmp_path / "kc"), compile="aoti", background_compile=True)
    assert handed.wait(30)
    closer = threading.Thread(target=eng.close)
    closer.start()
    _wait_for(lambda: eng.programs._closed)
    release.set()
    closer.join(60)
    assert ran == [] and not eng.programs.in_flight and eng.programs.state == "pending"


def _runner() -> ModelRunner:
    config = tiny_config(max_num_seqs=4, max_model_len=64, compile="aoti", device="cpu")
    kv = KVCache(LLAMA.cache_specs(ARGS, 4), 16, 4, torch.float32, torch.device("cpu"))
    return ModelRunner(ARGS, LLAMA.random_weights(ARGS, seed=3), kv, config, 64, torch.device("cpu"))


def test_the_child_refuses_to_compile_for_another_thread_count(tmp_path):
    runner = _runner()
    spec = runner.program_spec()
    setup = ChildSetup.of(runner, spec, sidecar=None, weights_dtype="f32", nice=0)
    child = BuildChild(dataclasses.replace(setup, threads=spec.threads + 1))  # the thread count is in the key
    why = r"ValueError: the child's key of llama.decode.aoti \(\w+\) differs from the runner's"
    try:
        with pytest.raises(Internal, match=r"the build child \(pid \d+\) failed to compile llama.decode.aoti: " + why):
            child.compile(spec, "decode", tmp_path / "program.pt2")
    finally:
        child.close()
    assert not (tmp_path / "program.pt2").exists()


def test_a_compile_past_the_timeout_is_killed_and_says_so(tmp_path):
    """A child that has not answered within ``timeout_s`` (here 1 s: importing torch alone takes
    longer) is killed; the compile raises, the lease holder can fail over, nothing is written."""
    runner = _runner()
    spec = runner.program_spec()
    child = BuildChild(ChildSetup.of(runner, spec, sidecar=None, weights_dtype="f32", nice=0), timeout_s=1.0)
    try:
        with pytest.raises(Internal, match=r"the build child \(pid \d+\) took longer than 1 s to compile "
                                           r"llama.decode.aoti: killed"):
            child.compile(spec, "decode", tmp_path / "program.pt2")
        assert child._proc.poll() is not None  # dead, not left compiling
    finally:
        child.close()
    assert not (tmp_path / "program.pt2").exists()


@pytest.mark.parametrize("weights_dtype", ["f32", "int8"])
def test_the_child_spec_from_the_sidecar_or_random_weights_has_the_runners_key(tmp_path, weights_dtype):
    from weights_tiny import write_tiny_checkpoint

    from runner_service.programs.build_child import child_spec
    from weight_service.prepare import prepare

    write_tiny_checkpoint(tmp_path / "ckpt", vocab=96, tokenizer=True)
    sidecar = prepare(str(tmp_path / "ckpt"), dtype=weights_dtype, root=tmp_path / "sidecars").path
    eng = LLMEngine.from_sidecar(sidecar, tiny_config(max_num_seqs=4, max_model_len=64))  # the keys are asked for aoti
    try:
        spec = eng.runner.program_spec()
        for source in (sidecar, None):  # mapped as the runner did, or same-shape random weights
            setup = ChildSetup.of(eng.runner, spec, sidecar=source, weights_dtype=eng.programs.weights_dtype, nice=0)
            twin = child_spec(setup)
            assert twin.decode_module is not spec.decode_module
            for kind in ("decode", "prefill"):
                assert program_key(twin, "aoti", kind=kind) == program_key(spec, "aoti", kind=kind), (source, kind)
    finally:
        eng.close()
