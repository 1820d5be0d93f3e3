"""Start-up benchmark: a cold launch with empty caches vs a warm launch that reuses them.

Launches ``warmserve runner serve --model smollm2-135m-instruct --compile MODE`` twice as
subprocesses, each with its own empty ``WARMSERVE_HOME`` and empty ``TORCHINDUCTOR_CACHE_DIR``:

1. **cold**: empty ``--kernel-cache-dir`` and empty ``--sidecar-dir``: the runner packs the
   sidecar from the GGUF and compiles the decode program (then publishes it);
2. **warm**: the *same* kernel-cache and sidecar directories (the sidecar is hot in the page
   cache, since the cold launch just wrote it): the runner validates the sidecar and loads the
   program from the kernel cache.

For each launch it measures the wall time from ``Popen`` to the gRPC health check answering
``SERVING`` (the runner starts its server only after the engine is built and warmed up), then
reads the runner's own phase breakdown through ``ModelInfo`` and sends SIGTERM.
Prints one JSON document, then a Markdown table. Acceptance: ``cold / warm >= 10``. These two
launches wait for their programs before serving (``--no-compile-in-background``), so the cold
figure is the whole compile.

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
[--kv-cache-bytes 268435456] [--keep DIR] [--fleet N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from services.ports import free_port  # noqa: E402
from services.procs import stop_process  # noqa: E402
from services.proto import generation_pb2, generation_pb2_grpc  # noqa: E402

MODEL = "smollm2-135m-instruct"



def warmserve_command() -> list[str]:
    """The ``warmserve`` console script next to this interpreter, else ``python -m warmserve.cli``."""
    script = Path(sys.executable).with_name("warmserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "warmserve.cli"]


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll the health service every 50 ms until ``SERVING``; raise if the process dies first."""
    deadline = time.monotonic() + timeout_s
    # Short reconnect backoff: gRPC's default (1 s, growing to 120 s) would add seconds between
    # the server starting and this probe noticing.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
               ("grpc.max_reconnect_backoff_ms", 100)]
    with grpc.insecure_channel(address, options=options) as channel:
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


def launch(name: str, args, kernel_cache: Path, sidecars: Path, scratch: Path) -> dict:
    """One runner launch; returns its wall time to SERVING and its start-up phases."""
    home, inductor = scratch / f"home-{name}", scratch / f"inductor-{name}"
    home.mkdir()
    inductor.mkdir()
    port = free_port()
    cmd = [*warmserve_command(), "runner", "serve", "--model", MODEL, "--compile", args.compile,
           "--kernel-cache-dir", str(kernel_cache), "--sidecar-dir", str(sidecars), "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-bytes", str(args.kv_cache_bytes),
           "--dtype", args.dtype, "--log-level", "WARNING", "--no-compile-in-background"]
    env = dict(os.environ, WARMSERVE_HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(inductor))
    log_path = scratch / f"runner-{name}.log"
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            address = f"127.0.0.1:{port}"
            wait_serving(address, proc, args.timeout)
            wall = time.perf_counter() - t0
            with grpc.insecure_channel(address) as channel:
                info = generation_pb2_grpc.GenerationStub(channel).ModelInfo(
                    generation_pb2.ModelInfoRequest(), timeout=10)
        except Exception:
            sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
            raise
        finally:
            stop_process(proc, grace_s=60)
    phases = [{"name": p.name, "seconds": round(p.seconds, 3), "detail": p.detail} for p in info.startup.phases]
    return {"launch": name, "wall_to_serving_s": round(wall, 3), "engine_total_s": round(info.startup.total_seconds, 3),
            "compile_mode": info.compile_mode, "num_kv_blocks": info.num_kv_blocks, "phases": phases}


def markdown(cold: dict, warm: dict, ratio: float) -> str:
    names = [p["name"] for p in cold["phases"]]
    names += [p["name"] for p in warm["phases"] if p["name"] not in names]
    by = {r["launch"]: {p["name"]: p for p in r["phases"]} for r in (cold, warm)}
    lines = ["| phase | cold (s) | warm (s) | cold detail | warm detail |", "|---|---:|---:|---|---|"]
    for n in names:
        c, w = by["cold"].get(n, {}), by["warm"].get(n, {})
        lines.append(f"| {n} | {c.get('seconds', 0):.2f} | {w.get('seconds', 0):.2f} | {c.get('detail', '')} | "
                     f"{w.get('detail', '')} |")
    lines.append(f"| engine total | {cold['engine_total_s']:.2f} | {warm['engine_total_s']:.2f} | | |")
    lines.append(f"| **wall: process start -> SERVING** | **{cold['wall_to_serving_s']:.2f}** | "
                 f"**{warm['wall_to_serving_s']:.2f}** | | ratio **{ratio:.1f}x** |")
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
    """Every fleet way, one after the other, on one prepared sidecar; then the compile CPU."""
    sidecars, shared = scratch / "sidecars", scratch / "kernel-cache-shared"
    prep = launch("prepare-sidecar", argparse.Namespace(**{**vars(args), "compile": "off"}), scratch / "prep-kc",
                  sidecars, scratch)
    ways = {w: run_fleet_way(w, args, scratch, sidecars, shared) for w in FLEET_WAYS}
    warm_cpu = ways["warm"]["cpu_s"]
    for w in ways.values():
        w["compile_cpu_s"] = round(max(0.0, w["cpu_s"] - warm_cpu), 1)
    return {"model": MODEL, "compile": args.compile, "dtype": args.dtype, "fleet": args.fleet, "threads_per_runner": 1,
            "sidecar_prepared_s": prep["wall_to_serving_s"], "ways": ways}


def fleet_markdown(result: dict) -> str:
    lines = [f"| {result['fleet']} runners, empty kernel cache | fleet's first token (s) | every runner's first "
             "token (s) | every runner compiled (s) | runner CPU (s) | compile CPU (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for w in result["ways"].values():
        lines.append(f"| {w['way']} | {w['first_token_s']:.1f} | {w['all_first_token_s']:.1f} | "
                     f"{w['all_compiled_s']:.1f} | {w['cpu_s']:.0f} | {w['compile_cpu_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", choices=("aoti", "inductor", "off"), default="aoti")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a launch may take to serve")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep caches and logs under DIR")
    parser.add_argument("--fleet", type=int, default=0, metavar="N",
                        help="measure N runners started on an empty kernel cache four ways instead")
    args = parser.parse_args()

    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="warmserve-startup-"))
    scratch.mkdir(parents=True, exist_ok=True)
    if args.fleet:
        try:
            result = run_fleet(args, scratch)
        finally:
            if not args.keep:
                shutil.rmtree(scratch, ignore_errors=True)
        print(json.dumps(result, indent=2))
        print()
        print(fleet_markdown(result))
        return 0
    kernel_cache, sidecars = scratch / "kernel-cache", scratch / "sidecars"
    try:
        cold = launch("cold", args, kernel_cache, sidecars, scratch)
        warm = launch("warm", args, kernel_cache, sidecars, scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    ratio = cold["wall_to_serving_s"] / warm["wall_to_serving_s"]
    result = {"model": MODEL, "compile": args.compile, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
              "kv_cache_bytes": args.kv_cache_bytes, "cold": cold, "warm": warm,
              "ratio_cold_over_warm": round(ratio, 2), "target_ratio": 10.0, "meets_target": ratio >= 10.0}
    print(json.dumps(result, indent=2))
    print()
    print(markdown(cold, warm, ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
