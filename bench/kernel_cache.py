"""Kernel-cache daemon throughput over loopback gRPC.

Starts ``warmserve cache serve`` as a subprocess on 127.0.0.1 (free port, temp root), then
measures:

- **lookups/s** with N concurrent clients (default 32), each a separate *process* with its own
  channel (as N runner launches would be), all looking up one existing key for a fixed time;
  plus the median single-client lookup latency;
- **publish MB/s** and **fetch MB/s** for one artifact (default 200 MB of random bytes), end to
  end through :class:`KernelCacheClient` (publish = client-side sha256 pass + stream + daemon-side
  hash and rename; fetch = stream + daemon- and client-side sha256 + rename), median of
  ``--repeats`` runs, each with a new fingerprint / destination;
- peak RSS of the daemon and of this process, to show the artifact is never held in memory;
- TLS off vs on (:func:`bench_tls`): a second daemon serving mTLS beside the first, the
  lookups and one publish/fetch on each in turn, ``--repeats`` rounds: lookups/s and fetch MB/s
  with TLS off and on (``--no-tls`` skips it).

Prints one JSON object, then a Markdown table. Everything (daemon, temp files) is cleaned up.
MB = 10^6 bytes.

    python bench/kernel_cache.py [--artifact-mb 200] [--clients 32] [--lookup-seconds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernel_cache_service.client import KernelCacheClient  # noqa: E402
from services.procs import stop_process, wait_for_log_record  # noqa: E402

MB = 1_000_000
KEY = ("bench.lookup", "hit")


def start_daemon(root: Path, log: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Run the daemon on a free loopback port with ``extra`` flags; returns (process, address)."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmserve.cli", "cache", "serve", "--root", str(root), "--port", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
        )
    try:
        rec = wait_for_log_record(proc, log, "kernel cache ready", timeout_s=60)
    except RuntimeError:
        proc.kill()
        raise
    return proc, rec["address"]


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of a live process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return float("nan")


def _lookup_worker(address: str, ready, go, stop_at_holder, results, security=None) -> None:
    client = KernelCacheClient(address, security=security)
    client.lookup(*KEY)  # connect before the clock starts
    ready.wait()
    go.wait()
    stop_at = stop_at_holder.value
    n = 0
    while time.time() < stop_at:
        if client.lookup(*KEY) is None:
            raise RuntimeError("expected a HIT")
        n += 1
    results.put((n, time.time()))
    client.close()


def bench_lookups(address: str, clients: int, seconds: float, security=None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(clients + 1), ctx.Barrier(clients + 1)
    stop_at = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = [ctx.Process(target=_lookup_worker, args=(address, ready, go, stop_at, results, security))
             for _ in range(clients)]
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=300)  # every worker is connected and waiting
        start = time.time()
        stop_at.value = start + seconds
        go.wait(timeout=60)
        rows = [results.get(timeout=seconds + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    total = sum(n for n, _ in rows)
    elapsed = max(t for _, t in rows) - start
    single = KernelCacheClient(address, security=security)
    latencies = []
    for _ in range(300):
        t = time.perf_counter()
        single.lookup(*KEY)
        latencies.append(time.perf_counter() - t)
    single.close()
    return {"clients": clients, "client_kind": "processes", "seconds": round(elapsed, 3),
            "lookups": total, "lookups_per_s": round(total / elapsed, 1),
            "single_client_median_ms": round(statistics.median(latencies) * 1e3, 3)}


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 1 << 20)
            f.write(os.urandom(n))
            left -= n


def bench_artifact(address: str, work: Path, size: int, repeats: int, security=None, tag: str = "") -> dict:
    src = work / "artifact.bin"
    write_random(src, size)
    client = KernelCacheClient(address, timeout_s=600, security=security)
    publish_s, fetch_s = [], []
    for i in range(repeats):
        t = time.perf_counter()
        status = client.publish("bench.artifact", f"{tag}r{i}", src)
        publish_s.append(time.perf_counter() - t)
        if status != "PUBLISHED":
            raise RuntimeError(f"publish {i}: {status}")
        dest = work / f"fetched-{i}.bin"
        t = time.perf_counter()
        info = client.fetch("bench.artifact", f"{tag}r{i}", dest)
        fetch_s.append(time.perf_counter() - t)
        if info is None or dest.stat().st_size != size:
            raise RuntimeError(f"fetch {i} failed")
        dest.unlink()
    client.close()
    src.unlink()
    return {
        "artifact_mb": size / MB,
        "repeats": repeats,
        "publish_s": [round(s, 3) for s in publish_s],
        "fetch_s": [round(s, 3) for s in fetch_s],
        "publish_mb_per_s": round(size / MB / statistics.median(publish_s), 1),
        "fetch_mb_per_s": round(size / MB / statistics.median(fetch_s), 1),
    }


def bench_tls(work: Path, args, plain_address: str) -> dict:
    """TLS off vs on, interleaved so both see the same machine: a second daemon serving mTLS (a
    throw-away CA; every client presents a certificate) beside the plaintext one at
    ``plain_address``; ``args.repeats`` rounds, each measuring lookups then one publish and fetch
    on the plaintext daemon and then on the TLS one. Medians of lookups/s, single-client lookup
    latency (ms), publish and fetch MB/s, each off and on, and the change in %."""
    from services.channel import ClientSecurity
    from services.tls import make_dev_pki

    pki = make_dev_pki(work / "pki")
    security = ClientSecurity(tls=pki.files())
    proc, address = start_daemon(work / "root-tls", work / "daemon-tls.log",
                                 ("--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)))
    rows: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in
                                               ("lookups_per_s", "single_client_median_ms", "publish_mb_per_s",
                                                "fetch_mb_per_s")}
    try:
        KernelCacheClient(address, security=security).publish(*KEY, work / "small.bin")
        for i in range(args.repeats):
            for label, addr, sec in (("off", plain_address, None), ("on", address, security)):
                lookups = bench_lookups(addr, args.clients, args.lookup_seconds, sec)
                artifact = bench_artifact(addr, work, args.artifact_mb * MB, 1, sec, tag=f"tls{i}-")
                for key, value in (*((k, lookups[k]) for k in ("lookups_per_s", "single_client_median_ms")),
                                   *((k, artifact[k]) for k in ("publish_mb_per_s", "fetch_mb_per_s"))):
                    rows[key][label].append(value)
    finally:
        stop_process(proc, grace_s=30)
    out: dict[str, dict] = {"rounds": args.repeats}
    for key, values in rows.items():
        off, on = statistics.median(values["off"]), statistics.median(values["on"])
        out[key] = {"off": off, "on": on, "change_pct": round((on / off - 1) * 100, 1)}
    return out


def print_tls_rows(tls: dict) -> None:
    """The Markdown rows of :func:`bench_tls` (TLS off -> on, and the change)."""
    for key, what, unit in (("lookups_per_s", "lookups/s", ""), ("single_client_median_ms", "lookup latency", " ms"),
                            ("fetch_mb_per_s", "fetch", " MB/s"), ("publish_mb_per_s", "publish", " MB/s")):
        row = tls[key]
        print(f"| {what}, TLS off -> mTLS on (median of {tls['rounds']}, interleaved) | {row['off']:.4g}{unit} -> "
              f"{row['on']:.4g}{unit} ({row['change_pct']:+.1f}%) |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact-mb", type=int, default=200)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--lookup-seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-tls", dest="tls", action="store_false", help="skip the TLS on vs off comparison")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="warmserve-bench-kc-"))
    proc = None
    try:
        proc, address = start_daemon(work / "root", work / "daemon.log")
        (work / "small.bin").write_bytes(os.urandom(4096))
        KernelCacheClient(address).publish(*KEY, work / "small.bin")
        lookups = bench_lookups(address, args.clients, args.lookup_seconds)
        artifact = bench_artifact(address, work, args.artifact_mb * MB, args.repeats)
        memory = {"daemon_peak_rss_mb": round(peak_rss_mb(proc.pid), 1),
                  "bench_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB, 1)}
        tls = bench_tls(work, args, address) if args.tls else None
    finally:
        if proc is not None:
            stop_process(proc, grace_s=30)
        shutil.rmtree(work, ignore_errors=True)

    result = {"bench": "kernel_cache", "cpus": os.cpu_count(),
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "lookup": lookups, "artifact": artifact,
              "memory": memory, **({"tls": tls} if tls else {})}
    print(json.dumps(result, indent=2))
    print()
    print("| metric | value |")
    print("|---|---|")
    print(f"| lookups/s, {lookups['clients']} concurrent client processes | {lookups['lookups_per_s']:.0f} |")
    print(f"| lookup latency, 1 client (median) | {lookups['single_client_median_ms']:.2f} ms |")
    print(f"| publish, {artifact['artifact_mb']:.0f} MB artifact (median of {args.repeats}) | "
          f"{artifact['publish_mb_per_s']:.0f} MB/s |")
    print(f"| fetch, {artifact['artifact_mb']:.0f} MB artifact (median of {args.repeats}) | "
          f"{artifact['fetch_mb_per_s']:.0f} MB/s |")
    print(f"| daemon peak RSS | {memory['daemon_peak_rss_mb']:.0f} MB |")
    print(f"| bench process peak RSS | {memory['bench_peak_rss_mb']:.0f} MB |")
    if tls:
        print_tls_rows(tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
