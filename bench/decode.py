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
3. The decode program alone (``*_program`` rows): the same batch sizes at about the served runs'
   mean context, calling the installed decode callable on the persistent buffers with no
   scheduling, sampling or detokenizing; ``served_over_program`` is the served rate over it
   (1.0 = the serving path costs nothing).
4. Steady-state decode with ``--compile off`` vs compiled (``--compile-mode``, default ``aoti``)
   through :mod:`runner_service.programs`, using a kernel-cache directory (``--kernel-cache-dir``,
   default a temp dir: the first run compiles, later runs with the same dir hit). Skipped with
   ``--no-compiled``.
5. Prefix caching: time to first token (add the chat request, step the engine until its first
   token is out) of a request with a shared ~1,000-token system prompt (the first request: the
   prompt is not cached) vs a second request with the same system prompt and a different user
   message, on an eager engine with prefix caching on and on one with it off. Each run starts
   from an empty prefix cache; medians over ``--runs`` after one unmeasured warm-up round.
   Skipped with ``--no-prefix-caching``; ``--prefix-caching-only`` runs only this figure.

All contenders run in this one process with the same torch thread count (``--threads``; on a
shared 2-core host, 1 thread avoids OpenMP barrier stalls when another process takes a core).

Usage: ``python bench/decode.py [--tokens 32] [--runs 3] [--dtype f32] [--weights-dtype f32] [--threads 1]
[--no-compiled] [--no-hf] [--no-prefix-caching | --prefix-caching-only]``.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from runner_service.config import EngineConfig  # noqa: E402
from runner_service.decode_buffers import DecodeBuffers  # noqa: E402
from runner_service.engine import LLMEngine  # noqa: E402
from runner_service.sampling_params import SamplingParams  # noqa: E402
from weight_service.prepare import prepare  # noqa: E402
from weight_service.sources import bundled_smollm2_path  # noqa: E402

BATCHES = (1, 8, 32)
#: About the token count of a chat-less prompt below (for the program-only rate's context).
PROMPT_TOKENS = 12


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


