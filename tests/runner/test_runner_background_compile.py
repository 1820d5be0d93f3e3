"""Serving eager first while the compiled programs build in the background (in a build child,
``runner_service/programs/build_child.py``), then installing them between two steps
(``EngineConfig.background_compile``), on a tiny random Llama (one cold AOTI build of decode and
prefill, ~40 s on 2 cores)."""

from __future__ import annotations

import time

import pytest
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams

# Builds AOTInductor programs (minutes on 2 cores): not in `make check`.
pytestmark = pytest.mark.slow

ARGS = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=128)
PROMPTS = [[1 + i, 5, 9 + i, 3] for i in range(8)]


def _engine(kernel_cache, **kw) -> LLMEngine:
    config = tiny_config(compile="aoti", max_num_seqs=8, max_model_len=128, kv_cache_bytes=kv_bytes(ARGS, 200), **kw)
    return LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=3), config, kernel_cache=str(kernel_cache))


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def test_eager_first_then_the_programs_are_installed_between_steps_mid_decode(tmp_path):
    eng = _engine(tmp_path / "kc", background_compile=True)
    programs_phase = {p.name: p.detail for p in eng.startup_report.phases}["programs"]
    assert "serving eager" in programs_phase and eng.programs.state == "pending"
    runner = eng.runner
    # 8 streams run eager, stepped from this thread while the build child compiles beside them
    # (the trace, then Inductor and the C++ compiler): a step every 0.3 s, at most 40 of 60 tokens
    # (the decode program, built first, may be installed by one of these steps: the swap then
    # happens with the 8 sequences mid-decode too)
    streams = [eng.add_request(_params(), token_ids=p) for p in PROMPTS]
    steps = 0
    while eng.programs.in_flight and steps < 40:
        eng.step()
        steps += 1
        time.sleep(0.3)
    assert runner.prefill_program is None
    eng.programs.join(timeout=600)  # built; what is left to install waits in the inbox for the next step
    assert not eng.programs.in_flight and eng.programs.pending
    assert runner.prefill_program is None  # nothing changed under the running sequences
    assert all(not s.finished for s in streams)
    eng.step()  # installs first, then steps the 8 sequences with the compiled decode program
    assert runner.decode_program is not None and runner.prefill_program is not None
    assert not eng.programs.pending
    eng.run_until_done()
    got = [s.result(timeout=0).token_ids for s in streams]
    assert eng.programs.state == "installed"
    assert "compiled llama.decode.aoti" in eng.programs.detail and "compiled llama.prefill.aoti" in eng.programs.detail
    # installed after start-up, on the report's clock (the compile took seconds)
    assert eng.programs.installed_at_s > eng.startup_report.total_seconds + 1.0
    eng.close()

    # a runner compiled from the start (its programs now come from the cache: HIT)
    ref = _engine(tmp_path / "kc")
    assert "HIT llama.decode.aoti" in {p.name: p.detail for p in ref.startup_report.phases}["programs"]
    assert (ref.programs.state, ref.programs.installed_at_s) == ("installed", None)
    want_streams = [ref.add_request(_params(), token_ids=p) for p in PROMPTS]
    ref.run_until_done()
    want = [s.result(timeout=0).token_ids for s in want_streams]
    ref.close()
    assert got == want and all(len(t) == 60 for t in got)


def test_programs_already_in_the_cache_load_in_the_foreground(tmp_path, monkeypatch):
    from runner_service.programs import load

    monkeypatch.setattr(load, "programs_cached", lambda *a, **k: True)
    calls = []
    loaded = load.ProgramsReport("aoti", 0.1, "aoti: loaded", source="hit")
    monkeypatch.setattr(load, "load_programs", lambda *a, **k: calls.append(k) or loaded)
    eng = _engine(tmp_path / "kc", background_compile=True)
    assert eng.programs.thread is None and calls and "defer" not in calls[0]
    assert {p.name: p.detail for p in eng.startup_report.phases}["programs"] == "aoti: loaded"
    eng.close()
