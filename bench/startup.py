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
Prints one JSON document, then a Markdown table. Acceptance: ``cold / warm >= 10``.

Usage: ``python bench/startup.py [--compile aoti|inductor|off] [--max-num-seqs 8]
[--kv-cache-bytes 268435456] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from services.procs import stop_process  # noqa: E402
from services.proto import generation_pb2, generation_pb2_grpc  # noqa: E402

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
           "--dtype", args.dtype, "--log-level", "WARNING"]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", choices=("aoti", "inductor", "off"), default="aoti")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a launch may take to serve")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep caches and logs under DIR")
    args = parser.parse_args()

    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="warmserve-startup-"))
    scratch.mkdir(parents=True, exist_ok=True)
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
