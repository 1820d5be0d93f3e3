"""Start-up benchmark: a cold launch with empty caches vs a warm launch that reuses them.

Launches ``warmserve runner serve --model smollm2-135m-instruct --compile MODE`` twice as
subprocesses (serving eager at once while programs compile in the background, the default),
each with its own empty ``WARMSERVE_HOME`` and empty ``TORCHINDUCTOR_CACHE_DIR``:

1. **cold**: empty ``--kernel-cache-dir`` and empty ``--sidecar-dir``: the runner packs the
   sidecar from the GGUF, serves eager and compiles its programs (then publishes them);
2. **warm**: the *same* kernel-cache and sidecar directories (the sidecar is hot in the page
   cache, since the cold launch just wrote it): the runner validates the sidecar and loads the
   programs from the kernel cache.

Per launch, in seconds from ``Popen``: health ``SERVING`` (the runner starts its server only
after the engine is built and warmed up), the first token of a chat request sent at once,
compiled programs installed (``ModelInfo`` polled every 0.25 s; at SERVING when they were
loaded at start-up; the loop programs, where the runner builds them first), the unrolled ones
installed, and the longest gap between two tokens of a stream served while any build ran. ``--load idle`` sends only that first request while the programs are
pending; ``--load busy`` streams chat requests back to back until they are installed. Then the
**first request vs steady**: the first request's seconds per token (call to last token, over
its tokens) against the median of ``--steady`` later requests (other prompts of the same kind,
which find the chat template's system prompt in the prefix cache, as steady traffic does),
compiled; target <= 1.2x on the warm launch; also each one's first token and its ms/token after
it (the streaming rate). Then the runner's own phase breakdown through
``ModelInfo``, and SIGTERM. Prints one JSON document, then Markdown tables. ``--against DIR``
runs the same launches from another checkout too (e.g. the parent commit's worktree),
interleaved: cold here, cold there, warm here, warm there, each pair on its own caches.
``--off-beside`` (the default) adds a ``--compile off`` launch after the cold ones, under the
same load for as long as the cold launch here compiled: its longest gap between tokens is the
baseline of the cold launch's (target: at most ``TARGET_GAP_OVER_OFF`` times it).
``--warm-only DIR`` runs only a warm launch on caches an earlier run filled.

**Fleet** (``--fleet N``, e.g. 4): N runners on an empty kernel cache (the sidecar is prepared
first, so only programs are missing), each with ``--threads 1`` and its own empty Inductor cache
(as separate machines would be), started four ways:

- ``each-compiles``: all at once, each with its own kernel-cache directory, waiting for their
  programs (a fleet roll-out without a shared cache or single-flight builds);
- ``sequential``: runner 0 alone until it serves (it compiles), then the others at once (what
  ``warmserve up`` did before single-flight builds);
- ``single-flight``: all at once on one shared kernel-cache directory, serving eager at once
  (the defaults): one compile per program, the others wait for its publish;
- ``warm``: all at once on the cache ``single-flight`` filled (nothing to compile).

Per way: seconds from the launch to the fleet's first token (a 1-token request sent to each
runner as soon as it serves; the earliest answer), to every runner's first token, to every
runner running compiled programs; and the CPU-seconds of the runner processes and their
children (the C++ compiler, Inductor's workers) until then. ``compile_cpu_s`` is that minus
the ``warm`` way's (which compiles nothing).

Usage: ``python bench/startup.py [--compile aoti|inductor|off] [--max-num-seqs 8]
[--kv-cache-bytes 268435456] [--threads N] [--load idle|busy] [--max-tokens 64] [--steady 3]
[--against DIR | --warm-only DIR] [--keep DIR] [--fleet N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from services.channel import PROBE_CHANNEL_OPTIONS  # noqa: E402
from services.generation_client import GenerationClient, GenerationResult, chat_request  # noqa: E402
from services.ports import free_port  # noqa: E402
from services.procs import stop_process  # noqa: E402
from services.proto import generation_pb2, generation_pb2_grpc  # noqa: E402

MODEL = "smollm2-135m-instruct"
#: Chat prompts of the requests (each ~40 tokens with SmolLM2's template): the first request
#: after a launch takes the first, the steady ones the next, a busy load cycles through them.
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give me three short tips for writing clear code.",
    "Name three colors of the rainbow.",
    "What is the capital of Italy? Answer in one sentence.",
    "Write one sentence about the moon.",
)
#: The warm launch's first request may take this many times the steady seconds per token.
TARGET_FIRST_OVER_STEADY = 1.2
#: The cold launch's longest gap between tokens while compiling may be this many times that of
#: a ``--compile off`` runner under the same load for as long (``--off-beside``).
TARGET_GAP_OVER_OFF = 1.5


def warmserve_command(repo: Path = REPO) -> list[str]:
    """The ``warmserve`` console script next to this interpreter, else ``python -m warmserve.cli``;
    for another checkout ``repo``, ``python -m warmserve.cli`` run there."""
    script = Path(sys.executable).with_name("warmserve")
    if repo == REPO and script.exists():
        return [str(script)]
    return [sys.executable, "-m", "warmserve.cli"]


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll the health service every 50 ms until ``SERVING``; raise if the process dies first."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address, options=PROBE_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"runner exited with code {proc.returncode} before serving")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"runner at {address} not SERVING within {timeout_s:.0f} s")


def chat(address: str, prompt: str, max_tokens: int, timeout_s: float) -> GenerationResult:
    """One greedy chat request of ``max_tokens`` tokens (EOS ignored), streamed to the end."""
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with GenerationClient(address, ready_timeout_s=timeout_s) as client:
        return client.complete(chat_request([("user", prompt)], sampling), timeout_s=timeout_s)


def per_token_s(r: GenerationResult) -> float:
    """A request's seconds per token: call to last token, over its tokens."""
    return r.seconds / max(1, r.completion_tokens)


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def launch(name: str, args, kernel_cache: Path, sidecars: Path, scratch: Path, repo: Path = REPO,
           measure: bool = True, eager_window_s: float | None = None, zygote: Path | None = None,
           env: dict[str, str] | None = None) -> dict:
    """One runner launch from checkout ``repo``; returns its timings (see the module docstring)
    and its start-up phases. ``measure=False``: only the wall time to SERVING and the phases.
    ``eager_window_s``: a ``--compile off`` launch, whose load runs that many seconds after
    SERVING as if programs were pending (the baseline of the longest gap). ``zygote``: launched
    through the runner zygote on that socket. ``env``: the launch's environment (default: this
    one with a home and Inductor cache of its own)."""
    if env is None:
        home, inductor = scratch / f"home-{name}", scratch / f"inductor-{name}"
        home.mkdir()
        inductor.mkdir()
        env = dict(os.environ, WARMSERVE_HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(inductor),
                   PYTHONPATH=str(repo))
    port = free_port()
    cmd = [*warmserve_command(repo), "runner", "serve", "--model", MODEL, "--compile", args.compile,
           "--kernel-cache-dir", str(kernel_cache), "--sidecar-dir", str(sidecars), "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-bytes", str(args.kv_cache_bytes),
           "--dtype", args.dtype, "--log-level", args.log_level]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if zygote is not None:
        cmd += ["--zygote", str(zygote)]
    log_path = scratch / f"runner-{name}.log"
    address = f"127.0.0.1:{port}"
    timings: dict = {}
    with open(log_path, "wb") as log:
        t0, t0_epoch = time.perf_counter(), time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=repo)
        try:
            wait_serving(address, proc, args.timeout)
            wall = time.perf_counter() - t0
            if measure:
                timings = measure_launch(address, args, t0, wall, eager_window_s)
            with grpc.insecure_channel(address) as channel:
                info = generation_pb2_grpc.GenerationStub(channel).ModelInfo(
                    generation_pb2.ModelInfoRequest(), timeout=10)
        except Exception:
            sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
            raise
        finally:
            stop_process(proc, grace_s=60)
    phases = [{"name": p.name, "seconds": round(p.seconds, 3), "detail": p.detail} for p in info.startup.phases]
    return {"launch": name, "repo": str(repo), "popen_epoch_s": round(t0_epoch, 3), "wall_to_serving_s": round(wall, 3),
            "engine_total_s": round(info.startup.total_seconds, 3), **timings,
            "program_state": info.program_state, "program_detail": info.program_detail,
            "compile_mode": info.compile_mode, "num_kv_blocks": info.num_kv_blocks, "phases": phases}


