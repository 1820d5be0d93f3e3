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

3. *Front doors* (issue 13): the same paired method, with the native ``warmserve.v1`` stream
   through the router as the reference. For each door the same greedy request is sent at the
   same moment natively and through the door: KServe v2 ``ModelStreamInfer`` on the router's
   port (``stream`` true, one response per text delta), and the OpenAI HTTP door
   (``POST /v1/completions`` with ``stream``, one server-sent event per delta, read raw with
   ``http.client``, so the cost is the door's, not a client library's). The door's added latency per
   streamed token is its arrival time minus the native one for the same decode step. With the
   instant runner: wall time per token through each door minus the native router path.

4. *Oversize prompt beside a small request* (issue 23): the small greedy request's inter-token
   gaps (median, max) through the router alone, then while another client sends a 4 MB text
   prompt through the same router every 0.2 s, each refused by the runner before it is tokenized
   (``--max-prompt-bytes``, 1 MiB). Before the limit each was tokenized holding the GIL for
   seconds, stalling every stream of the runner; now the gaps should not move.
5. *TLS* (issue 23): the instant runner behind a router, plaintext and mTLS on every hop side
   by side (:func:`bench_tls`): wall time per token and time to first token, direct and routed.
   ``--tls-only`` runs just this part.

6. *Stream rates* (issue 25, :func:`bench_rates`): a ``warmserve up --runners 1`` stack (every
   process of ``up``, auth on, programs installed); at each concurrency (``--streams``, 1 and 16)
   the runner alone against the OpenAI door: output tok/s, TPOT, TTFT and each process's CPU
   time per token. ``--rates-only`` runs just this part; ``--ref DIR`` measures an older
   checkout's code first on the same home (before/after in one run); ``--profile DIR`` samples
   every process with py-spy during the first round; ``--tls`` runs the stack as ``up --tls``
   (mTLS on every hop, the door over HTTPS with the stack's client certificate).

7. *Paced runner* (issue 25, :func:`bench_paced`): the serving path's own cost, free of a model's
   timing noise. A stand-in runner process (``--paced-runner``: its engine thread hands every
   open stream one token per ``--period-ms``, 6 ms as a batch-1 int4 step, through a queue to
   the stream's servicer thread, as the engine does) behind real ``warmserve router serve`` and
   ``warmserve openai serve`` processes; at 1 and 16 streams through the OpenAI door, each
   process's CPU time and context switches (every thread's, ``/proc``) per output token.
   ``--paced-only`` runs just this part.

Prints a JSON object and a Markdown table; never asserts on timings.

    python bench/router.py [--tokens 32] [--rounds 12] [--home DIR] [--json out.json] [--tls-only]
    python bench/router.py --rates-only [--streams 1,16] [--ref DIR] [--profile DIR]
    python bench/router.py --paced-only [--streams 1,16] [--period-ms 6] [--rate-tokens 1000] [--rate-rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
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
    return _together_calls(lambda t0: _arrivals(stub_a, request, t0=t0), lambda t0: _arrivals(stub_b, request, t0=t0))


def _together_calls(call_a, call_b) -> tuple[list[float], list[float]]:
    """Run ``call_a(t0)`` and ``call_b(t0)`` at the same instant (each returns arrival times in
    seconds since ``t0``, a shared ``perf_counter`` origin); returns both lists."""
    barrier = threading.Barrier(2)
    t0 = [0.0]
    out: dict[str, list[float]] = {}

    def run(key: str, call) -> None:
        if barrier.wait() == 0:
            t0[0] = time.perf_counter()
        out[key] = call(t0[0] or time.perf_counter())

    threads = [threading.Thread(target=run, args=("a", call_a)), threading.Thread(target=run, args=("b", call_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["a"], out["b"]


def _kserve_request(model: str, prompt: str, tokens: int):
    """A ``ModelStreamInfer`` request as a vLLM-on-Triton client builds it (``text_input``,
    ``stream`` true, greedy ``sampling_parameters`` JSON), tensor data in ``contents``."""
    from services.proto.triton import grpc_service_pb2 as kpb

    req = kpb.ModelInferRequest(model_name=model)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(prompt.encode())
    req.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    sampling = json.dumps({"max_tokens": tokens, "temperature": 0, "ignore_eos": True}).encode()
    req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1]).contents.bytes_contents.append(sampling)
    return req


def _arrivals_kserve(stub, request, t0: float, timeout_s: float = 300.0) -> list[float]:
    """Arrival time (seconds since ``t0``) of each streamed ``ModelStreamInfer`` response that
    carries text, up to the one flagged ``triton_final_response``."""
    out: list[float] = []
    for resp in stub.ModelStreamInfer(iter([request]), timeout=timeout_s):
        now = time.perf_counter() - t0
        if resp.error_message:
            raise RuntimeError(f"ModelStreamInfer: {resp.error_message}")
        r = resp.infer_response
        if any(len(raw) > 4 for raw in r.raw_output_contents):  # a BYTES element longer than its prefix
            out.append(now)
        if r.parameters["triton_final_response"].bool_param:
            break
    return out


def _arrivals_openai(url: str, model: str, prompt: str, tokens: int, t0: float, timeout_s: float = 300.0,
                     key: str | None = None) -> list[float]:
    """Arrival time (seconds since ``t0``) of each streamed ``/v1/completions`` chunk with text,
    read as raw server-sent events over one ``http.client`` connection (``url`` is the door's
    ``http://host:port/v1``)."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    out: list[float] = []
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", f"{parts.path}/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {resp.status} {resp.read()[:300]!r}")
        while line := resp.readline():
            now = time.perf_counter() - t0
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                out.append(now)
    finally:
        conn.close()
    return out


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
    from warmserve.stack import LocalStack
    from warmserve.stack_config import StackConfig

    cfg = StackConfig(runners=1, base_port=0, home=home, compile="off", max_num_seqs=8, openai=True)
    request = generation_pb2.GenerateRequest(
        text=PROMPT, sampling=generation_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    with LocalStack(cfg, progress=lambda m: print(m, file=sys.stderr)) as stack:
        sec = stack.credentials()
        with open_channel(stack.runners[0].address, security=sec) as dch, \
                open_channel(stack.runners[0].address, security=sec) as dch2, \
                open_channel(stack.router_address, security=sec) as rch:
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
            oversize = _oversize_beside(routed, request, stack.router_address, rounds=max(2, rounds // 4))
            from warmserve.stack_auth import OPENAI_KEY_FILE, auth_dir

            key = (auth_dir(home) / OPENAI_KEY_FILE).read_text().strip() if cfg.auth else None
            doors = _bench_doors(routed, request, stack.router_address,
                                 f"http://{cfg.host}:{stack.port('openai')}/v1", tokens, rounds, sec, key)
    itl = [(b - a) * 1e3 for a, b in zip(single, single[1:], strict=False)]
    return {
        "doors": doors,
        "oversize_prompt_beside": oversize,
        "tokens_per_request": tokens, "rounds": rounds, "samples": len(added),
        "step_offsets_seen": sorted(set(shifts)),
        "added_ms_p50": _pct(added, 50), "added_ms_p99": _pct(added, 99),
        "aa_noise_ms_p50": _pct([abs(x) for x in noise], 50), "aa_noise_ms_p99": _pct([abs(x) for x in noise], 99),
        "inter_token_ms_p50_direct": statistics.median(itl) if itl else float("nan"),
    }


def _gaps_ms(stub, request) -> list[float]:
    """Inter-token gaps of one streamed request, in milliseconds."""
    t = _arrivals(stub, request)
    return [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)]


def _oversize_beside(routed, request, router_address: str, rounds: int, every_s: float = 0.2) -> dict:
    """Item 4 of the module docstring: ``request``'s inter-token gaps (ms) over ``rounds``
    requests alone, then while a second client sends a 4 MB prompt every ``every_s`` seconds (on
    its own channel); with the status and answer time of those."""
    big = generation_pb2.GenerateRequest(text="the " * (1 << 20), sampling=generation_pb2.SamplingParams(max_tokens=1))
    before = [g for _ in range(rounds) for g in _gaps_ms(routed, request)]
    stop, answers, codes = threading.Event(), [], set()

    def flood() -> None:
        import grpc

        with open_channel(router_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    list(stub.Generate(big, timeout=120))
                    codes.add("OK")
                except grpc.RpcError as e:
                    codes.add(e.code().name)
                answers.append((time.perf_counter() - t0) * 1e3)
                stop.wait(every_s)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        during = [g for _ in range(rounds) for g in _gaps_ms(routed, request)]
    finally:
        stop.set()
        thread.join(300)
    return {"prompt_bytes": len(big.text), "rounds": rounds, "oversize_sent": len(answers),
            "oversize_codes": sorted(codes), "oversize_answer_ms_p50": _pct(answers, 50),
            "gap_ms_p50_before": _pct(before, 50), "gap_ms_max_before": max(before, default=float("nan")),
            "gap_ms_p50_during": _pct(during, 50), "gap_ms_max_during": max(during, default=float("nan"))}


def _paired(native, door, rounds: int) -> dict:
    """Added latency per streamed token of ``door`` over ``native`` (both ``call(t0)`` returning
    arrival times), paired per decode step as in :func:`bench_real`; the order alternates."""
    for _ in range(2):  # warm both paths
        _together_calls(native, door)
    added, shifts = [], []
    for k in range(rounds):
        n, d = _together_calls(native, door) if k % 2 == 0 else _together_calls(door, native)[::-1]
        shift, gaps = _aligned_gaps(n, d)
        added += gaps
        shifts.append(shift)
    return {"samples": len(added), "step_offsets_seen": sorted(set(shifts)),
            "added_ms_p50": _pct(added, 50), "added_ms_p99": _pct(added, 99)}


def _bench_doors(routed, request, router_address: str, openai_url: str, tokens: int, rounds: int,
                 security=None, key: str | None = None) -> dict:
    """Each front door against the native router stream (see the module docstring, item 3)."""
    from services.model_name import served_model_name
    from services.proto.triton import grpc_service_pb2_grpc as kgrpc

    model = served_model_name(routed.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10).model)
    with open_channel(router_address, security=security) as kch:
        kstub = kgrpc.GRPCInferenceServiceStub(kch)
        kreq = _kserve_request(model, request.text, tokens)

        def native(t0: float) -> list[float]:
            return _arrivals(routed, request, t0=t0)

        return {
            "kserve_stream_infer": _paired(native, lambda t0: _arrivals_kserve(kstub, kreq, t0), rounds),
            "openai_completions_sse": _paired(
                native, lambda t0: _arrivals_openai(openai_url, model, request.text, tokens, t0, key=key), rounds),
        }


class _Instant(generation_pb2_grpc.GenerationServicer):
    """A Generation servicer that streams ``max_tokens`` tokens with no compute."""

    def Generate(self, request, context):  # noqa: N802 (the RPC's name)
        for i in range(request.sampling.max_tokens):
            yield generation_pb2.GenerateResponse(token_ids=[i], text="x", runner_id="instant")
        yield generation_pb2.GenerateResponse(finish_reason=generation_pb2.FINISH_REASON_LENGTH, runner_id="instant",
                                              usage=generation_pb2.Usage(prompt_tokens=1,
                                                                         completion_tokens=request.sampling.max_tokens))

    def ModelInfo(self, request, context):  # noqa: N802
        return generation_pb2.ModelInfoResponse(runner_id="instant", model="instant", max_model_len=1 << 20,
                                                vocab_size=1 << 16)


def _instant_runner(config):
    """A started ``ServiceServer`` of :class:`_Instant` with ``config``."""
    from services.bootstrap import ServiceServer

    runner = ServiceServer(config, [(generation_pb2_grpc.add_GenerationServicer_to_server, _Instant(),
                                     "warmserve.v1.Generation")])
    runner.start()
    return runner


def bench_instant(tokens: int, rounds: int) -> dict:
    """Relay cost alone: a runner that streams ``tokens`` tokens with no compute; per-token wall
    time direct, through the router natively, and through each front door on the router."""
    from kserve_service.door import router_server
    from openai_service.config import OpenAIConfig
    from openai_service.daemon import OpenAIServer
    from router_service.config import RouterConfig
    from services.bootstrap import ServerConfig
    from services.proto.triton import grpc_service_pb2_grpc as kgrpc

    runner = _instant_runner(ServerConfig(service="instant", port=0))
    router = router_server(RouterConfig(static_runners=(runner.address,), health_interval_s=0.2,
                                       served_model_name="instant"), ServerConfig(service="router", port=0))
    router.start()
    door = OpenAIServer(OpenAIConfig(router=router.address, port=0, served_model_name="instant"), log_level="WARNING")
    try:
        router.router.wait_ready(1, 10)
        door.start()
        request = generation_pb2.GenerateRequest(text="x", sampling=generation_pb2.SamplingParams(max_tokens=tokens))
        with open_channel(runner.address) as dch, open_channel(router.address) as rch:
            direct = generation_pb2_grpc.GenerationStub(dch)
            routed = generation_pb2_grpc.GenerationStub(rch)
            kstub = kgrpc.GRPCInferenceServiceStub(rch)
            kreq = _kserve_request("instant", "x", tokens)
            paths = {
                "direct": lambda t0: _arrivals(direct, request, t0=t0),
                "router": lambda t0: _arrivals(routed, request, t0=t0),
                "kserve": lambda t0: _arrivals_kserve(kstub, kreq, t0),
                "openai": lambda t0: _arrivals_openai(door.url, "instant", "x", tokens, t0),
            }
            per_token = {k: [] for k in paths}
            ttft = {k: [] for k in paths}
            for call in paths.values():  # warm every path
                call(time.perf_counter())
            for _ in range(rounds):
                for k, call in paths.items():
                    t = call(time.perf_counter())
                    per_token[k].append(t[-1] / len(t) * 1e3)
                    ttft[k].append(t[0] * 1e3)
    finally:
        door.stop()
        router.stop()
        runner.stop()

    def added(path: str, over: str) -> list[float]:
        return [a - b for a, b in zip(per_token[path], per_token[over], strict=True)]

    out = {"tokens_per_request": tokens, "rounds": rounds}
    for k in paths:
        out[f"per_token_ms_{k}_p50"] = statistics.median(per_token[k])
        out[f"ttft_ms_{k}_p50"] = statistics.median(ttft[k])
    out["added_per_token_ms_p50"] = _pct(added("router", "direct"), 50)
    out["added_per_token_ms_p99"] = _pct(added("router", "direct"), 99)
    for k in ("kserve", "openai"):
        out[f"{k}_added_per_token_ms_p50"] = _pct(added(k, "router"), 50)
        out[f"{k}_added_per_token_ms_p99"] = _pct(added(k, "router"), 99)
    return out


def bench_tls(tokens: int, rounds: int) -> dict:
    """Per-token cost of TLS: two instant runners, each behind its own router, one pair
    plaintext and one pair mTLS (servers require client certificates of a throw-away CA; the
    router dials its runner with its certificate; this client presents one). Each round streams
    ``tokens`` tokens over every path (direct and through the router, TLS off and on) in turn;
    wall time per token (ms) and time to first token (ms), medians."""
    from kserve_service.door import router_server
    from router_service.config import RouterConfig
    from services.bootstrap import ServerConfig
    from services.channel import ClientSecurity
    from services.tls import make_dev_pki

    request = generation_pb2.GenerateRequest(text="x", sampling=generation_pb2.SamplingParams(max_tokens=tokens))
    servers, stubs, channels = [], {}, []
    with tempfile.TemporaryDirectory(prefix="warmserve-bench-tls-") as tmp:
        pki = make_dev_pki(tmp)
        try:
            for label, tls in (("off", None), ("on", pki.files())):
                security = ClientSecurity(tls=tls) if tls is not None else None
                runner = _instant_runner(ServerConfig(service="instant", port=0, tls=tls))
                servers.append(runner)
                router = router_server(RouterConfig(static_runners=(runner.address,), health_interval_s=0.2),
                                       ServerConfig(service="router", port=0, tls=tls), security=security)
                servers.append(router)
                router.start()
                if not router.router.wait_ready(1, 10):
                    raise RuntimeError(f"the TLS {label} runner never became READY")
                for path, address in (("direct", runner.address), ("router", router.address)):
                    channels.append(open_channel(address, security=security))
                    stubs[f"{path}_tls_{label}"] = generation_pb2_grpc.GenerationStub(channels[-1])
            per_token = {k: [] for k in stubs}
            ttft = {k: [] for k in stubs}
            for stub in stubs.values():  # warm every path (the TLS handshakes happen here)
                _arrivals(stub, request)
            for _ in range(rounds):
                for k, stub in stubs.items():
                    t = _arrivals(stub, request)
                    per_token[k].append(t[-1] / len(t) * 1e3)
                    ttft[k].append(t[0] * 1e3)
        finally:
            for ch in channels:
                ch.close()
            for server in reversed(servers):
                server.stop()
    out = {"tokens_per_request": tokens, "rounds": rounds}
    for k in stubs:
        out[f"per_token_ms_{k}_p50"] = statistics.median(per_token[k])
        out[f"ttft_ms_{k}_p50"] = statistics.median(ttft[k])
    for path in ("direct", "router"):
        out[f"tls_added_per_token_ms_{path}_p50"] = (out[f"per_token_ms_{path}_tls_on_p50"]
                                                     - out[f"per_token_ms_{path}_tls_off_p50"])
    return out


def print_tls_table(tls: dict) -> None:
    """The Markdown rows of :func:`bench_tls`."""
    print(f"\nTLS (mTLS on every hop) vs plaintext, instant runner, {tls['tokens_per_request']} tokens "
          f"x {tls['rounds']} rounds:\n")
    print("| path | per token, TLS off (p50) | per token, TLS on (p50) | added per token | TTFT off | TTFT on |")
    print("|---|---|---|---|---|---|")
    for path in ("direct", "router"):
        print(f"| {path} | {tls[f'per_token_ms_{path}_tls_off_p50']:.3f} ms | "
              f"{tls[f'per_token_ms_{path}_tls_on_p50']:.3f} ms | {tls[f'tls_added_per_token_ms_{path}_p50']:.3f} ms | "
              f"{tls[f'ttft_ms_{path}_tls_off_p50']:.2f} ms | {tls[f'ttft_ms_{path}_tls_on_p50']:.2f} ms |")


# --- 6. Stream rates through the OpenAI door vs the runner alone (issue 25) -------------------

#: Numbers the rate prompts: each differs from every earlier one in its first block.
_PROMPT_SERIAL = itertools.count()


def _rate_prompt(i: int) -> str:
    """A prompt of about 100 tokens that no earlier request shares a KV block with (its first
    words are a serial number), so every stream prefills its whole prompt, in every round, as a
    client's new prompts do (``i``, the stream's index, is kept in it for reading logs)."""
    return f"Request {next(_PROMPT_SERIAL)} (stream {i}). " + " ".join([PROMPT] * 12)


def _direct_stream(stub, prompt: str, tokens: int, t0: float) -> dict:
    """One greedy ``ignore_eos`` stream straight to the runner: arrival times (s since ``t0``)
    of its first and last tokens, and its token count."""
    request = generation_pb2.GenerateRequest(
        text=prompt, sampling=generation_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    first = last = None
    count = 0
    for resp in stub.Generate(request, timeout=600):
        if resp.token_ids:
            last = time.perf_counter() - t0
            first = last if first is None else first
            count += len(resp.token_ids)
    return {"first": first, "last": last, "tokens": count}


def _door_stream(url: str, key: str | None, model: str, prompt: str, tokens: int, t0: float,
                 context=None) -> dict:
    """The same stream through the OpenAI door (``POST /v1/completions``, ``stream``, usage
    included), read raw with ``http.client`` (only the usage chunk is parsed, so the client's
    own cost stays small): first/last text-chunk arrival (s since ``t0``), tokens from the usage.
    ``context``: an ``ssl.SSLContext`` for an ``https`` door (mTLS: it presents a certificate)."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn = (http.client.HTTPSConnection(parts.hostname, parts.port, timeout=600, context=context)
            if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, parts.port, timeout=600))
    first = last = None
    count = 0
    try:
        conn.request("POST", f"{parts.path}/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {resp.status} {resp.read()[:300]!r}")
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            if b'"choices":[]' in line:
                count = json.loads(line[6:])["usage"]["completion_tokens"]
                continue
            last = time.perf_counter() - t0
            first = last if first is None else first
    finally:
        conn.close()
    return {"first": first, "last": last, "tokens": count}


