"""Router overhead: latency the router adds to each streamed token, against a direct runner.

Method (one run, one machine):

1. *Real runner* (SmolLM2 on the local stack, ``--compile off``): in each round the same greedy
   request (``ignore_eos``, fixed length) is sent twice *at the same moment*, once directly to the
   runner and once through the router. The runner batches both, so each decode step emits a
   token of both streams at one instant; the router's added latency for a token is its arrival
   time through the router minus the arrival time of the token of the same decode step on the
   direct stream (streams are aligned by the step offset ``s`` in [-3, 3] that minimises the
   median gap, in case the two prefills landed in different steps). Comparing two *direct*
   streams the same way (A/A) gives the noise floor of the method (thread scheduling in the
   runner and the client). Paired this way, decode-time jitter cancels out: only delivery differs.
2. *Instant runner* (an in-process Generation server that streams ``N`` tokens without any
   compute, so only gRPC and the relay cost time): per-token cost is the stream's wall time
   divided by its tokens, routed minus direct, and the time to first token.

Prints a JSON object and a Markdown table; never asserts on timings.

    python bench/router.py [--tokens 32] [--rounds 12] [--home DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from services.channel import open_channel
from services.proto import generation_pb2, generation_pb2_grpc

PROMPT = "The history of the printing press begins"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def _arrivals(stub, request, timeout_s: float = 300.0, t0: float | None = None) -> list[float]:
    """Arrival time of each token (one entry per token id), in seconds since ``t0`` (default:
    the start of the call)."""
    start = time.perf_counter() if t0 is None else t0
    out: list[float] = []
    for resp in stub.Generate(request, timeout=timeout_s):
        now = time.perf_counter() - start
        out.extend([now] * len(resp.token_ids))
    return out


def _together(stub_a, stub_b, request) -> tuple[list[float], list[float]]:
    """Send ``request`` on both stubs at the same instant; arrival times on one clock."""
    barrier = threading.Barrier(2)
    t0 = [0.0]
    out: dict[str, list[float]] = {}

    def run(key: str, stub) -> None:
        if barrier.wait() == 0:
            t0[0] = time.perf_counter()
        out[key] = _arrivals(stub, request, t0=t0[0] or time.perf_counter())

    threads = [threading.Thread(target=run, args=("a", stub_a)), threading.Thread(target=run, args=("b", stub_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["a"], out["b"]


def _aligned_gaps(a: list[float], b: list[float], max_shift: int = 3) -> tuple[int, list[float]]:
    """``b[i + s] - a[i]`` (ms) for the step offset ``s`` minimising the median absolute gap."""
    best: tuple[float, int, list[float]] | None = None
    for s in range(-max_shift, max_shift + 1):
        gaps = [(b[i + s] - a[i]) * 1e3 for i in range(len(a)) if 0 <= i + s < len(b)]
        if len(gaps) < len(a) // 2:
            continue
        score = statistics.median(abs(g) for g in gaps)
        if best is None or score < best[0]:
            best = (score, s, gaps)
    assert best is not None
    return best[1], best[2]


def bench_real(tokens: int, rounds: int, home: Path) -> dict:
    from warmserve.stack import LocalStack, StackConfig

    cfg = StackConfig(runners=1, base_port=0, home=home, compile="off", max_num_seqs=8)
    request = generation_pb2.GenerateRequest(
        text=PROMPT, sampling=generation_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    with LocalStack(cfg, progress=lambda m: print(m, file=sys.stderr)) as stack:
        with open_channel(stack.runners[0].address) as dch, open_channel(stack.runners[0].address) as dch2, \
                open_channel(stack.router_address) as rch:
            direct = generation_pb2_grpc.GenerationStub(dch)
            direct2 = generation_pb2_grpc.GenerationStub(dch2)
            routed = generation_pb2_grpc.GenerationStub(rch)
            for _ in range(2):  # warm both paths
                _together(direct, routed, request)
            added, noise, shifts = [], [], []
            for k in range(rounds):
                d, r = _together(direct, routed, request) if k % 2 == 0 else _together(routed, direct, request)[::-1]
                shift, gaps = _aligned_gaps(d, r)
                added += gaps
                shifts.append(shift)
                d1, d2 = _together(direct, direct2, request)
                noise += _aligned_gaps(d1, d2)[1]
            single = _arrivals(direct, request)
    itl = [(b - a) * 1e3 for a, b in zip(single, single[1:], strict=False)]
    return {
        "tokens_per_request": tokens, "rounds": rounds, "samples": len(added),
        "step_offsets_seen": sorted(set(shifts)),
        "added_ms_p50": _pct(added, 50), "added_ms_p99": _pct(added, 99),
        "aa_noise_ms_p50": _pct([abs(x) for x in noise], 50), "aa_noise_ms_p99": _pct([abs(x) for x in noise], 99),
        "inter_token_ms_p50_direct": statistics.median(itl) if itl else float("nan"),
    }


def bench_instant(tokens: int, rounds: int) -> dict:
    """Relay cost alone: a runner that streams ``tokens`` tokens with no compute."""
    from router_service.config import RouterConfig
    from router_service.servicer import RouterServer
    from services.bootstrap import ServerConfig, ServiceServer

    class Instant(generation_pb2_grpc.GenerationServicer):
        def Generate(self, request, context):
            for i in range(request.sampling.max_tokens):
                yield generation_pb2.GenerateResponse(token_ids=[i], text="x", runner_id="instant")
            yield generation_pb2.GenerateResponse(finish_reason=generation_pb2.FINISH_REASON_LENGTH, runner_id="instant")

    runner = ServiceServer(ServerConfig(service="instant", port=0), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, Instant(), "warmserve.v1.Generation")])
    runner.start()
    router = RouterServer(RouterConfig(static_runners=(runner.address,), health_interval_s=0.2),
                          ServerConfig(service="router", port=0))
    router.start()
    try:
        router.router.wait_ready(1, 10)
        request = generation_pb2.GenerateRequest(text="x", sampling=generation_pb2.SamplingParams(max_tokens=tokens))
        with open_channel(runner.address) as dch, open_channel(router.address) as rch:
            stubs = {"direct": generation_pb2_grpc.GenerationStub(dch),
                     "router": generation_pb2_grpc.GenerationStub(rch)}
            per_token = {k: [] for k in stubs}
            ttft = {k: [] for k in stubs}
            for stub in stubs.values():  # warm both paths
                _arrivals(stub, request)
            for _ in range(rounds):
                for k, stub in stubs.items():
                    t = _arrivals(stub, request)
                    per_token[k].append(t[-1] / len(t) * 1e3)
                    ttft[k].append(t[0] * 1e3)
    finally:
        router.stop()
        runner.stop()
    added = [r - d for r, d in zip(per_token["router"], per_token["direct"], strict=True)]
    return {
        "tokens_per_request": tokens, "rounds": rounds,
        "per_token_ms_direct_p50": statistics.median(per_token["direct"]),
        "per_token_ms_router_p50": statistics.median(per_token["router"]),
        "added_per_token_ms_p50": _pct(added, 50), "added_per_token_ms_p99": _pct(added, 99),
        "ttft_ms_direct_p50": statistics.median(ttft["direct"]), "ttft_ms_router_p50": statistics.median(ttft["router"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds per measurement (default 12)")
    parser.add_argument("--home", default=None, help="stack home (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="warmserve-bench-router-") as tmp:
        home = Path(args.home) if args.home else Path(tmp)
        real = bench_real(args.tokens, args.rounds, home)
    instant = bench_instant(256, max(args.rounds, 20))
    result = {"benchmark": "router", "real_runner_smollm2": real, "instant_runner": instant}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print()
    print("| measurement | direct | through router | added p50 | added p99 |")
    print("|---|---|---|---|---|")
    print(f"| SmolLM2, same decode step, per token ({real['samples']} tokens) | - | - | "
          f"{real['added_ms_p50']:.2f} ms | {real['added_ms_p99']:.2f} ms |")
    print(f"| A/A noise floor, abs gap (direct vs direct) | - | - | {real['aa_noise_ms_p50']:.2f} ms | "
          f"{real['aa_noise_ms_p99']:.2f} ms |")
    print(f"| instant runner, wall per token (p50) | {instant['per_token_ms_direct_p50']:.3f} ms | "
          f"{instant['per_token_ms_router_p50']:.3f} ms | {instant['added_per_token_ms_p50']:.3f} ms | "
          f"{instant['added_per_token_ms_p99']:.3f} ms |")
    print(f"| instant runner, time to first token (p50) | {instant['ttft_ms_direct_p50']:.2f} ms | "
          f"{instant['ttft_ms_router_p50']:.2f} ms | "
          f"{instant['ttft_ms_router_p50'] - instant['ttft_ms_direct_p50']:.2f} ms | - |")
    print(f"\nSmolLM2 direct inter-token time p50: {real['inter_token_ms_p50_direct']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