def measure_launch(address: str, args, t0: float, serving_s: float, eager_window_s: float | None = None) -> dict:
    """The figures of a runner that just answered SERVING (``t0``: its ``Popen``, perf_counter
    clock): the first request at once, the load while its programs are pending (for an eager
    baseline, ``eager_window_s`` seconds), then the steady requests (see the module docstring)."""
    streams: list[tuple[float, GenerationResult]] = []  # (sent, result) of the streams while pending
    pending = threading.Event()
    pending.set()
    errors: list[BaseException] = []

    def load() -> None:
        n = 0
        try:
            while n == 0 or (args.load == "busy" and pending.is_set()):
                sent = time.perf_counter()
                streams.append((sent, chat(address, PROMPTS[n % len(PROMPTS)], args.max_tokens, args.timeout)))
                n += 1
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    loader = threading.Thread(target=load, name="load")
    loader.start()
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        end = time.monotonic() + args.timeout
        installed_at = None  # when the first programs took over (the loop ones, where there are two forms)
        window_end = None if eager_window_s is None else time.perf_counter() + eager_window_s
        while True:
            info = stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=30)
            if window_end is not None:  # an eager baseline: idle, its first request; busy, the window
                if time.perf_counter() >= window_end or (args.load == "idle" and not loader.is_alive()):
                    break
                time.sleep(0.25)
                continue
            if info.program_state == "installed" and installed_at is None:
                installed_at = time.perf_counter() - t0
            if info.program_state != "pending" and not info.programs_building:  # an older checkout: no field, False
                break
            if time.monotonic() > end or errors:
                pending.clear()
                loader.join()
                raise errors[0] if errors else TimeoutError(f"programs still pending: {info.program_detail}")
            time.sleep(0.25)
    pending_until = time.perf_counter() - t0
    pending.clear()
    loader.join()
    if errors:
        raise errors[0]
    # built in the background (installed or failed): pending until then; else loaded at start-up
    background = bool(info.programs_installed_at_s) or info.program_state == "eager" or window_end is not None
    compiled_s = None if info.program_state != "installed" else installed_at if background else serving_s
    unrolled_s = (pending_until if background else serving_s) if info.program_layers == "unrolled" else None
    first_sent, first = streams[0]
    during = [(sent, r) for sent, r in streams if background and sent - t0 < pending_until]
    gaps = sorted(((b - a, sent - t0 + b) for sent, r in during for a, b in pairwise(r.token_times_s)),
                  reverse=True)  # (gap, when it ended, s from Popen)
    during = [r for _, r in during]
    steady = [chat(address, PROMPTS[(i + 1) % len(PROMPTS)], args.max_tokens, args.timeout)
              for i in range(args.steady)]
    steady_s = statistics.median(per_token_s(r) for r in steady) if steady else None
    first_s = per_token_s(first)

    def median_ms(values) -> float | None:
        values = [v for v in values if v is not None]
        return _r(statistics.median(values) * 1000, 2) if values else None

    return {"first_token_s": _r(first_sent - t0 + (first.first_token_s or first.seconds)),
            "compiled_s": _r(compiled_s), "unrolled_s": _r(unrolled_s),
            "compile_window_s": _r(pending_until - serving_s) if background else None,
            "streams_while_compiling": len(during),
            "max_gap_while_compiling_s": _r(max((r.max_gap_s for r in during), default=None)),
            "longest_gaps_while_compiling": [{"gap_s": _r(g), "ended_at_s": _r(at, 2)} for g, at in gaps[:5]],
            "first_request": {"prompt_tokens": first.prompt_tokens, "tokens": first.completion_tokens,
                              "seconds": _r(first.seconds), "first_token_s": _r(first.first_token_s),
                              "max_gap_s": _r(first.max_gap_s), "per_token_ms": _r(first_s * 1000, 2),
                              "stream_ms_per_token": median_ms([first.per_token_s])},
            "steady_per_token_ms": _r(None if steady_s is None else steady_s * 1000, 2),
            "steady_first_token_ms": median_ms(r.first_token_s for r in steady),
            "steady_stream_ms_per_token": median_ms(r.per_token_s for r in steady),
            "first_over_steady": _r(first_s / steady_s if steady_s else None, 2)}


