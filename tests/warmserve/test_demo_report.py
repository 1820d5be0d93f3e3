"""What the demo reports of a launch (issue 24 item 5), from made-up ``ModelInfo`` answers and
token arrival times: seconds from the process's start to serving at compiled speed, the
longest gap between tokens, the first request against the steady per-token time."""

from __future__ import annotations

import pytest

from services.generation_client import GenerationResult
from services.proto import generation_pb2
from warmserve.demo import (
    LaunchFigures,
    compiled_since_start,
    first_vs_steady,
    launch_comparison,
    unrolled_since_start,
)


def _info(state: str, total_s: float, installed_at_s: float = 0.0, layers: str = "", unrolled_at_s: float = 0.0):
    return generation_pb2.ModelInfoResponse(
        program_state=state, programs_installed_at_s=installed_at_s, program_layers=layers,
        programs_unrolled_at_s=unrolled_at_s,
        startup=generation_pb2.StartupReport(total_seconds=total_s, phases=[
            generation_pb2.StartupPhase(name="weights", seconds=total_s)]))


def test_compiled_speed_is_serving_for_a_hit_and_the_install_on_the_process_clock_for_a_background_build():
    # a kernel-cache HIT: the programs ran, warmed up, from SERVING on
    assert compiled_since_start(_info("installed", 1.1), ready_s=3.4) == 3.4
    # built in the background: installed 171.7 s after the report's clock began, which began
    # 3.4 - 1.1 = 2.3 s after the process started
    assert compiled_since_start(_info("installed", 1.1, 171.7), ready_s=3.4) == pytest.approx(174.0)
    for state in ("off", "eager", "pending"):
        assert compiled_since_start(_info(state, 1.1, 9.0), ready_s=3.4) is None
    assert compiled_since_start(_info("installed", 1.1), ready_s=None) is None


def test_unrolled_programs_are_timed_on_the_same_clock_whichever_way_they_came():
    # loop programs at 60.0 s on the report's clock, unrolled ones at 290.0 s: 2.3 s later on the process's
    assert unrolled_since_start(_info("installed", 1.1, 60.0, "unrolled", 290.0), ready_s=3.4) == pytest.approx(292.3)
    assert unrolled_since_start(_info("installed", 1.1, 0.0, "unrolled"), ready_s=3.4) == 3.4  # loaded at start-up
    assert unrolled_since_start(_info("installed", 1.1, 120.0, "unrolled"), ready_s=3.4) == pytest.approx(122.3)
    assert unrolled_since_start(_info("installed", 1.1, 60.0, "loop"), ready_s=3.4) is None  # still building
    assert unrolled_since_start(_info("eager", 1.1, 0.0, "unrolled"), ready_s=3.4) is None


def test_stream_gaps_and_per_token_time_come_from_the_arrival_times():
    r = GenerationResult(token_times_s=[0.5, 0.6, 2.1, 2.2], token_counts=[1, 1, 2, 1],
                         seconds=2.3, completion_tokens=5, first_token_s=0.5)
    assert r.max_gap_s == pytest.approx(1.5)  # 0.6 -> 2.1
    assert r.per_token_s == pytest.approx((2.2 - 0.5) / 4)  # 4 tokens after the first message
    assert GenerationResult(token_times_s=[0.3], token_counts=[1]).max_gap_s == 0.0
    assert GenerationResult(token_times_s=[0.3], token_counts=[1]).per_token_s is None


def test_the_summary_compares_time_to_compiled_speed_and_the_first_request_to_the_steady_ones():
    lines = launch_comparison("cold", LaunchFigures(10.12, 174.0, 1.6, 292.3), LaunchFigures(3.9, 3.4, None, 3.4))
    assert lines[0] == "cold launch -> warm launch, seconds from the runner process's start:"
    assert lines[1].split() == ["first", "token", "10.12", "s", "->", "3.90", "s"]
    assert lines[2].split() == ["serving", "at", "compiled", "speed", "174.00", "s", "->", "3.40", "s", "(51.2x)"]
    assert lines[3].split() == ["unrolled", "programs", "installed", "292.30", "s", "->", "3.40", "s"]
    assert lines[4].split() == ["longest", "gap", "while", "compiling", "1.60", "s", "->", "no", "compile"]
    never = launch_comparison("cold", LaunchFigures(None, None, None), LaunchFigures(1.0, None, None))
    assert "never -> never" in " ".join(never[2].split()) and "(" not in never[2]

    def result(seconds, tokens, first):
        return GenerationResult(seconds=seconds, completion_tokens=tokens, first_token_s=first)

    # 0.4 s / 32 tokens = 12.5 ms/token; steady median of 10.0, 10.5, 30.0 ms/token is 10.5
    line = first_vs_steady(result(0.4, 32, 0.05), [result(0.32, 32, 0.03), result(0.336, 32, 0.03),
                                                    result(0.96, 32, 0.03)])
    assert line == ("first request after the warm launch 12.5 ms/token (first token 0.050 s), "
                    "steady 10.5 ms/token (1.19x)")
