"""Decode benchmark on the bundled SmolLM2-135M-Instruct: prints JSON, then a Markdown table.

1. Decode throughput (tokens/s, greedy, float32 unless ``--dtype bf16``) at batch 1, 8 and 32:
   warmserve's engine (``--compile off``) vs transformers ``generate`` on the same weights
   (transformers loads the same GGUF, dequantized to the same dtype). ``--weights-dtype``
   picks warmserve's sidecar (default f32: the dequantized model; ``int4`` keeps the GGUF's Q4_1
   weights quantized and, with ``--dtype bf16``, runs PyTorch's int4 kernel). Both decode ``--tokens``
   tokens per sequence with EOS ignored. warmserve: total wall time of the decode steps
   (prefill steps excluded; sampling and detokenization included) -> B * steps / seconds.
   transformers: ``generate(max_new_tokens=N)`` minus ``generate(max_new_tokens=1)`` (its prefill
   and first token) -> B * (N - 1) / seconds. Medians over ``--runs``.
2. Host prepare time per decode step at batch 8 and 32: the persistent buffers
   (:meth:`DecodeBuffers.fill` on a live set of sequences whose block tables grow) vs building
   the step's tensors from Python lists each step (what nano-vllm's ``prepare_decode`` does).
   Microseconds, median over a 512-step trajectory (block size 16, contexts 200..700 tokens).
3. Steady-state decode with ``--compile off`` vs compiled (``--compile-mode``, default ``aoti``)
   through :mod:`runner_service.programs`, using a kernel-cache directory (``--kernel-cache-dir``,
   default a temp dir: the first run compiles, later runs with the same dir hit). Skipped with
   ``--no-compiled``.

All contenders run in this one process with the same torch thread count (``--threads``; on a
shared 2-core host, 1 thread avoids OpenMP barrier stalls when another process takes a core).

Usage: ``python bench/decode.py [--tokens 32] [--runs 3] [--dtype f32] [--weights-dtype f32] [--threads 1]
[--no-compiled]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from runner_service.config import EngineConfig  # noqa: E402
from runner_service.decode_buffers import DecodeBuffers  # noqa: E402
from runner_service.engine import LLMEngine  # noqa: E402
from runner_service.sampling_params import SamplingParams  # noqa: E402
from weight_service.prepare import prepare  # noqa: E402
from weight_service.sources import bundled_smollm2_path  # noqa: E402

BATCHES = (1, 8, 32)
PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about autumn leaves falling",
    "Explain how a refrigerator keeps food cold",
    "List three reasons why people enjoy hiking",
    "Describe the taste of a fresh strawberry",
    "What makes a good cup of coffee in the morning",
    "Summarize the plot of a detective story",
    "Give advice to someone learning to cook",
]


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} (#{i})" for i in range(n)]


# -- 1. throughput ----------------------------------------------------------------------------


def warmserve_decode_tps(engine: LLMEngine, batch: int, tokens: int) -> float:
    """Decode tokens/s of ``batch`` concurrent greedy requests (prefill steps excluded)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for p in _prompts(batch):
        engine.add_request(params, text=p)
    decode_s, decode_tokens = 0.0, 0
    while engine.has_work():
        engine._drain_inbox()
        is_decode = not engine.scheduler.waiting and bool(engine.scheduler.running)
        t0 = time.perf_counter()
        n = engine.step()
        dt = time.perf_counter() - t0
        if is_decode:
            decode_s += dt
            decode_tokens += n
    return decode_tokens / decode_s


def hf_decode_tps(model, tokenizer, batch: int, tokens: int) -> float:
    """transformers ``generate`` decode tokens/s (N-token run minus 1-token run)."""
    enc = tokenizer(_prompts(batch), return_tensors="pt", padding=True)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
        return time.perf_counter() - t0

    return batch * (tokens - 1) / max(run(tokens) - run(1), 1e-9)


# -- 2. host prepare ----------------------------------------------------------------------------


class _Seq:
    def __init__(self, token: int, length: int, blocks: list[int]) -> None:
        self.token, self.length, self.blocks = token, length, blocks