def markdown(launches: list[dict]) -> str:
    """The per-launch figures (one column per launch), then the phases of each."""
    def cell(x, fmt=".2f", none="—"):
        return none if x is None else format(x, fmt)

    heads = [f"{r['launch']}" for r in launches]
    lines = ["| from process start | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(launches)]
    rows = [("SERVING (s)", "wall_to_serving_s", ".2f"), ("first token (s)", "first_token_s", ".2f"),
            ("**serving at compiled speed (s)**", "compiled_s", ".2f"),
            ("unrolled programs installed (s)", "unrolled_s", ".2f"),
            ("seconds under load while compiling (s)", "compile_window_s", ".1f"),
            ("streams served while compiling", "streams_while_compiling", "d"),
            ("longest gap between tokens while compiling (s)", "max_gap_while_compiling_s", ".3f"),
            ("first request: first token (s)", ("first_request", "first_token_s"), ".3f"),
            ("steady: first token (ms, median)", "steady_first_token_ms", ".1f"),
            ("first request: ms/token after its first", ("first_request", "stream_ms_per_token"), ".2f"),
            ("steady: ms/token after the first (median)", "steady_stream_ms_per_token", ".2f"),
            ("first request, ms/token (whole request)", ("first_request", "per_token_ms"), ".2f"),
            ("steady, ms/token (whole request, median)", "steady_per_token_ms", ".2f"),
            (f"first / steady (target <= {TARGET_FIRST_OVER_STEADY}x on warm)", "first_over_steady", ".2f")]
    for label, key, fmt in rows:
        vals = [r.get(key[0], {}).get(key[1]) if isinstance(key, tuple) else r.get(key) for r in launches]
        lines.append(f"| {label} | " + " | ".join(cell(v, fmt) for v in vals) + " |")
    names: list[str] = []
    for r in launches:
        names += [p["name"] for p in r["phases"] if p["name"] not in names]
    by = [{p["name"]: p for p in r["phases"]} for r in launches]
    lines += ["", "| phase | " + " | ".join(f"{h} (s)" for h in heads) + " | detail (last launch) |",
              "|---|" + "---:|" * len(launches) + "---|"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{b.get(n, {}).get('seconds', 0):.2f}" for b in by)
                     + f" | {by[-1].get(n, {}).get('detail', '')} |")
    lines.append("| engine total | " + " | ".join(f"{r['engine_total_s']:.2f}" for r in launches) + " | |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- fleet

FLEET_WAYS = ("each-compiles", "sequential", "single-flight", "warm")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``, its reaped children, and its live
    descendants with theirs (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # after the ")": state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based from state
            stats[int(d.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
            todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total / tick


class FleetRunner:
    """One runner of a fleet: its process and the times (s after the fleet's launch) it reached."""

    def __init__(self, index: int, cmd: list[str], env: dict, log: Path, t0: float) -> None:
        self.index, self.cmd, self.env, self.log, self.t0 = index, cmd, env, log, t0
        self.port = int(cmd[cmd.index("--port") + 1])
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.serving_s = self.first_token_s = self.compiled_s = None
        self.detail = ""

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def follow(self, timeout_s: float) -> None:
        """Wait until serving, send a 1-token request, then wait for compiled programs."""
        wait_serving(self.address, self.proc, timeout_s)
        self.serving_s = time.perf_counter() - self.t0
        with grpc.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            req = generation_pb2.GenerateRequest(text="Hello", sampling=generation_pb2.SamplingParams(
                max_tokens=1, temperature=0.0, ignore_eos=True))
            for msg in stub.Generate(req, timeout=timeout_s):
                if msg.token_ids and self.first_token_s is None:
                    self.first_token_s = time.perf_counter() - self.t0
            end = time.monotonic() + timeout_s
            while True:
                info = stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=30)
                if info.program_state != "pending":
                    self.compiled_s = time.perf_counter() - self.t0
                    self.detail = info.program_detail
                    return
                if time.monotonic() > end:
                    raise TimeoutError(f"runner {self.index}: programs still pending: {info.program_detail}")
                time.sleep(0.25)


def run_fleet_way(way: str, args, scratch: Path, sidecars: Path, shared_cache: Path) -> dict:
    """Start ``args.fleet`` runners the ``way`` way (see the module docstring) and time them."""
    import threading

    n, base = args.fleet, scratch / way
    base.mkdir()
    t0 = time.perf_counter()
    runners = []
    for i in range(n):
        home, inductor = base / f"home-{i}", base / f"inductor-{i}"
        home.mkdir()
        inductor.mkdir()
        # each-compiles: a cache per runner; sequential: one of its own; single-flight fills the shared
        # one, which the warm way then finds full
        cache = {"each-compiles": base / f"kernel-cache-{i}", "sequential": base / "kernel-cache"}.get(way, shared_cache)
        cmd = [*warmserve_command(), "runner", "serve", "--model", MODEL, "--compile", args.compile,
               "--kernel-cache-dir", str(cache), "--sidecar-dir", str(sidecars), "--port", str(free_port()),
               "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-bytes", str(args.kv_cache_bytes),
               "--dtype", args.dtype, "--threads", "1", "--runner-id", f"runner-{i}", "--log-level", "WARNING"]
        if way in ("each-compiles", "sequential"):
            cmd.append("--no-compile-in-background")
        env = dict(os.environ, WARMSERVE_HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(inductor))
        runners.append(FleetRunner(i, cmd, env, base / f"runner-{i}.log", t0))
    errors: list[BaseException] = []

    def follow(r: FleetRunner) -> None:
        try:
            r.follow(args.timeout)
        except BaseException as e:  # noqa: BLE001 - reported below with the log
            errors.append(e)
            sys.stderr.write(f"{way} runner {r.index}: {e}\n{r.log.read_text(errors='replace')[-3000:]}\n")

    try:
        order = [runners[:1], runners[1:]] if way == "sequential" else [runners]
        threads = []
        for group in order:
            for r in group:
                r.start()
            group_threads = [threading.Thread(target=follow, args=(r,)) for r in group]
            for t in group_threads:
                t.start()
            if way == "sequential" and group is order[0]:
                for t in group_threads:  # the others start once runner 0 serves (it compiled first)
                    t.join()
            threads += group_threads
        for t in threads:
            t.join()
        cpu = sum(tree_cpu_s(r.proc.pid) for r in runners)
    finally:
        for r in runners:
            if r.proc is not None:
                stop_process(r.proc, grace_s=30)
    if errors:
        raise RuntimeError(f"{way}: {errors[0]}")
    return {"way": way, "runners": n, "first_token_s": round(min(r.first_token_s for r in runners), 2),
            "all_first_token_s": round(max(r.first_token_s for r in runners), 2),
            "all_compiled_s": round(max(r.compiled_s for r in runners), 2), "cpu_s": round(cpu, 1),
            "details": [r.detail for r in runners]}


def run_fleet(args, scratch: Path) -> dict:
    """The ``--fleet-ways`` (default: all), one after the other, on one prepared sidecar; then the
    compile CPU (against the ``warm`` way, where it ran)."""
    sidecars, shared = scratch / "sidecars", scratch / "kernel-cache-shared"
    prep = launch("prepare-sidecar", argparse.Namespace(**{**vars(args), "compile": "off"}), scratch / "prep-kc",
                  sidecars, scratch, measure=False)
    ways = {w: run_fleet_way(w, args, scratch, sidecars, shared) for w in FLEET_WAYS if w in args.fleet_ways}
    warm_cpu = ways["warm"]["cpu_s"] if "warm" in ways else None
    for w in ways.values():
        w["compile_cpu_s"] = None if warm_cpu is None else round(max(0.0, w["cpu_s"] - warm_cpu), 1)
    return {"model": MODEL, "compile": args.compile, "dtype": args.dtype, "fleet": args.fleet, "threads_per_runner": 1,
            "sidecar_prepared_s": prep["wall_to_serving_s"], "ways": ways}


def fleet_markdown(result: dict) -> str:
    lines = [f"| {result['fleet']} runners, empty kernel cache | fleet's first token (s) | every runner's first "
             "token (s) | every runner compiled (s) | runner CPU (s) | compile CPU (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for w in result["ways"].values():
        lines.append(f"| {w['way']} | {w['first_token_s']:.1f} | {w['all_first_token_s']:.1f} | "
                     f"{w['all_compiled_s']:.1f} | {w['cpu_s']:.0f} | "
                     + ("—" if w["compile_cpu_s"] is None else f"{w['compile_cpu_s']:.0f}") + " |")
    return "\n".join(lines)


def run_launches(args, scratch: Path) -> dict:
    """Cold then warm from this checkout (and, with ``--against``, from that one, interleaved)."""
    repos = [("", REPO), *([("against-", Path(args.against).resolve())] if args.against else [])]
    launches: dict[str, dict] = {}
    if args.warm_only:
        base = Path(args.warm_only)
        launches["warm"] = launch("warm", args, base / "kernel-cache", base / "sidecars", scratch)
    off = args.off_beside and args.compile != "off"
    for kind in () if args.warm_only else ("cold", *(("off",) if off else ()), "warm"):
        if kind == "off":  # the eager baseline on this checkout's caches, loaded as long as its cold launch compiled
            base = scratch / "caches"
            launches["off"] = launch("off", argparse.Namespace(**{**vars(args), "compile": "off"}),
                                     base / "kernel-cache", base / "sidecars", scratch,
                                     eager_window_s=launches["cold"]["compile_window_s"] or 0.0)
            continue
        for tag, repo in repos:
            base = scratch / f"{tag}caches"
            base.mkdir(exist_ok=True)
            launches[f"{tag}{kind}"] = launch(f"{tag}{kind}", args, base / "kernel-cache", base / "sidecars",
                                              scratch, repo)
    cold, warm = launches.get("cold", {}), launches["warm"]
    off_gap, cold_gap = launches.get("off", {}).get("max_gap_while_compiling_s"), cold.get("max_gap_while_compiling_s")
    ratio = cold["compiled_s"] / warm["compiled_s"] if cold.get("compiled_s") and warm["compiled_s"] else None
    first = warm["first_over_steady"]
    return {"model": MODEL, "compile": args.compile, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
            "kv_cache_bytes": args.kv_cache_bytes, "threads": args.threads, "load": args.load,
            "max_tokens": args.max_tokens, "launches": launches,
            "compiled_cold_over_warm": _r(ratio, 2),
            "cold_gap_over_off_gap": _r(cold_gap / off_gap, 2) if cold_gap and off_gap else None,
            "target_gap_over_off_gap": TARGET_GAP_OVER_OFF,
            "compiled_parent_over_here": _r(launches["against-cold"]["compiled_s"] / cold["compiled_s"], 2)
            if args.against and cold.get("compiled_s") and launches["against-cold"].get("compiled_s") else None,
            "warm_first_over_steady": first, "target_first_over_steady": TARGET_FIRST_OVER_STEADY,
            "meets_first_request_target": first is not None and first <= TARGET_FIRST_OVER_STEADY}


def run_zygote_launches(args, scratch: Path) -> dict:
    """Warm launches on ``--warm-only``'s caches, ``runner serve`` started directly beside
    through a runner zygote started once before them, alternating, ``--zygote-rounds`` times
    each; every launch measured as :func:`launch` does, and the medians of each way."""
    from runner_service.zygote import connect

    base = Path(args.warm_only)
    (scratch / "home").mkdir(exist_ok=True)
    (scratch / "inductor").mkdir(exist_ok=True)
    env = dict(os.environ, WARMSERVE_HOME=str(scratch / "home"), TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
               PYTHONPATH=str(REPO))
    sock = scratch / "zygote.sock"
    with open(scratch / "zygote.log", "wb") as log:
        t0 = time.perf_counter()
        zyg = subprocess.Popen([*warmserve_command(), "runner", "zygote", "--socket", str(sock)], env=env,
                               stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            connect(sock, args.timeout).close()
            zygote_ready_s = time.perf_counter() - t0
            launches = {}
            for r in range(args.zygote_rounds):
                for way in ("direct", "zygote"):
                    launches[f"{way}-{r + 1}"] = launch(f"{way}-{r + 1}", args, base / "kernel-cache",
                                                        base / "sidecars", scratch, env=env,
                                                        zygote=sock if way == "zygote" else None)
        finally:
            stop_process(zyg, grace_s=30)
    medians = {way: {key: _r(statistics.median(v[key] for k, v in launches.items() if k.startswith(way)))
                     for key in ("wall_to_serving_s", "first_token_s", "engine_total_s")}
               for way in ("direct", "zygote")}
    return {"model": MODEL, "compile": args.compile, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
            "threads": args.threads, "zygote_ready_s": _r(zygote_ready_s), "launches": launches, "medians": medians}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", choices=("aoti", "inductor", "off"), default="aoti")
    parser.add_argument("--dtype", choices=("auto", "f32", "bf16"), default="f32")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--threads", type=int, default=None, help="the runners' --threads (default: torch's)")
    parser.add_argument("--load", choices=("idle", "busy"), default="idle",
                        help="requests while the programs are pending: the first one only, or back to back")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored; the demo's default)")
    parser.add_argument("--steady", type=int, default=3, help="compiled requests after the first, for the steady rate")
    parser.add_argument("--against", default=None, metavar="DIR",
                        help="also launch from this checkout (e.g. the parent commit's worktree), interleaved")
    parser.add_argument("--off-beside", action=argparse.BooleanOptionalAction, default=True,
                        help="also launch a --compile off runner after the cold one(s), under the same load for as "
                             "long as the cold launch compiled (the baseline of the longest gap)")
    parser.add_argument("--warm-only", default=None, metavar="DIR",
                        help="only a warm launch, on DIR/kernel-cache and DIR/sidecars (a warmserve home, or the "
                             "caches/ of an earlier --keep DIR)")
    parser.add_argument("--zygote-rounds", type=int, default=0, metavar="N",
                        help="with --warm-only: N warm launches started directly and N through a runner zygote, "
                             "alternating (process start -> SERVING -> first token)")
    parser.add_argument("--log-level", default="WARNING", help="the runners' --log-level (their logs are under --keep DIR)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a launch may take to serve")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep caches and logs under DIR")
    parser.add_argument("--fleet", type=int, default=0, metavar="N",
                        help="measure N runners started on an empty kernel cache four ways instead")
    parser.add_argument("--fleet-ways", nargs="+", choices=FLEET_WAYS, default=list(FLEET_WAYS),
                        help="which of the fleet ways to run (single-flight must run before warm)")
    args = parser.parse_args()

    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="warmserve-startup-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        if args.zygote_rounds and not args.warm_only:
            parser.error("--zygote-rounds needs --warm-only DIR (caches a warm launch finds)")
        result = (run_fleet(args, scratch) if args.fleet else run_zygote_launches(args, scratch)
                  if args.zygote_rounds else run_launches(args, scratch))
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result, indent=2))
    print()
    print(fleet_markdown(result) if args.fleet else markdown(list(result["launches"].values())))
    if "medians" in result:
        print()
        print("| warm launch, medians (s) | SERVING | first token | engine phases |")
        print("|---|---:|---:|---:|")
        for way, m in result["medians"].items():
            print(f"| {way} | {m['wall_to_serving_s']:.2f} | {m['first_token_s']:.2f} | {m['engine_total_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