def _concurrent(stream, n: int) -> dict:
    """``n`` streams started together (``stream(i, t0)``): output tok/s over the wall time, and
    the medians of time to first token (ms) and time per output token after it (ms)."""
    barrier = threading.Barrier(n)
    t0 = [0.0]
    results: list[dict] = [{}] * n

    def run(i: int) -> None:
        if barrier.wait() == 0:
            t0[0] = time.perf_counter()
        barrier_t0 = t0[0] or time.perf_counter()
        results[i] = stream(i, barrier_t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(r["tokens"] for r in results)
    wall = max(r["last"] for r in results)
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3 for r in results if r["tokens"] > 1]
    return {"tok_s": total / wall, "ttft_ms_p50": statistics.median(r["first"] * 1e3 for r in results),
            "tpot_ms_p50": statistics.median(tpot) if tpot else float("nan"), "tokens": total,
            "short_streams": sum(r["tokens"] <= 1 for r in results)}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measured(stream, n: int, pids: dict[str, int]) -> dict:
    """:func:`_concurrent` with each process's CPU time per output token (ms) over the run."""
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    out = _concurrent(stream, n)
    if not out["tokens"]:
        raise RuntimeError(f"{n} streams returned no tokens (each stream's result: first/last arrival and count)")
    out["cpu_ms_per_token"] = {name: (_cpu_s(pid) - before[name]) * 1e3 / out["tokens"] for name, pid in pids.items()}
    return out


