"""``warmserve demo`` (``make run``): the main job, end to end on the bundled SmolLM2.

1. start the stack (kernel-cache, weights, router, runner-0) in the persistent home
   (``--home``, default ``$WARMSERVE_HOME``, i.e. ``~/.cache/warmserve``): the first run is the
   *cold* launch (runner-0 builds the weight sidecar, serves eager at once and compiles its
   programs in the background, publishing them to the home's kernel cache); every later run
   finds both there and says ``warm: programs from the kernel cache, sidecar HOT``. ``--fresh``
   uses a new temporary home, removed at the end: a deliberately cold run;
2. stream the answer to a chat prompt through the router (eager, beside the compile), wait for
   runner-0's compiled programs to take over, then stream two more (compiled);
3. launch one more runner: the *warm* launch finds the sidecar and the programs ready; stream
   chat answers straight from it: the first request after its launch, then steady ones;
4. print both start-up reports side by side and what each launch cost a user
   (:class:`LaunchFigures`: process start -> first token, -> serving at compiled speed, the
   longest gap between tokens of a stream served while a compile ran) and the warm runner's
   first request against its steady per-token time; send a burst of concurrent requests through
   the router to show them spread over the runners, print the router's runner table;
5. stop everything and exit 0.

Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from services.errors import InvalidArgument
from services.generation_client import GenerationClient, GenerationResult, chat_request, sampling_params
from services.proto import generation_pb2
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig, split_threads
from warmserve.stack_report import format_startup_report, print_status, programs_took_over

DEMO_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give me three short tips for writing clear code.",
)

BURST_PROMPTS = (
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What is the opposite of hot?",
    "Name a planet in the solar system.",
    "What do bees make?",
)


#: Chat prompts sent straight to the warm runner after its launch: the first request, then the steady ones.
WARM_PROMPTS = (
    "Name three colors of the rainbow.",
    "What is the capital of Italy? Answer in one sentence.",
    "Write one sentence about the moon.",
)


@dataclass(frozen=True)
class LaunchFigures:
    """What one runner launch cost a user, in seconds from the runner process's start:
    ``first_token_s`` to the first token of the first answer it streamed; ``compiled_s`` to
    serving at compiled speed (:func:`compiled_since_start`; ``None`` when it never did: compile
    off, or the programs failed); ``max_gap_compiling_s`` the longest gap between two tokens of a
    stream served while its programs were pending (``None`` when none was); ``unrolled_s`` to
    the unrolled programs installed (:func:`unrolled_since_start`; ``None`` when they never were)."""

    first_token_s: float | None
    compiled_s: float | None
    max_gap_compiling_s: float | None
    unrolled_s: float | None = None


def compiled_since_start(info, ready_s: float | None) -> float | None:
    """Seconds from a runner process's start to its compiled programs installed, from its
    ``ModelInfoResponse`` and ``ready_s`` (process start -> health SERVING, as its launcher saw
    it). Programs loaded at start-up (a kernel-cache HIT) run, warmed up, from SERVING: ``ready_s``.
    Programs built in the background took over ``programs_installed_at_s`` after the start-up
    report's clock began, which is ``ready_s - startup.total_seconds`` after the process started
    (imports, the server's start). ``None`` when the programs are not installed (or ``ready_s``
    is unknown)."""
    if info.program_state != "installed" or ready_s is None:
        return None
    if not info.programs_installed_at_s:
        return ready_s
    return ready_s - info.startup.total_seconds + info.programs_installed_at_s


def unrolled_since_start(info, ready_s: float | None) -> float | None:
    """Seconds from a runner process's start to its unrolled programs installed (the form it
    keeps; see :func:`compiled_since_start` for the clocks): loaded at start-up, ``ready_s``;
    installed after loop programs, ``programs_unrolled_at_s`` on the report's clock; built first,
    when the programs took over. ``None`` when the running programs are not the unrolled ones."""
    if info.program_layers != "unrolled" or (compiled := compiled_since_start(info, ready_s)) is None:
        return None
    if not info.programs_unrolled_at_s:
        return compiled
    return ready_s - info.startup.total_seconds + info.programs_unrolled_at_s


def _fmt_s(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.2f} s"


def launch_comparison(first_kind: str, first: LaunchFigures, warm: LaunchFigures) -> list[str]:
    """The demo's summary of two launches (``first_kind`` ``cold`` or ``warm``): one line per
    figure of :class:`LaunchFigures`, ``first -> warm``, with the ratio of the time to
    compiled-speed serving."""
    ratio = (f" ({first.compiled_s / warm.compiled_s:.1f}x)"
             if first.compiled_s and warm.compiled_s else "")
    return [f"{first_kind} launch -> warm launch, seconds from the runner process's start:",
            f"  first token                     {_fmt_s(first.first_token_s, 'none'):>10} -> "
            f"{_fmt_s(warm.first_token_s, 'none')}",
            f"  serving at compiled speed       {_fmt_s(first.compiled_s, 'never'):>10} -> "
            f"{_fmt_s(warm.compiled_s, 'never')}{ratio}",
            f"  unrolled programs installed     {_fmt_s(first.unrolled_s, 'never'):>10} -> "
            f"{_fmt_s(warm.unrolled_s, 'never')}",
            f"  longest gap while compiling     {_fmt_s(first.max_gap_compiling_s, 'no compile'):>10} -> "
            f"{_fmt_s(warm.max_gap_compiling_s, 'no compile')}"]


def first_vs_steady(first: GenerationResult, steady: list[GenerationResult]) -> str:
    """``first request after the warm launch 9.4 ms/token, steady 8.3 ms/token (1.13x)``: each
    request's seconds per token (call to last token, over its tokens), the steady figure the
    median of ``steady``."""
    def per_token(r: GenerationResult) -> float:
        return r.seconds / max(1, r.completion_tokens)

    rates = sorted(per_token(r) for r in steady)
    mid = rates[len(rates) // 2] if rates else 0.0
    ratio = f" ({per_token(first) / mid:.2f}x)" if mid else ""
    return (f"first request after the warm launch {per_token(first) * 1000:.1f} ms/token "
            f"(first token {first.first_token_s or 0:.3f} s), steady {mid * 1000:.1f} ms/token{ratio}")


def _say(out: TextIO, text: str = "") -> None:
    out.write(text + "\n")
    out.flush()


def _phase_seconds(info) -> dict[str, float]:
    return {p.name: p.seconds for p in info.startup.phases}


def _wait_for_programs(stack: LocalStack, out: TextIO):
    """Wait for runner-0's compiled programs, say when they took over; its ``ModelInfoResponse``."""
    if stack.startup_report(0).program_state == "pending":
        print("waiting for runner-0's compiled programs (it serves eager meanwhile) ...", file=sys.stderr,
              flush=True)
    cold = stack.wait_programs(0)
    if cold.programs_installed_at_s:
        _say(out)
        _say(out, f"runner-0: {programs_took_over(cold)}")
    return cold


