"""Weight-sidecar benchmark: prints JSON, then a Markdown table.

1. Cold pack: ``prepare()`` of the bundled SmolLM2 GGUF into an empty root (read + dequantize +
   un-permute + fuse + stack + write + fsync), float32 and bfloat16.
   For contrast, what a runner without a sidecar pays on every launch: GGUF read + dequantize +
   fuse + stack of the same tensors in memory (no write).
2. Hot load: ``load_sidecar()`` (validate + read-only shared mmap, zero-copy views) vs
   ``safetensors.torch.load_file`` of the same file (reads every byte into private memory), both
   with the file in the page cache; medians of N runs in one process, and their ratio. Also the
   hot ``prepare()`` path (validate + residency probe).
3. Memory: two processes each map the same sidecar and touch every page; ``/proc/PID/smaps``
   for that mapping and ``smaps_rollup`` for the process show the pages as shared, not private.
   The same with ``load_file`` for contrast (private anonymous copies).

Usage: ``python bench/weights.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from weight_service.loader import load_sidecar  # noqa: E402
from weight_service.prepare import prepare  # noqa: E402
from weight_service.sources import BUNDLED_SMOLLM2  # noqa: E402

KiB = 1024

_CHILD = r"""
import sys, time
mode, path = sys.argv[1], sys.argv[2]
if mode == "map":
    from weight_service.loader import load_sidecar
    sc = load_sidecar(path)
    tensors = sc.tensors
else:
    from safetensors.torch import load_file
    tensors = load_file(path + "/model.safetensors")
total = 0.0
for t in tensors.values():
    total += float(t.float().sum())  # touches every page (no copy for float32)
print("ready", flush=True)
sys.stdin.read()
"""


def _median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gguf_to_tensors() -> float:
    """Seconds to build the runner's float32 tensors straight from the GGUF, in memory."""
    import torch

    from model_families import family_for_architecture
    from weight_service.checkpoint import open_checkpoint, source_architecture
    from weight_service.sources import resolve_source

    t0 = time.perf_counter()
    src = resolve_source(BUNDLED_SMOLLM2)
    spec = family_for_architecture(source_architecture(src))
    ckpt = open_checkpoint(src)
    tensors = spec.global_tensors(ckpt)
    layers = [spec.layer_tensors(ckpt, i) for i in range(ckpt.config.num_hidden_layers)]
    tensors.update({name: torch.stack([layer[name] for layer in layers]) for name in layers[0]})
    ckpt.close()
    return time.perf_counter() - t0


def _smaps_for(pid: int, path: Path) -> dict[str, int]:
    """Sum of the smaps fields (KiB) over the mappings of ``path`` in process ``pid``."""
    fields: dict[str, int] = {}
    current = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping header line
            current = parts[-1] == str(path)
        elif current and len(parts) >= 2 and parts[0].endswith(":") and parts[-1] == "kB":
            fields[parts[0][:-1]] = fields.get(parts[0][:-1], 0) + int(parts[1])
    return fields


def _rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[-1] == "kB":
            out[parts[0][:-1]] = int(parts[1])
    return out