def program_tps(engine: LLMEngine, batch: int, context: int, steps: int = 20) -> float:
    """Tokens/s of the decode program alone (what ``engine.runner.decode_fn`` runs: compiled or
    eager), without scheduling, sampling or detokenizing: ``batch`` rows, each decoding position
    ``context - 1`` over its own blocks, filled once into the persistent buffers; median of
    ``steps`` calls. The served rate over this rate is the serving path's share of a step. Run
    it on an idle engine: it writes K/V into blocks it does not own, so it empties the prefix
    cache first."""
    engine.block_manager.reset_prefix_cache()
    runner = engine.runner
    bs = runner.block_size
    per_seq = -(-context // bs)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    runner.buffers.fill([100 + i for i in range(batch)], [context - 1] * batch, tables)
    fn, views = runner.decode_fn(batch), runner.decode_views(batch, per_seq)
    times = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            fn(*views)
            times.append(time.perf_counter() - t0)
    runner.buffers.fill([], [], [])
    return batch / statistics.median(times[2:])


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


# -- 4. prefix caching ------------------------------------------------------------------------

SYSTEM_SENTENCES = [
    "You are the front-desk assistant of the Harbour Street public library.",
    "Answer politely and briefly, and always cite the section of this guide you rely on.",
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; the library is closed on Sundays.",
    "Members may borrow up to twelve items at a time for three weeks, renewable twice unless reserved.",
    "Late returns cost twenty cents per item per day, capped at the replacement price of the item.",
    "The reading room on the second floor is silent; group study rooms must be booked a day ahead.",
    "Children under ten must be accompanied by an adult in every area except the picture-book corner.",
    "Printing costs ten cents per black-and-white page and fifty cents per colour page.",
    "Lost cards are replaced once for free; later replacements cost two dollars each.",
    "Interlibrary loans take about two weeks and are free for members in good standing.",
]
USER_MESSAGES = ["Can I borrow fifteen books at once?", "How much does colour printing cost?",
                 "Is the library open on Sunday?", "My card is lost, what should I do?",
                 "How long does an interlibrary loan take?", "Can my eight-year-old stay alone upstairs?"]


def system_prompt(engine: LLMEngine, tokens: int = 1000) -> str:
    """A system prompt of about ``tokens`` tokens: the guide's sentences, numbered, repeated."""
    parts: list[str] = []
    while not parts or len(engine.tokenize(text=" ".join(parts))) < tokens:
        parts.append(f"({len(parts) + 1}) {SYSTEM_SENTENCES[len(parts) % len(SYSTEM_SENTENCES)]}")
    return " ".join(parts)


def ttft_s(engine: LLMEngine, messages: list[dict]) -> float:
    """Seconds from adding a greedy chat request to its first token (engine stepped here)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    stream = engine.add_request(params, messages=messages)
    while stream.queue.empty():
        engine.step()
    dt = time.perf_counter() - t0
    engine.run_until_done()
    return dt


def prefix_caching_ttft(sidecar: Path, dtype: str, runs: int) -> dict:
    """Figure 4: time to first token of a first and a second request sharing a ~1,000-token system
    prompt, prefix caching on vs off (milliseconds, medians over ``runs``)."""
    out: dict = {"ttft_ms": {}}
    for caching in (True, False):
        cfg = EngineConfig(max_num_seqs=2, max_model_len=2048, dtype=dtype, enable_prefix_caching=caching)
        engine = LLMEngine.from_sidecar(sidecar, cfg, model="smollm2-135m-instruct")
        system = system_prompt(engine)
        out["system_prompt_tokens"] = len(engine.tokenize(text=system))
        first, second = [], []
        for r in range(runs + 1):  # round 0 warms up
            engine.block_manager.reset_prefix_cache()
            a, b = USER_MESSAGES[(2 * r) % len(USER_MESSAGES)], USER_MESSAGES[(2 * r + 1) % len(USER_MESSAGES)]
            t1 = ttft_s(engine, [{"role": "system", "content": system}, {"role": "user", "content": a}])
            saved = engine.block_manager.prefix_hit_tokens
            t2 = ttft_s(engine, [{"role": "system", "content": system}, {"role": "user", "content": b}])
            if r:
                first.append(t1)
                second.append(t2)
                out.setdefault("second_tokens_saved", {})["on" if caching else "off"] = (
                    engine.block_manager.prefix_hit_tokens - saved)
        engine.close()
        f, s = statistics.median(first) * 1e3, statistics.median(second) * 1e3
        out["ttft_ms"]["on" if caching else "off"] = {"first": round(f, 1), "second": round(s, 1),
                                                      "first_over_second": round(f / s, 2)}
    out["second_on_vs_off"] = round(out["ttft_ms"]["off"]["second"] / out["ttft_ms"]["on"]["second"], 2)
    return out


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
    parser.add_argument("--no-prefix-caching", action="store_true", help="skip the prefix-caching figure")
    parser.add_argument("--prefix-caching-only", action="store_true", help="run only the prefix-caching figure")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every contender (default: torch's choice)")
    args = parser.parse_args()
    if args.no_prefix_caching and args.prefix_caching_only:
        parser.error("--no-prefix-caching and --prefix-caching-only exclude each other")
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="warmserve-bench-decode-")
    root = Path(args.sidecar_dir or Path(tmp.name) / "sidecars")
    sidecar = prepare(str(bundled_smollm2_path()), dtype=args.weights_dtype, root=root).path
    report: dict = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "weights_dtype": args.weights_dtype,
                    "tokens": args.tokens,
                    "runs": args.runs, "torch_threads": torch.get_num_threads(), "decode_tps": {}}

    if not args.prefix_caching_only:
        eager = _engine(sidecar, "off", None, args.dtype)
        report["startup_eager"] = eager.startup_report.line()
        for b in BATCHES:
            warmserve_decode_tps(eager, b, 4)  # first-shape warm-up
            report["decode_tps"].setdefault("warmserve_eager", {})[b] = _median_tps(
                lambda b=b: warmserve_decode_tps(eager, b, args.tokens), args.runs)
            report["decode_tps"].setdefault("warmserve_eager_program", {})[b] = round(
                program_tps(eager, b, PROMPT_TOKENS + args.tokens // 2), 1)
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
                    report["decode_tps"].setdefault(f"warmserve_{args.compile_mode}_program", {})[b] = round(
                        program_tps(compiled, b, PROMPT_TOKENS + args.tokens // 2), 1)
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

    if not args.no_prefix_caching:
        report["prefix_caching"] = prefix_caching_ttft(sidecar, args.dtype, args.runs)

    tps = report["decode_tps"]
    if "transformers" in tps:
        report["speedup_vs_transformers"] = {b: round(tps["warmserve_eager"][b] / tps["transformers"][b], 2)
                                             for b in BATCHES}
    for name in ("warmserve_eager", f"warmserve_{args.compile_mode}"):
        if f"{name}_program" in tps:
            report.setdefault("served_over_program", {})[name] = {
                b: round(tps[name][b] / tps[f"{name}_program"][b], 3) for b in BATCHES}
    key = f"warmserve_{args.compile_mode}"
    if key in tps:
        report["compiled_vs_eager"] = {b: round(tps[key][b] / tps["warmserve_eager"][b], 2) for b in BATCHES}
    print(json.dumps(report, indent=2))
    if tps:
        print()
        title = f"decode tokens/s ({args.weights_dtype} weights, {args.dtype} compute, greedy, {args.tokens} tokens)"
        print(f"| {title} | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
        print("|---|" + "---:|" * len(BATCHES))
        for name, row in tps.items():
            print(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in BATCHES) + " |")
    if "host_prepare" in report:
        print()
        print("| host prepare per decode step | persistent buffers (us) | rebuild each step (us) | ratio |")
        print("|---|---:|---:|---:|")
        for h in report["host_prepare"]:
            print(f"| batch {h['batch']} | {h['persistent_us']} | {h['rebuild_us']} | {h['ratio']}x |")
    if "prefix_caching" in report:
        pc = report["prefix_caching"]
        print()
        print(f"| time to first token, shared {pc['system_prompt_tokens']}-token system prompt (ms) "
              "| first request | second request | first / second |")
        print("|---|---:|---:|---:|")
        for mode in ("on", "off"):
            t = pc["ttft_ms"][mode]
            print(f"| prefix caching {mode} | {t['first']} | {t['second']} | {t['first_over_second']}x |")
    if isinstance(report.get("compiled"), str):
        print(f"\ncompiled: {report['compiled']}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