@contextlib.contextmanager
def _profiled(directory: Path | None, label: str, pids: dict[str, int]):
    """With ``directory``, sample every process in ``pids`` but the client with py-spy
    (``--nonblocking``, 200 Hz, native frames off, threads on) while the block runs, into
    ``directory/LABEL-NAME.txt`` (collapsed stacks; ``py-spy`` must be on ``PATH`` or beside
    this Python)."""
    import shutil
    import signal
    import subprocess

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    procs = []
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            if name != "client":
                procs.append(subprocess.Popen(
                    [spy, "record", "--nonblocking", "--threads", "-r", "200", "-f", "raw", "-p", str(pid),
                     "-o", str(directory / f"{label}-{name}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # py-spy attaches
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)


def bench_rates(home: Path, streams: list[int], tokens: int, rounds: int, compile_mode: str,
                profile: Path | None = None, tls: bool = False) -> dict:
    """Item 6 of the module docstring: one ``warmserve up --runners 1`` stack (every process of
    ``up``: kernel cache, weights, router with its KServe door, OpenAI door, one runner; auth
    on; TLS off, or with ``tls`` mTLS on every hop and at the door, as ``up --tls``), its
    programs installed; per concurrency, rounds alternate between the runner alone
    (``warmserve.v1`` straight to it) and the OpenAI door (through the router)."""
    from warmserve.stack import LocalStack
    from warmserve.stack_auth import OPENAI_KEY_FILE, auth_dir
    from warmserve.stack_config import StackConfig
    from warmserve.stack_tls import http_context

    cfg = StackConfig(runners=1, base_port=0, home=home, compile=compile_mode, openai=True, record_state=False,
                      tls=tls)
    with LocalStack(cfg, progress=lambda m: print(m, file=sys.stderr)) as stack:
        info = stack.wait_programs(0, final=True)
        key = (auth_dir(home) / OPENAI_KEY_FILE).read_text().strip() if cfg.auth else None
        context = http_context(stack.commands.pki)
        url = f"{'https' if context else 'http'}://{cfg.host}:{stack.port('openai')}/v1"
        with open_channel(stack.runners[0].address, security=stack.credentials()) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            from services.model_name import served_model_name

            model = served_model_name(stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10).model)
            paths = {
                "runner": lambda i, t0: _direct_stream(stub, _rate_prompt(i), tokens, t0),
                "door": lambda i, t0: _door_stream(url, key, model, _rate_prompt(i), tokens, t0, context),
            }
            pids = {name: c.proc.pid for name, c in stack.services.items()}
            pids |= {"runner": stack.runners[0].proc.pid, "client": os.getpid()}
            for n in streams:  # warm both paths at each concurrency
                for path in paths.values():
                    _concurrent(path, n)
            out: dict = {"tokens_per_stream": tokens, "rounds": rounds, "program_state": info.program_state,
                         "weights_dtype": info.weights_dtype, "dtype": info.dtype, "tls": tls}
            for n in streams:
                runs: dict[str, list[dict]] = {k: [] for k in paths}
                for k in range(rounds):
                    order = list(paths) if k % 2 == 0 else list(paths)[::-1]
                    for name in order:
                        with _profiled(profile, f"{name}-{n}", pids if k == 0 else {}):
                            runs[name].append(_measured(paths[name], n, pids))
                cell: dict = {}
                for name, rs in runs.items():
                    for fig in ("tok_s", "ttft_ms_p50", "tpot_ms_p50"):
                        cell[f"{name}_{fig}"] = statistics.median(r[fig] for r in rs)
                    cell[f"{name}_cpu_ms_per_token"] = {p: statistics.median(r["cpu_ms_per_token"][p] for r in rs)
                                                        for p in pids}
                cell["door_over_runner"] = cell["door_tok_s"] / cell["runner_tok_s"]
                out[f"streams_{n}"] = cell
    return out


class _Paced(generation_pb2_grpc.GenerationServicer):
    """A Generation servicer whose engine thread hands every open stream one token per
    ``period_s`` seconds through the stream's queue (the engine's hand-off to a servicer thread)."""

    def __init__(self, period_s: float) -> None:
        import queue

        self._queue = queue.SimpleQueue
        self._lock = threading.Lock()
        self._streams: list = []
        threading.Thread(target=self._engine, args=(period_s,), daemon=True).start()

    def _engine(self, period_s: float) -> None:
        while True:
            t = time.perf_counter()
            with self._lock:
                streams = list(self._streams)
            for q in streams:
                q.put(None)
            time.sleep(max(0.0, period_s - (time.perf_counter() - t)))

    def Generate(self, request, context):  # noqa: N802 (the RPC's name)
        q = self._queue()
        with self._lock:
            self._streams.append(q)
        try:
            for i in range(request.sampling.max_tokens):
                q.get()
                yield generation_pb2.GenerateResponse(token_ids=[i], text=" x", runner_id="paced")
            yield generation_pb2.GenerateResponse(
                finish_reason=generation_pb2.FINISH_REASON_LENGTH, runner_id="paced",
                usage=generation_pb2.Usage(prompt_tokens=1, completion_tokens=request.sampling.max_tokens))
        finally:
            with self._lock:
                self._streams.remove(q)

    def ModelInfo(self, request, context):  # noqa: N802
        return generation_pb2.ModelInfoResponse(runner_id="paced", model="paced", max_model_len=1 << 20,
                                                vocab_size=1 << 16, max_num_seqs=256)


def _paced_runner_main(port: int, period_ms: float) -> int:
    """``--paced-runner PORT``: serve :class:`_Paced` on ``port`` until killed."""
    from services.bootstrap import ServerConfig, ServiceServer

    server = ServiceServer(ServerConfig(service="paced", port=port), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, _Paced(period_ms / 1e3), "warmserve.v1.Generation")])
    server.start()
    threading.Event().wait()
    return 0