def _two_processes(mode: str, sidecar: Path) -> dict:
    """Start two children in ``mode`` ("map" or "load_file"), wait until both touched every page,
    read their memory, then stop them."""
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(sidecar)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        weights = sidecar / "model.safetensors"
        result = []
        for p in procs:
            roll, mapping = _rollup(p.pid), _smaps_for(p.pid, weights)
            result.append({
                "rss_mib": roll.get("Rss", 0) / KiB, "pss_mib": roll.get("Pss", 0) / KiB,
                "shared_mib": (roll.get("Shared_Clean", 0) + roll.get("Shared_Dirty", 0)) / KiB,
                "private_mib": (roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0)) / KiB,
                "anonymous_mib": roll.get("Anonymous", 0) / KiB,
                "sidecar_mapping_rss_mib": mapping.get("Rss", 0) / KiB,
                "sidecar_mapping_shared_mib": (mapping.get("Shared_Clean", 0) + mapping.get("Shared_Dirty", 0)) / KiB,
                "sidecar_mapping_private_mib": (mapping.get("Private_Clean", 0) + mapping.get("Private_Dirty", 0)) / KiB,
            })
        return {"processes": result}
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="runs per hot-load median (default 11)")
    args = parser.parse_args()
    from safetensors.torch import load_file

    report: dict = {"model": BUNDLED_SMOLLM2}
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        root = Path(tmp)
        for dtype in ("f32", "bf16"):
            h = prepare(BUNDLED_SMOLLM2, dtype=dtype, root=root / f"cold-{dtype}")
            assert h.state == "BUILT"
            report[f"cold_pack_{dtype}_s"] = h.seconds
            report[f"sidecar_{dtype}_bytes"] = h.size_bytes
        report["gguf_to_runner_tensors_s"] = _gguf_to_tensors()
        sidecar = prepare(BUNDLED_SMOLLM2, dtype="f32", root=root / "cold-f32").path
        weights = sidecar / "model.safetensors"

        def mapped():
            sc = load_sidecar(sidecar)
            assert len(sc.tensors) == 8
            sc.close()

        def copied():
            assert len(load_file(str(weights))) == 8

        mapped(), copied()  # warm the page cache and imports
        report["runs"] = args.runs
        report["hot_load_sidecar_median_s"] = _median_seconds(mapped, args.runs)
        report["hot_load_file_median_s"] = _median_seconds(copied, args.runs)
        report["load_file_over_sidecar_ratio"] = report["hot_load_file_median_s"] / report["hot_load_sidecar_median_s"]
        report["hot_prepare_median_s"] = _median_seconds(
            lambda: prepare(BUNDLED_SMOLLM2, dtype="f32", root=root / "cold-f32"), args.runs)
        report["two_process_map"] = _two_processes("map", sidecar)
        report["two_process_load_file"] = _two_processes("load_file", sidecar)

    print(json.dumps(report, indent=2))
    m, lf = report["two_process_map"]["processes"], report["two_process_load_file"]["processes"]
    rows = [
        ("cold pack f32 from GGUF (s)", f"{report['cold_pack_f32_s']:.2f}"),
        ("cold pack bf16 from GGUF (s)", f"{report['cold_pack_bf16_s']:.2f}"),
        ("no sidecar: GGUF -> runner tensors in memory (s)", f"{report['gguf_to_runner_tensors_s']:.2f}"),
        ("sidecar size f32 / bf16 (MiB)",
         f"{report['sidecar_f32_bytes'] / 2**20:.1f} / {report['sidecar_bf16_bytes'] / 2**20:.1f}"),
        (f"hot load_sidecar, median of {args.runs} (ms)", f"{report['hot_load_sidecar_median_s'] * 1e3:.2f}"),
        (f"hot safetensors load_file, median of {args.runs} (ms)", f"{report['hot_load_file_median_s'] * 1e3:.1f}"),
        ("load_file / load_sidecar", f"{report['load_file_over_sidecar_ratio']:.2f}x"),
        (f"hot prepare() (validate + residency), median of {args.runs} (ms)",
         f"{report['hot_prepare_median_s'] * 1e3:.2f}"),
    ]
    for label, procs in (("mapped", m), ("load_file", lf)):
        for i, p in enumerate(procs):
            rows.append((f"{label} process {i + 1}: RSS / shared / private (MiB)",
                         f"{p['rss_mib']:.0f} / {p['shared_mib']:.0f} / {p['private_mib']:.0f}"))
    for i, p in enumerate(m):
        rows.append((f"mapped process {i + 1}: sidecar mapping RSS / shared / private (MiB)",
                     f"{p['sidecar_mapping_rss_mib']:.0f} / {p['sidecar_mapping_shared_mib']:.0f} / "
                     f"{p['sidecar_mapping_private_mib']:.0f}"))
    print("\n| measure | value |\n|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