def _trajectory(batch: int, steps: int, block_size: int):
    """Sequence states for ``steps`` decode steps: lengths grow by one, a block is appended
    every ``block_size`` tokens (ids from a shared counter, as a block manager would hand out)."""
    next_block = [1]

    def take(n):
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return out

    seqs = []
    for i in range(batch):
        length = 200 + 16 * i % 500
        seqs.append(_Seq(100 + i, length, take(-(-length // block_size))))
    for _ in range(steps):
        for s in seqs:
            s.length += 1
            if len(s.blocks) * block_size < s.length:
                s.blocks.append(take(1)[0])
        yield seqs


def _rebuild(seqs, block_size: int):
    """Fresh tensors per step from Python lists (nano-vllm ``prepare_decode`` style)."""
    input_ids = torch.tensor([s.token for s in seqs], dtype=torch.int64)
    positions = torch.tensor([s.length - 1 for s in seqs], dtype=torch.int64)
    slots = torch.tensor([s.blocks[(s.length - 1) // block_size] * block_size + (s.length - 1) % block_size
                          for s in seqs], dtype=torch.int64)
    seq_lens = torch.tensor([s.length for s in seqs], dtype=torch.int64)
    width = max(len(s.blocks) for s in seqs)
    tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.int64)
    return input_ids, positions, slots, tables, seq_lens


def host_prepare_us(batch: int, steps: int = 512, block_size: int = 16) -> dict:
    persistent, rebuilt = [], []
    max_blocks = 2048 // block_size
    buf = DecodeBuffers(batch, max_blocks, block_size, num_blocks=1 << 20)
    for seqs in _trajectory(batch, steps, block_size):
        t0 = time.perf_counter()
        buf.fill([s.token for s in seqs], [s.length - 1 for s in seqs], [s.blocks for s in seqs])
        buf.views(batch, min(max_blocks, max(len(s.blocks) for s in seqs)))
        t1 = time.perf_counter()
        _rebuild(seqs, block_size)
        t2 = time.perf_counter()
        persistent.append((t1 - t0) * 1e6)
        rebuilt.append((t2 - t1) * 1e6)
    p, r = statistics.median(persistent), statistics.median(rebuilt)
    return {"batch": batch, "persistent_us": round(p, 1), "rebuild_us": round(r, 1), "ratio": round(r / p, 2),
            "row_builds_per_step": round(buf.row_builds / steps, 3)}


# -- main -------------------------------------------------------------------------------------


def _engine(sidecar: Path, compile_mode: str, kernel_cache: str | None, dtype: str) -> LLMEngine:
    # KV cache sized by the engine: all 32 sequences at full length (512 tokens) fit.
    cfg = EngineConfig(max_num_seqs=32, max_model_len=512, dtype=dtype, compile=compile_mode)
    return LLMEngine.from_sidecar(sidecar, cfg, model="smollm2-135m-instruct", kernel_cache=kernel_cache)


def _median_tps(fn, runs: int) -> float:
    return round(statistics.median(fn() for _ in range(runs)), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per sequence (default 32)")
    parser.add_argument("--runs", type=int, default=3, help="runs per median (default 3)")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32", help="compute dtype (default f32)")
    parser.add_argument("--weights-dtype", choices=("f32", "bf16", "int8", "int4"), default="f32",
                        help="warmserve's sidecar dtype (default f32)")
    parser.add_argument("--sidecar-dir", default=None, help="sidecar root (default: a temp dir)")
    parser.add_argument("--kernel-cache-dir", default=None, help="kernel cache for compiled programs")
    parser.add_argument("--compile-mode", choices=("aoti", "inductor"), default="aoti")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled comparison")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every contender (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="warmserve-bench-decode-")
    root = Path(args.sidecar_dir or Path(tmp.name) / "sidecars")
    sidecar = prepare(str(bundled_smollm2_path()), dtype=args.weights_dtype, root=root).path
    report: dict = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "weights_dtype": args.weights_dtype,
                    "tokens": args.tokens,
                    "runs": args.runs, "torch_threads": torch.get_num_threads(), "decode_tps": {}}

    eager = _engine(sidecar, "off", None, args.dtype)
    report["startup_eager"] = eager.startup_report.line()
    for b in BATCHES:
        warmserve_decode_tps(eager, b, 4)  # first-shape warm-up
        report["decode_tps"].setdefault("warmserve_eager", {})[b] = _median_tps(
            lambda b=b: warmserve_decode_tps(eager, b, args.tokens), args.runs)
    eager.close()

    report["host_prepare"] = [host_prepare_us(b) for b in (8, 32)]

    if args.no_compiled:
        report["compiled"] = "skipped (--no-compiled)"
    else:
        kc = args.kernel_cache_dir or str(Path(tmp.name) / "kernel-cache")
        t0 = time.perf_counter()
        compiled = _engine(sidecar, args.compile_mode, kc, args.dtype)
        report["compiled_startup_s"] = round(time.perf_counter() - t0, 2)
        report["compiled_startup"] = compiled.startup_report.line()
        programs = next(p for p in compiled.startup_report.phases if p.name == "programs")
        if not compiled.runner.decode_programs:
            report["compiled"] = f"unavailable: {programs.detail}; only eager reported"
        else:
            for b in BATCHES:
                warmserve_decode_tps(compiled, b, 4)
                report["decode_tps"].setdefault(f"warmserve_{args.compile_mode}", {})[b] = _median_tps(
                    lambda b=b: warmserve_decode_tps(compiled, b, args.tokens), args.runs)
        compiled.close()

    if not args.no_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = bundled_smollm2_path()
        dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, padding_side="left")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        for b in BATCHES:
            hf_decode_tps(hf, tok, b, 4)
            report["decode_tps"].setdefault("transformers", {})[b] = _median_tps(
                lambda b=b: hf_decode_tps(hf, tok, b, args.tokens), args.runs)

    tps = report["decode_tps"]
    if "transformers" in tps:
        report["speedup_vs_transformers"] = {b: round(tps["warmserve_eager"][b] / tps["transformers"][b], 2)
                                             for b in BATCHES}
    key = f"warmserve_{args.compile_mode}"
    if key in tps:
        report["compiled_vs_eager"] = {b: round(tps[key][b] / tps["warmserve_eager"][b], 2) for b in BATCHES}
    print(json.dumps(report, indent=2))
    print()
    title = f"decode tokens/s ({args.weights_dtype} weights, {args.dtype} compute, greedy, {args.tokens} tokens)"
    print(f"| {title} | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
    print("|---|" + "---:|" * len(BATCHES))
    for name, row in tps.items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in BATCHES) + " |")
    print()
    print("| host prepare per decode step | persistent buffers (us) | rebuild each step (us) | ratio |")
    print("|---|---:|---:|---:|")
    for h in report["host_prepare"]:
        print(f"| batch {h['batch']} | {h['persistent_us']} | {h['rebuild_us']} | {h['ratio']}x |")
    if isinstance(report.get("compiled"), str):
        print(f"\ncompiled: {report['compiled']}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