def _switches(pid: int) -> int:
    """Context switches (voluntary and not) of every thread of ``pid`` so far (``/proc``)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def bench_paced(streams: list[int], tokens: int, rounds: int, period_ms: float) -> dict:
    """Item 7 of the module docstring: medians over ``rounds`` per concurrency."""
    import socket
    import subprocess

    from services.ports import free_port

    ports = {name: free_port("127.0.0.1") for name in ("runner", "router", "openai")}
    cli = [sys.executable, "-m", "warmserve.cli"]
    cmds = {"runner": [sys.executable, __file__, "--paced-runner", str(ports["runner"]), "--period-ms", str(period_ms)],
            "router": [*cli, "router", "serve", "--port", str(ports["router"]), "--runner",
                       f"127.0.0.1:{ports['runner']}", "--served-model-name", "paced", "--log-level", "WARNING"],
            "openai": [*cli, "openai", "serve", "--port", str(ports["openai"]), "--router",
                       f"127.0.0.1:{ports['router']}", "--served-model-name", "paced", "--log-level", "WARNING"]}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in cmds.items():  # each waits for the one before it to listen
            procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", ports[name]), 0.5).close()
                    break
                except OSError:
                    if procs[name].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the paced stack's {name} did not start: {' '.join(cmd)}") from None
                    time.sleep(0.1)
        url = f"http://127.0.0.1:{ports['openai']}/v1"
        deadline = time.monotonic() + 30  # the router admits the runner on its first health check
        while True:
            try:
                _door_stream(url, None, "paced", "x", 2, time.perf_counter())
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        procs_pids = {name: p.pid for name, p in procs.items()}  # the client's threads end with each round
        pids = procs_pids | {"client": os.getpid()}
        door = lambda i, t0: _door_stream(url, None, "paced", "x", tokens, t0)  # noqa: E731
        out: dict = {"period_ms": period_ms, "tokens_per_stream": tokens, "rounds": rounds}
        for n in streams:
            _concurrent(door, n)  # warm
            runs = []
            for _ in range(rounds):
                before = {name: _switches(pid) for name, pid in procs_pids.items()}
                r = _measured(door, n, pids)
                r["switches_per_token"] = {name: (_switches(pid) - before[name]) / r["tokens"]
                                           for name, pid in procs_pids.items()}
                runs.append(r)
            out[f"streams_{n}"] = {
                "tok_s": statistics.median(r["tok_s"] for r in runs),
                "cpu_ms_per_token": {p: statistics.median(r["cpu_ms_per_token"][p] for r in runs) for p in pids},
                "switches_per_token": {p: statistics.median(r["switches_per_token"][p] for r in runs)
                                       for p in procs_pids}}
        return out
    finally:
        for p in procs.values():
            p.kill()
        for p in procs.values():
            p.wait(10)


def print_paced_table(paced: dict, streams: list[int]) -> None:
    """The Markdown rows of :func:`bench_paced`: per process, CPU ms and context switches per token."""
    names = list(paced[f"streams_{streams[0]}"]["cpu_ms_per_token"])
    print("\n| streams | door tok/s | " + " | ".join(f"{p}: CPU ms / switches per token" for p in names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for n in streams:
        cell = paced[f"streams_{n}"]
        switches = cell["switches_per_token"]
        print(f"| {n} | {cell['tok_s']:.1f} | " + " | ".join(
            f"{cell['cpu_ms_per_token'][p]:.3f} / " + (f"{switches[p]:.1f}" if p in switches else "-")
            for p in names) + " |")


def bench_rates_ref(ref: Path, home: Path, argv: list[str]) -> dict:
    """:func:`bench_rates` with the code of the checkout ``ref`` (an older commit): this file is
    run from a temporary copy with ``ref`` first on the path, so every process of its stack runs
    ``ref``'s code, on the same ``home`` (weights and programs reused)."""
    import shutil
    import subprocess

    with tempfile.TemporaryDirectory(prefix="warmserve-bench-ref-") as tmp:
        script = Path(tmp) / "router_bench.py"
        shutil.copy(__file__, script)
        out = Path(tmp) / "out.json"
        env = dict(os.environ, PYTHONPATH=str(ref))
        subprocess.run([sys.executable, str(script), "--rates-only", "--home", str(home), "--json", str(out), *argv],
                       cwd=ref, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rates"]


def print_rates_table(rates: dict[str, dict], streams: list[int]) -> None:
    """The Markdown rows of :func:`bench_rates`, one row per code version and concurrency."""
    any_rates = next(iter(rates.values()))
    print(f"\nOutput tok/s, the runner alone vs through the OpenAI door ({any_rates['tokens_per_stream']} tokens "
          f"per stream, medians of {any_rates['rounds']} rounds; {any_rates['weights_dtype']} weights, "
          f"{any_rates['dtype']}, programs {any_rates['program_state']}, "
          f"TLS {'on (mTLS every hop)' if any_rates.get('tls') else 'off'}):\n")
    print("| code | streams | runner tok/s | door tok/s | door / runner | runner TPOT | door TPOT | "
          "runner TTFT | door TTFT |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rates.items():
        for n in streams:
            c = r[f"streams_{n}"]
            print(f"| {label} | {n} | {c['runner_tok_s']:.1f} | {c['door_tok_s']:.1f} | {c['door_over_runner']:.2f} | "
                  f"{c['runner_tpot_ms_p50']:.1f} ms | {c['door_tpot_ms_p50']:.1f} ms | "
                  f"{c['runner_ttft_ms_p50']:.0f} ms | {c['door_ttft_ms_p50']:.0f} ms |")
    print("\nCPU time per output token (ms) of each process of the stack, through the OpenAI door "
          "(in brackets: the runner alone):\n")
    procs = list(next(iter(any_rates[f"streams_{n}"] for n in streams))["door_cpu_ms_per_token"])
    print("| code | streams | " + " | ".join(procs) + " |")
    print("|---|---:|" + "---:|" * len(procs))
    for label, r in rates.items():
        for n in streams:
            c = r[f"streams_{n}"]
            print(f"| {label} | {n} | " + " | ".join(
                f"{c['door_cpu_ms_per_token'][p]:.2f} ({c['runner_cpu_ms_per_token'][p]:.2f})" for p in procs) + " |")


def _rates_main(args: argparse.Namespace) -> int:
    streams = [int(n) for n in args.streams.split(",")]
    rate_args = ["--streams", args.streams, "--rate-tokens", str(args.rate_tokens),
                 "--rate-rounds", str(args.rate_rounds), "--compile", args.compile]
    if args.tls:
        rate_args.append("--tls")
    with tempfile.TemporaryDirectory(prefix="warmserve-bench-rates-") as tmp:
        home = Path(args.home) if args.home else Path(tmp) / "home"
        rates: dict[str, dict] = {}
        if args.ref:
            rates["ref"] = bench_rates_ref(Path(args.ref).resolve(), home, rate_args)
        rates["this"] = bench_rates(home, streams, args.rate_tokens, args.rate_rounds, args.compile,
                                    Path(args.profile) if args.profile else None, tls=args.tls)
    result = {"benchmark": "router", "rates": rates["this"], "rates_ref": rates.get("ref")}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print_rates_table(rates, streams)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds per measurement (default 12)")
    parser.add_argument("--home", default=None, help="stack home (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument("--tls-only", action="store_true",
                        help="only the TLS on vs off comparison (instant runners: seconds, no model)")
    parser.add_argument("--rates-only", action="store_true",
                        help="only the stream rates, runner alone vs the OpenAI door (item 6)")
    parser.add_argument("--streams", default="1,16", help="concurrencies of the rates part (default 1,16)")
    parser.add_argument("--rate-tokens", type=int, default=128, help="tokens per stream in the rates part (128)")
    parser.add_argument("--rate-rounds", type=int, default=3, help="rounds per path and concurrency (default 3)")
    parser.add_argument("--compile", default="aoti", help="the runner's --compile in the rates part (aoti)")
    parser.add_argument("--profile", default=None,
                        help="rates part: py-spy each process during the first round of each path, into this folder")
    parser.add_argument("--tls", action="store_true",
                        help="rates part: the stack with mTLS on every hop and at the door (as up --tls)")
    parser.add_argument("--ref", default=None,
                        help="also measure the rates with this checkout's code (an older commit), same home")
    parser.add_argument("--paced-only", action="store_true",
                        help="only the paced stand-in runner behind a real router and door (item 7)")
    parser.add_argument("--period-ms", type=float, default=6.0,
                        help="paced part: milliseconds between the stand-in engine's tokens (default 6)")
    parser.add_argument("--paced-runner", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.paced_runner is not None:
        return _paced_runner_main(args.paced_runner, args.period_ms)
    if args.paced_only:
        streams = [int(n) for n in args.streams.split(",")]
        paced = bench_paced(streams, args.rate_tokens, args.rate_rounds, args.period_ms)
        print(json.dumps({"benchmark": "router", "paced": paced}, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps({"benchmark": "router", "paced": paced}, indent=2) + "\n")
        print_paced_table(paced, streams)
        return 0
    if args.rates_only:
        return _rates_main(args)
    tls = bench_tls(256, max(args.rounds, 20))
    if args.tls_only:
        result = {"benchmark": "router", "tls": tls}
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print_tls_table(tls)
        return 0

    with tempfile.TemporaryDirectory(prefix="warmserve-bench-router-") as tmp:
        home = Path(args.home) if args.home else Path(tmp)
        real = bench_real(args.tokens, args.rounds, home)
    instant = bench_instant(256, max(args.rounds, 20))
    result = {"benchmark": "router", "real_runner_smollm2": real, "instant_runner": instant, "tls": tls}
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
    print("\nFront doors, each against the native warmserve.v1 stream through the router:\n")
    print("| door | SmolLM2, same decode step: added p50 | added p99 | instant runner, wall per token | "
          "added p50 | added p99 |")
    print("|---|---|---|---|---|---|")
    print(f"| native warmserve.v1 (reference) | - | - | {instant['per_token_ms_router_p50']:.3f} ms | - | - |")
    for key, name, door in (("kserve", "KServe v2 ModelStreamInfer", real["doors"]["kserve_stream_infer"]),
                            ("openai", "OpenAI /v1/completions SSE", real["doors"]["openai_completions_sse"])):
        print(f"| {name} | {door['added_ms_p50']:.2f} ms | {door['added_ms_p99']:.2f} ms | "
              f"{instant[f'per_token_ms_{key}_p50']:.3f} ms | {instant[f'{key}_added_per_token_ms_p50']:.3f} ms | "
              f"{instant[f'{key}_added_per_token_ms_p99']:.3f} ms |")
    print(f"\nSmolLM2 direct inter-token time p50: {real['inter_token_ms_p50_direct']:.1f} ms")
    big = real["oversize_prompt_beside"]
    print(f"\nA small request's inter-token gaps through the router, alone and while {big['oversize_sent']} prompts "
          f"of {big['prompt_bytes'] / 2**20:.0f} MiB were sent beside it (answered {', '.join(big['oversize_codes'])} "
          f"in {big['oversize_answer_ms_p50']:.0f} ms p50):\n")
    print("| small request | gap p50 | gap max |")
    print("|---|---|---|")
    for when in ("before", "during"):
        print(f"| {when} | {big[f'gap_ms_p50_{when}']:.1f} ms | {big[f'gap_ms_max_{when}']:.1f} ms |")
    print_tls_table(tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
