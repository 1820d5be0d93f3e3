"""The machine's bounds for decoding the bundled model, and each measured figure as a fraction
of them: prints JSON, then Markdown tables.

Measured here, with ``--threads`` torch threads (default 2):

- **memory read bandwidth**: ``sum()`` over a float32 tensor far larger than the caches
  (``--bandwidth-mib``, default 1024), bytes / seconds, best of 7. One decode stream reads
  every weight once per token, so at batch 1 the bound is ``bandwidth / bytes per token``.
- **matmul FLOP/s**: a float32 and a bf16 ``[M, K] @ [K, N]`` with ``M = N = K = 2048``
  through oneDNN (:func:`model_families.linear.float_linear`, the serving path's matmul), ``2 M N
  K`` / seconds, best of 7. At batch 32 a step is mostly matmul, so the bound is ``FLOP/s /
  FLOPs per token``.

Per token of SmolLM2-135M (its GGUF's config; ``L`` layers, hidden ``H``, intermediate ``I``,
``nh``/``nkv`` heads of ``hd``, vocabulary ``V``, tied embeddings): the matrices hold
``P = L (H (nh + 2 nkv) hd + nh hd H + 3 H I) + V H`` weights (the tied ``lm_head`` counted once;
the embedding lookup reads one row). Bytes per token: ``4 P`` in f32, ``2 P`` in bf16, ``0.625
P`` in int4 (half a byte per weight plus a bf16 scale and zero per group of 32, the int4
kernel's layout); KV-cache reads are left out (under 2% at these contexts). FLOPs per token:
``2 P`` (attention's ``4 L nh hd c`` at context ``c`` left out: ~1% at ``c`` = 100). int4
compute runs on the bf16 units, so its batch-32 bound is bf16's.

``--rows 1,8,32,128,512,2048``: the time of one model step's layer matrices (``L`` layers of
``qkv``, ``o``, ``gate_up``, ``down``, each layer its own random matrices, so nothing stays in
cache that would not in a real step; ``lm_head`` left out, a prefill runs it on one row per
sequence) at each row count ``M`` (the step's tokens: the batch in a decode, every prompt token
in a prefill): bf16 matrices through the serving path's :func:`model_families.linear.linear`
(oneDNN), against the same matrices quantized (:func:`model_families.quantized_weights.quantized_weight`)
run by PyTorch's int4 weight-only kernel alone and by dequantize-then-matmul alone
(:func:`model_families.quantized_weights.int4_matmul` with ``dense_from`` 1 or never), and, where
it builds, by warmserve's kernel alone and its dequantize-then-matmul alone
(:func:`model_families.quantized_weights.int4_tiles_matmul`), best of 3. Shows where int4 stops
paying at larger ``M`` and where the serving path's ``INT4_DENSE_MIN_ROWS`` /
``INT4_TILES_DENSE_MIN_ROWS`` switch from the kernel to the dense matmul belongs.

``--peers FILE``: a ``bench/peers.py`` stdout (its JSON document) whose warmserve columns are
reported as fractions of these bounds (1 stream against the bandwidth bound, 32 against the
matmul bound).

Usage: ``python bench/bounds.py [--threads 2] [--rows 1,8,32,128,512,2048] [--peers peers.out]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from model_families import native, quant  # noqa: E402
from model_families.linear import float_linear, linear  # noqa: E402
from model_families.quantized_weights import (  # noqa: E402
    INT4_DENSE_MIN_ROWS,
    INT4_TILES_DENSE_MIN_ROWS,
    Int4TileWeight,
    Int4Weight,
    int4_matmul,
    int4_tiles_matmul,
)
from weight_service.gguf_reader import GGUFCheckpoint  # noqa: E402
from weight_service.sources import bundled_smollm2_path  # noqa: E402

#: Bytes per matrix weight in each weights dtype (int4: 4 bits + bf16 scale and zero per 32).
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "int4": 0.5 + 4 / 32}
#: The compute dtype whose matmul peak bounds each weights dtype at batch 32.
COMPUTE_DTYPE = {"f32": "f32", "bf16": "bf16", "int4": "bf16"}


def _best_s(fn, runs: int = 7) -> float:
    """Fastest of ``runs`` timed calls after one untimed (a bound is what the machine can do)."""
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth_gbs(mib: int) -> float:
    """Memory read bandwidth, GB/s (1e9 bytes): ``sum()`` over ``mib`` MiB of float32."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return x.numel() * 4 / _best_s(lambda: x.sum()) / 1e9