#: The most tokens per answer ``demo --max-tokens`` takes (its prompts are short; the context is far larger).
MAX_DEMO_TOKENS = 1024


def launch_kind(info, *, kept: bool = True) -> str:
    """Whether a runner's launch (its ``ModelInfoResponse``) was warm: ``warm: programs from the
    kernel cache, sidecar HOT`` when its compiled programs were installed at start-up (only a
    kernel-cache hit is; a miss serves eager and compiles in the background) and its sidecar
    already existed; otherwise ``cold: ...`` naming what had to be built, and whether it is kept
    for the next run (``kept``) or goes with a temporary home."""
    phases = {p.name: p.detail for p in info.startup.phases}
    sidecar = phases.get("sidecar", "").split(" ")
    sidecar_state = sidecar[1] if len(sidecar) > 1 else "?"
    built = sidecar_state in ("BUILT", "REBUILT")
    programs_warm = info.program_state == "installed" and not info.programs_installed_at_s
    if programs_warm and not built:
        return f"warm: programs from the kernel cache, sidecar {sidecar_state}"
    cold = [*(["the sidecar was packed"] if built else []),
            *([] if programs_warm or info.program_state == "off" else ["the programs are compiled"])]
    where = "kept for the next run" if kept else "in a temporary home, removed at the end"
    return "cold: " + (" and ".join(cold) or "nothing was cached") + f" ({where})"


def demo_config(config: StackConfig) -> StackConfig:
    """The stack the demo launches for ``config`` (its ``demo`` flags): no ``stack.json`` (its
    stack is gone when it ends, and must not replace that of an `up` in the same home), at least
    one runner, and the cores split between those and the warm launch's runner
    (:func:`~warmserve.stack_config.split_threads` of one more), or two runners' OpenMP threads
    oversubscribe the CPU and stall decode."""
    runners = max(1, config.runners)
    return replace(config, record_state=False, runners=runners,
                   runner_threads=config.runner_threads or split_threads(runners + 1))


