"""Serving eager first while the compiled programs build in the background (in a build child,
``runner_service/programs/build_child.py``), then installing them between two steps
(``EngineConfig.background_compile``), on a tiny random Llama: the loop programs first, then the
unrolled ones (``ProgramSpec.forms``; the tiny model has fewer layers than ``LOOP_MIN_LAYERS``, which
the test lowers), four cold AOTI builds, about two minutes on 2 cores."""

from __future__ import annotations

import time

import pytest
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams

# Builds AOTInductor programs (minutes on 2 cores): not in `make check`.
pytestmark = pytest.mark.slow

ARGS = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=256)
PROMPTS = [[1 + i, 5, 9 + i, 3] for i in range(8)]
#: Tokens per stream: more than the steps stepped while the programs build (STEPS).
TOKENS, STEPS = 200, 150


def _engine(kernel_cache, **kw) -> LLMEngine:
    config = tiny_config(compile="aoti", max_num_seqs=8, max_model_len=256, kv_cache_bytes=kv_bytes(ARGS, 200), **kw)
    return LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=3), config, kernel_cache=str(kernel_cache))


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


def test_eager_first_then_loop_then_unrolled_programs_are_installed_between_steps_mid_decode(tmp_path, monkeypatch):
    from runner_service.programs import spec as spec_module

    monkeypatch.setattr(spec_module, "LOOP_MIN_LAYERS", ARGS.num_hidden_layers)
    eng = _engine(tmp_path / "kc", background_compile=True)
    programs_phase = {p.name: p.detail for p in eng.startup_report.phases}["programs"]
    assert "serving eager" in programs_phase and eng.programs.state == "pending"
    runner = eng.runner
    # 8 streams run eager, stepped from this thread while the build child compiles beside them
    # (the trace, then Inductor and the C++ compiler): a step every 0.5 s, at most STEPS of TOKENS
    # tokens; the loop programs are installed by one of these steps, between two of them
    streams = [eng.add_request(_params(), token_ids=p) for p in PROMPTS]
    seen, steps = [], 0
    while eng.programs.in_flight and steps < STEPS:
        eng.step()
        steps += 1
        if not seen or seen[-1] != eng.programs.layers:
            seen.append(eng.programs.layers)
        time.sleep(0.5)
    eng.programs.join(timeout=900)  # built; what is left to install waits in the inbox for the next step
    assert not eng.programs.in_flight
    assert all(not s.finished for s in streams)
    eng.step()  # installs what is left first, then steps the 8 sequences
    assert seen[0] == "" and "loop" in seen  # eager, then the loop programs, mid-decode
    assert runner.decode_program is not None and runner.prefill_program is not None
    assert (eng.programs.state, eng.programs.layers) == ("installed", "unrolled")
    eng.run_until_done()
    got = [s.result(timeout=0).token_ids for s in streams]
    assert "compiled llama.decode.aoti" in eng.programs.detail and "compiled llama.prefill.aoti" in eng.programs.detail
    # on the report's clock: the loop programs after start-up, the unrolled ones after them
    assert eng.programs.installed_at_s > eng.startup_report.total_seconds + 1.0
    assert eng.programs.unrolled_at_s > eng.programs.installed_at_s
    eng.close()

    # a runner compiled from the start: its unrolled programs now come from the cache (HIT), at start-up
    ref = _engine(tmp_path / "kc", background_compile=True)
    assert "HIT llama.decode.aoti" in {p.name: p.detail for p in ref.startup_report.phases}["programs"]
    assert (ref.programs.state, ref.programs.layers, ref.programs.installed_at_s) == ("installed", "unrolled", None)
    assert ref.programs.thread is None
    want_streams = [ref.add_request(_params(), token_ids=p) for p in PROMPTS]
    ref.run_until_done()
    want = [s.result(timeout=0).token_ids for s in want_streams]
    ref.close()
    assert got == want and all(len(t) == TOKENS for t in got)


def test_with_only_the_loop_programs_cached_they_load_at_start_up_and_the_unrolled_ones_follow(tmp_path,
                                                                                               monkeypatch):
    from runner_service.programs import load
    from runner_service.programs import spec as spec_module

    monkeypatch.setattr(spec_module, "LOOP_MIN_LAYERS", ARGS.num_hidden_layers)
    monkeypatch.setattr(load, "programs_cached", lambda spec, *a, **k: spec.layers == "loop")
    calls = []

    def fake_load(spec, install, **kw):
        calls.append((spec.layers, "defer" in kw))
        return load.ProgramsReport("aoti", 0.1, f"aoti: {spec.layers}", source="hit")

    monkeypatch.setattr(load, "load_programs", fake_load)
    eng = _engine(tmp_path / "kc", background_compile=True)
    assert (eng.programs.state, eng.programs.layers) == ("installed", "loop")
    assert "loop programs installed" in {p.name: p.detail for p in eng.startup_report.phases}["programs"]
    eng.programs.join(timeout=60)
    eng.step()  # the unrolled programs' record is installed between two steps
    assert calls == [("loop", False), ("unrolled", True)]
    assert eng.programs.layers == "unrolled" and eng.programs.unrolled_at_s is not None
    eng.close()


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