def matmul_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    """oneDNN matmul rate, GFLOP/s, for ``[n, n] @ [n, n]`` in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=g).to(dtype)
    w = torch.randn(n, n, generator=g).to(dtype)
    return 2 * n**3 / _best_s(lambda: float_linear(x, w)) / 1e9


def model_weights() -> dict:
    """Matrix weights per token of the bundled model (see the module docstring)."""
    c = GGUFCheckpoint(bundled_smollm2_path()).config
    h, hd, nh, nkv, inter = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    per_layer = h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter
    total = c.num_hidden_layers * per_layer + c.vocab_size * h
    return {"layers": c.num_hidden_layers, "matrix_weights": total,
            "layer_shapes": [((nh + 2 * nkv) * hd, h), (h, nh * hd), (2 * inter, h), (h, inter)]}


def step_matmul_ms(model: dict, rows: list[int]) -> list[dict]:
    """Per row count ``M``: ms of one step's layer matrices in bf16 and as int4 (see the module
    docstring), and their ratios."""
    g = torch.Generator().manual_seed(0)
    tiles = native.int4_tiles_enabled()
    layers = []
    for _ in range(model["layers"]):
        mats = [torch.randn(n, k, generator=g) * 0.02 for n, k in model["layer_shapes"]]
        parts = [quant.quantize_parts(m, "int4") for m in mats]
        layers.append([(m.to(torch.bfloat16), Int4Weight.from_parts(p, torch.bfloat16).matrix(),
                        Int4TileWeight.from_parts(p).matrix() if tiles else None) for m, p in zip(mats, parts, strict=True)])
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in model["layer_shapes"]}

        def step(xs: dict = xs) -> None:
            for layer in layers:
                for w, _, _ in layer:
                    linear(xs[w.shape[1]], w)

        def step_int4(dense_from: int, xs: dict = xs) -> None:
            for layer in layers:
                for w, q, _ in layer:
                    int4_matmul(xs[w.shape[1]], q.packed, quant.INT4_GROUP, q.scales_and_zeros, dense_from)

        def step_tiles(dense_from: int, xs: dict = xs, int8_activations: bool = False) -> None:
            for layer in layers:
                for w, _, t in layer:
                    int4_tiles_matmul(xs[w.shape[1]], t.tiles, quant.INT4_GROUP, t.scales_zeros, dense_from,
                                      int8_activations=int8_activations)

        bf16 = _best_s(step, 3) * 1e3
        int4, dense = _best_s(lambda: step_int4(2**62), 3) * 1e3, _best_s(lambda: step_int4(1), 3) * 1e3
        row = {"rows": m, "bf16_ms": round(bf16, 2), "int4_kernel_ms": round(int4, 2),
               "int4_dense_ms": round(dense, 2), "int4_kernel_over_bf16": round(int4 / bf16, 2),
               "int4_dense_over_kernel": round(dense / int4, 2)}
        if tiles:
            t_kernel, t_dense = _best_s(lambda: step_tiles(2**62), 3) * 1e3, _best_s(lambda: step_tiles(1), 3) * 1e3
            row.update({"tiles_kernel_ms": round(t_kernel, 2), "tiles_dense_ms": round(t_dense, 2),
                        "tiles_kernel_over_bf16": round(t_kernel / bf16, 2),
                        "int4_kernel_over_tiles_kernel": round(int4 / t_kernel, 2),
                        "served_by": "dense" if m >= INT4_TILES_DENSE_MIN_ROWS else "tiles kernel"})
            if native.int8_activations_enabled():  # --quantized-activations int8 (one kernel at every row count)
                a8 = _best_s(lambda: step_tiles(2**62, int8_activations=True), 3) * 1e3
                served = min(t_kernel, t_dense) if m >= INT4_TILES_DENSE_MIN_ROWS else t_kernel
                row.update({"tiles_a8_ms": round(a8, 2), "bf16_activations_over_a8": round(served / a8, 2)})
        else:
            row["served_by"] = "dense" if m >= INT4_DENSE_MIN_ROWS else "kernel"
        out.append(row)
    return out


def bounds(bandwidth_gbs: float, gflops: dict[str, float], weights: int) -> dict:
    """tok/s bounds per weights dtype: batch 1 from the bandwidth, batch 32 from the matmul rate."""
    out = {}
    for wd, bpw in BYTES_PER_WEIGHT.items():
        out[wd] = {
            "bytes_per_token": weights * bpw,
            "batch1_tok_s": bandwidth_gbs * 1e9 / (weights * bpw),
            "batch32_tok_s": gflops[COMPUTE_DTYPE[wd]] * 1e9 / (2 * weights),
        }
    return out


def peer_fractions(peers: dict, bound: dict) -> dict:
    """``{column: {"1": fraction, "32": fraction}}`` for the warmserve columns of a peers report."""
    out = {}
    for column, med in peers.get("median", {}).items():
        if not column.startswith("warmserve"):
            continue
        wd = column.split()[-1]
        if wd not in bound:
            continue
        row = {}
        if "1" in med:
            row["1"] = {"tok_s": med["1"]["decode_tps"], "fraction": med["1"]["decode_tps"] / bound[wd]["batch1_tok_s"]}
        if "32" in med:
            row["32"] = {"tok_s": med["32"]["decode_tps"],
                         "fraction": med["32"]["decode_tps"] / bound[wd]["batch32_tok_s"]}
        out[column] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as bench/peers.py)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="tensor size for the bandwidth probe")
    p.add_argument("--rows", default="1,8,32,128,512,2048",
                   help="row counts of the step-matmul table ('' to skip; default 1,8,32,128,512,2048)")
    p.add_argument("--peers", type=Path, default=None, help="a bench/peers.py stdout to rate against the bounds")
    args = p.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        rows = [0]
    if args.threads < 1 or args.bandwidth_mib < 64 or any(r < 1 for r in rows):
        p.error("--threads must be >= 1, --bandwidth-mib >= 64 and --rows positive integers")
    peers = None
    if args.peers is not None:
        try:
            peers = json.JSONDecoder().raw_decode(args.peers.read_text())[0]
        except (OSError, ValueError) as e:
            p.error(f"--peers {args.peers}: not a bench/peers.py output ({e})")
    torch.set_num_threads(args.threads)
    bw = read_bandwidth_gbs(args.bandwidth_mib)
    gflops = {"f32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    model = model_weights()
    bound = bounds(bw, gflops, model["matrix_weights"])
    report = {"threads": args.threads, "read_bandwidth_gbs": round(bw, 2),
              "matmul_gflops": {k: round(v, 1) for k, v in gflops.items()}, "model": model, "bounds": bound}
    if peers is not None:
        report["fractions"] = peer_fractions(peers, bound)
    if rows:
        report["step_matmul_ms"] = step_matmul_ms(model, rows)
    print(json.dumps(report, indent=2))
    print(f"\n| machine ({args.threads} threads) | value |\n|---|---:|")
    print(f"| memory read bandwidth | {bw:.1f} GB/s |")
    for k, v in gflops.items():
        print(f"| matmul 2048^3, {k} (oneDNN) | {v:.0f} GFLOP/s |")
    print(f"\n| bound ({model['matrix_weights'] / 1e6:.1f} M matrix weights) | MiB read per token | "
          "1 stream tok/s (bandwidth) | 32 streams tok/s (matmul) |\n|---|---:|---:|---:|")
    for wd, b in bound.items():
        print(f"| {wd} | {b['bytes_per_token'] / 2**20:.0f} | {b['batch1_tok_s']:.0f} | {b['batch32_tok_s']:.0f} |")
    if rows:
        tiles = "tiles_kernel_ms" in report["step_matmul_ms"][0]
        extra = (" warmserve kernel (ms) | warmserve dequantize + dense (ms) | PyTorch kernel / warmserve kernel |"
                 if tiles else "")
        a8 = "tiles_a8_ms" in report["step_matmul_ms"][0]
        extra += " warmserve kernel, int8 activations (ms) | bf16 activations (served) / int8 |" if a8 else ""
        print(f"\n| rows in the step | {model['layers']} layers' matrices, bf16 (ms) | PyTorch int4 kernel (ms) | "
              f"int4 dequantize + dense (ms) | kernel / bf16 | dense / kernel |{extra} served by (bf16 activations) |\n"
              f"|---:|---:|---:|---:|---:|---:|{'---:|' * (3 * tiles + 2 * a8)}---|")
        for r in report["step_matmul_ms"]:
            cells = (f" {r['tiles_kernel_ms']:.1f} | {r['tiles_dense_ms']:.1f} | {r['int4_kernel_over_tiles_kernel']:.2f} |"
                     if tiles else "")
            if "tiles_a8_ms" in r:
                cells += f" {r['tiles_a8_ms']:.1f} | {r['bf16_activations_over_a8']:.2f} |"
            print(f"| {r['rows']} | {r['bf16_ms']:.1f} | {r['int4_kernel_ms']:.1f} | {r['int4_dense_ms']:.1f} | "
                  f"{r['int4_kernel_over_bf16']:.2f} | {r['int4_dense_over_kernel']:.2f} |{cells} {r['served_by']} |")
    if peers is not None:
        print("\n| measured (bench/peers.py) | 1 stream tok/s | of bound | 32 streams tok/s | of bound |\n"
              "|---|---:|---:|---:|---:|")
        for column, row in report["fractions"].items():
            one, many = row.get("1"), row.get("32")
            cells = [f"{one['tok_s']:.1f} | {one['fraction']:.2f}" if one else "- | -",
                     f"{many['tok_s']:.1f} | {many['fraction']:.2f}" if many else "- | -"]
            print(f"| {column} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