def run_demo(config: StackConfig, *, out: TextIO = sys.stdout, max_tokens: int = 64, fresh: bool = False) -> int:
    """Run the demo (see the module docstring); returns the exit code. ``fresh``: in a new
    temporary home (removed at the end) instead of ``config.home`` / ``$WARMSERVE_HOME``.
    ``InvalidArgument`` before anything starts for ``max_tokens`` outside [1, MAX_DEMO_TOKENS]."""
    if not 1 <= max_tokens <= MAX_DEMO_TOKENS:
        raise InvalidArgument(f"--max-tokens must be in [1, {MAX_DEMO_TOKENS}], got {max_tokens}")
    tmp_home = None
    if fresh:
        tmp_home = Path(tempfile.mkdtemp(prefix="warmserve-demo-"))
        config = replace(config, home=tmp_home)
    config = demo_config(config)
    sampling = sampling_params(max_tokens=max_tokens, temperature=0.0)
    try:
        with LocalStack(config) as stack:
            first = len(stack.runners) - 1
            cold = stack.startup_report(0)
            first_kind = launch_kind(cold, kept=tmp_home is None)
            _say(out)
            _say(out, f"home {stack.home}: {first_kind}" + (
                "; `warmserve demo --fresh` makes a cold run" if first_kind.startswith("warm") else ""))
            _say(out)
            _say(out, format_startup_report(cold, f"== first launch ({first_kind.split(':')[0]}): runner-0 "
                                                  "start-up report"))

            _say(out)
            _say(out, f"== chat through the router at {stack.router_address} (greedy, {max_tokens} tokens max)")
            started0, ready0 = stack.runners[0].started_at, stack.runners[0].ready_s
            first_token0 = gap0 = None
            with GenerationClient(stack.router_address, security=stack.credentials()) as client:
                for n, prompt in enumerate(DEMO_PROMPTS):
                    if n == 1:  # the first answer came eager, beside the compile; the rest compiled
                        cold = _wait_for_programs(stack, out)
                    _say(out)
                    _say(out, f"user: {prompt}")
                    out.write("assistant: ")
                    compiling = n == 0 and cold.program_state == "pending"
                    sent = time.monotonic()
                    result = client.stream_to(chat_request([("user", prompt)], sampling), out, timeout_s=300)
                    if n == 0 and result.first_token_s is not None:
                        first_token0 = sent + result.first_token_s - started0
                    if compiling:
                        gap0 = result.max_gap_s
                    _say(out)
                    _say(out, f"  ({result.summary()})")
            compiled0 = compiled_since_start(cold, ready0)

            if cold.programs_building:  # the unrolled programs: the warm launch (and the next run) loads them
                print("waiting for runner-0's unrolled programs (it serves its loop programs meanwhile) ...",
                      file=sys.stderr, flush=True)
                cold = stack.wait_programs(0, final=True)
                if cold.programs_unrolled_at_s:
                    _say(out)
                    _say(out, f"runner-0: {programs_took_over(cold)}")
            first_figures = LaunchFigures(first_token0, compiled0, gap0, unrolled_since_start(cold, ready0))
            print(f"launching runner-{first + 1}: the warm launch ...", file=sys.stderr, flush=True)
            warm_child = stack.add_runner()
            warm_index = int(warm_child.name.removeprefix("runner-"))
            # the same number of tokens each (EOS ignored), so their per-token times compare
            measured = generation_pb2.SamplingParams(max_tokens=min(32, max_tokens), temperature=0.0, ignore_eos=True)
            with GenerationClient(warm_child.address, security=stack.credentials()) as client:
                sent = time.monotonic()
                warm_results = [client.complete(chat_request([("user", p)], measured), timeout_s=300)
                                for p in WARM_PROMPTS]
            warm = stack.startup_report(warm_index)
            _say(out)
            _say(out, format_startup_report(warm, f"== warm launch: {warm_child.name} start-up report"))
            _say(out)
            warm_first = warm_results[0].first_token_s
            warm_figures = LaunchFigures(None if warm_first is None else sent + warm_first - warm_child.started_at,
                                         compiled_since_start(warm, warm_child.ready_s), None,
                                         unrolled_since_start(warm, warm_child.ready_s))
            kind = first_kind.split(":")[0]
            for line in launch_comparison(kind, first_figures, warm_figures):
                _say(out, line)
            _say(out, first_vs_steady(warm_results[0], warm_results[1:]))
            _say(out, f"start-up reports (to serving, eager or compiled) {cold.startup.total_seconds:.2f} s -> "
                      f"{warm.startup.total_seconds:.2f} s:")
            cold_p, warm_p = _phase_seconds(cold), _phase_seconds(warm)
            for name in cold_p:
                if name in warm_p:
                    _say(out, f"  {name:<10} {cold_p[name]:7.2f} s -> {warm_p[name]:7.2f} s")

            _say(out)
            _say(out, f"== {len(BURST_PROMPTS)} concurrent requests through the router")
            with GenerationClient(stack.router_address, security=stack.credentials()) as client, ThreadPoolExecutor(len(BURST_PROMPTS)) as pool:
                start = time.perf_counter()
                burst = sampling_params(max_tokens=min(24, max_tokens), temperature=0.0)
                results = list(pool.map(lambda p: client.complete(
                    chat_request([("user", p)], burst), timeout_s=300), BURST_PROMPTS))
                elapsed = time.perf_counter() - start
            for prompt, r in zip(BURST_PROMPTS, results, strict=True):
                answer = " ".join(r.text.split())
                _say(out, f"  [{r.runner_id}] {prompt} -> {answer[:70]}")
            _say(out, f"  {len(results)} requests in {elapsed:.2f} s, served by "
                      f"{', '.join(sorted({r.runner_id for r in results}))}")

            _say(out)
            _say(out, "== router status")
            print_status(stack.router_address, {}, out=out, security=stack.credentials())
            print("stopping the stack ...", file=sys.stderr, flush=True)
        _say(out)
        _say(out, "demo finished")
        return 0
    finally:
        if tmp_home is not None:
            shutil.rmtree(tmp_home, ignore_errors=True)
