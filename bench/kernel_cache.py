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
- peak RSS of the daemon and of this process, to show the artifact is never held in memory.

Lookups and the artifact runs are measured once per *variant* (``--variants``, default
``off,signatures``): ``off`` is unsigned entries and clients that verify nothing;
``signatures`` publishes with a signing key and reads with a trust list (every lookup answer's
signature checked, as a verifying runner would before a fetch; every fetch verified before a
byte is written). :data:`VARIANTS` is the hook for more (TLS on/off: a variant adds the
client's ``security``); ``overhead`` gives each variant's rates relative to ``off``.

Prints one JSON object, then a Markdown table. Everything (daemon, temp files) is cleaned up.
MB = 10^6 bytes.

    python bench/kernel_cache.py [--artifact-mb 200] [--clients 32] [--lookup-seconds 3] [--repeats 3]
                                 [--variants off,signatures]
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
from services.signing import SigningKey, TrustedKeys  # noqa: E402

MB = 1_000_000
KEY = ("bench.lookup", "hit")


def _variant_files(work: Path, name: str) -> dict:
    """Picklable description of a variant's clients: key file paths (``None``: not used)."""
    if name == "off":
        return {"signing_key": None, "trusted_keys": None}
    if name == "signatures":
        key_path, pub_path = SigningKey.generate().write(work / "keys", "bench")
        return {"signing_key": str(key_path), "trusted_keys": str(pub_path)}
    raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")


#: Variant name -> what it turns on (TLS on/off is added here as another variant).
VARIANTS = {"off": "unsigned entries, nothing verified",
            "signatures": "Ed25519-signed entries, every lookup answer and fetch verified"}


def client_for(address: str, files: dict, **kw) -> KernelCacheClient:
    """A client of ``address`` with the variant's keys (``files`` from :func:`_variant_files`)."""
    return KernelCacheClient(address, signing_key=SigningKey.load(files["signing_key"]) if files["signing_key"] else None,
                             trusted_keys=TrustedKeys.load(files["trusted_keys"]) if files["trusted_keys"] else None,
                             **kw)


def checked_lookup(client: KernelCacheClient, key: tuple[str, str]) -> None:
    """One lookup; a HIT's signature is verified when the client has trusted keys."""
    info = client.lookup(*key)
    if info is None:
        raise RuntimeError("expected a HIT")
    if client.trusted_keys is not None:
        client.trusted_keys.verify(info.signed_payload(), info.signature, "bench entry")


def start_daemon(root: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Run the daemon on a free loopback port; returns (process, address)."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmserve.cli", "cache", "serve", "--root", str(root), "--port", "0"],
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


def _lookup_worker(address: str, files: dict, key: tuple[str, str], ready, go, stop_at_holder, results) -> None:
    client = client_for(address, files)
    checked_lookup(client, key)  # connect before the clock starts
    ready.wait()
    go.wait()
    stop_at = stop_at_holder.value
    n = 0
    while time.time() < stop_at:
        checked_lookup(client, key)
        n += 1
    results.put((n, time.time()))
    client.close()


def bench_lookups(address: str, files: dict, key: tuple[str, str], clients: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(clients + 1), ctx.Barrier(clients + 1)
    stop_at = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = [ctx.Process(target=_lookup_worker, args=(address, files, key, ready, go, stop_at, results))
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
    single = client_for(address, files)
    latencies = []
    for _ in range(300):
        t = time.perf_counter()
        checked_lookup(single, key)
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


def bench_artifact(address: str, work: Path, files: dict, variant: str, size: int, repeats: int) -> dict:
    src = work / "artifact.bin"
    write_random(src, size)
    client = client_for(address, files, timeout_s=600)
    publish_s, fetch_s = [], []
    for i in range(repeats):
        t = time.perf_counter()
        status = client.publish("bench.artifact", f"{variant}-r{i}", src)
        publish_s.append(time.perf_counter() - t)
        if status != "PUBLISHED":
            raise RuntimeError(f"publish {i}: {status}")
        dest = work / f"fetched-{i}.bin"
        t = time.perf_counter()
        info = client.fetch("bench.artifact", f"{variant}-r{i}", dest)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact-mb", type=int, default=200)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--lookup-seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="off,signatures", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="warmserve-bench-kc-"))
    proc = None
    variants: dict[str, dict] = {}
    try:
        proc, address = start_daemon(work / "root", work / "daemon.log")
        (work / "small.bin").write_bytes(os.urandom(4096))
        for name in args.variants.split(","):
            files = _variant_files(work, name)
            key = (KEY[0], f"{KEY[1]}-{name}")
            client_for(address, files).publish(*key, work / "small.bin")
            variants[name] = {"what": VARIANTS[name],
                              "lookup": bench_lookups(address, files, key, args.clients, args.lookup_seconds),
                              "artifact": bench_artifact(address, work, files, name, args.artifact_mb * MB,
                                                         args.repeats)}
        memory = {"daemon_peak_rss_mb": round(peak_rss_mb(proc.pid), 1),
                  "bench_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB, 1)}
    finally:
        if proc is not None:
            stop_process(proc, grace_s=30)
        shutil.rmtree(work, ignore_errors=True)

    base = variants.get("off")
    overhead = {name: {"lookups_per_s": round(v["lookup"]["lookups_per_s"] / base["lookup"]["lookups_per_s"], 3),
                       "fetch_mb_per_s": round(v["artifact"]["fetch_mb_per_s"] / base["artifact"]["fetch_mb_per_s"], 3)}
                for name, v in variants.items() if base is not None and name != "off"}
    result = {"bench": "kernel_cache", "cpus": os.cpu_count(),
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "variants": variants,
              "overhead_vs_off": overhead, "memory": memory}
    print(json.dumps(result, indent=2))
    print()
    print("| metric | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))

    def row(label: str, fmt) -> None:
        print(f"| {label} | " + " | ".join(fmt(v) for v in variants.values()) + " |")

    row(f"lookups/s, {args.clients} concurrent client processes", lambda v: f"{v['lookup']['lookups_per_s']:.0f}")
    row("lookup latency, 1 client (median)", lambda v: f"{v['lookup']['single_client_median_ms']:.2f} ms")
    row(f"publish, {args.artifact_mb} MB artifact (median of {args.repeats})",
        lambda v: f"{v['artifact']['publish_mb_per_s']:.0f} MB/s")
    row(f"fetch, {args.artifact_mb} MB artifact (median of {args.repeats})",
        lambda v: f"{v['artifact']['fetch_mb_per_s']:.0f} MB/s")
    print(f"| daemon peak RSS | {memory['daemon_peak_rss_mb']:.0f} MB |")
    print(f"| bench process peak RSS | {memory['bench_peak_rss_mb']:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
