"""Decode benchmark on the bundled SmolLM2-135M-Instruct (or a tiny DeepSeek V4): prints JSON, then Markdown tables.

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

6. ``--model deepseek-v4``: figures 1-3 on a tiny random DeepSeek V4 checkpoint instead (f32
   only; the family has no prefix caching, so figure 5 is not run). The checkpoint is written by
   ``tests/deepseek_v4_tiny.write_tiny_deepseek_v4`` (release naming) with :data:`DSV4_CONFIG`:
   hidden 256, 8 layers (window-only, CSA, HCA, CSA, HCA, window-only, CSA, HCA), hc_mult 4,
   hash-routed MoE in layers 0-1 and learned top-k MoE after, 16 routed experts (2 per token) of
   width 128 plus 1 shared, 8 query heads of head_dim 64 (rope on the trailing 16 channels:
   partial_rotary_factor 0.25), q_lora_rank 128, 2 output groups of rank 64, indexer 16 heads x
   32 with top-8, sliding window 64, compression rates CSA 4 / HCA 128, vocabulary 128 (the
   writer's word tokenizer), about 16M parameters; it is packed by the weight service. Every
   request has the same ``--dsv4-prompt-tokens`` random token ids (default 120, so decode runs
   past the window and reaches the first HCA entry), so transformers needs no padding.
   Contenders: warmserve eager, warmserve compiled (``--compile-mode``, compiled once at engine
   start, kernel cache as in 4.; prefill stays eager for this family) and transformers'
   ``DeepseekV4ForCausalLM`` (the writer's float32 reference, ``generate(use_cache=True)``),
   measured as in 1.; within each run the contenders go round-robin (the starting contender
   rotates run to run), medians over ``--runs`` after a 4-token warm-up per batch. ``*_program``
   rows as in 3. (context ``prompt + tokens / 2``). Host prepare (figure 2) uses the family's ring
   layout (``FAMILY.block_layout(config, 16, 2048)``: the window ring's 8 blocks, then the
   compressed pools' growth) for both the persistent buffers and the rebuilt tensors (slots
   through ``layout.slot``).

All contenders run in this one process with the same torch thread count (``--threads``; on a
shared 2-core host, 1 thread avoids OpenMP barrier stalls when another process takes a core).

7. ``--batch-invariant``: figure 1 for the eager engine in batch-invariant mode
   (``warmserve_eager_batch_invariant``), and the mode's real-model check
   (:func:`batch_invariant_check`: token ids alone vs batched, chunked and cached; JSON
   ``batch_invariant_check.identical``).

8. ``--speculative-only``: speculative decoding. Completion tokens/s (greedy, EOS honoured, wall
   time from the first request to the last token, prefill included) of engines with
   ``--speculative off`` and ``ngram`` (``--num-speculative-tokens``, default 3; both compiled
   with ``--compile-mode`` unless ``--no-compiled``) on chats whose answers copy their prompt
   (:func:`copy_chats`) and on plain questions (:func:`plain_chats`), batch 1 / 8 / 32, the two
   interleaved in each run, medians over ``--runs``; the acceptance rate and the tokens a drafted
   row emits per step; whether every output was identical. Then the host time per verify step of
   the staging: persistent buffers vs tensors rebuilt each step (:func:`host_verify_prepare_us`).
   With ``--model deepseek-v4``: decode tokens/s (prefill excluded) of plain decoding vs
   ``--speculative mtp`` with the checkpoint's own MTP block and with forced-accept drafts (the
   block still runs; its drafts replaced by the plain run's next tokens), batch 1 / 8 / 32, eager
   and (unless ``--no-compiled``) compiled with ``--compile-mode`` (the decode program for plain
   decoding, the verify program returning the streams for ``mtp``) (:func:`dsv4_speculative_report`); then the long identity run (:func:`dsv4_long_identity`), and
   the host time per decode step of the MTP drafter's staging: persistent buffers vs tensors
   rebuilt each step (:func:`host_mtp_prepare_us`).

9. ``--structured-only``: structured output's cost. Decode tokens/s (greedy, EOS ignored, prefill
   steps excluded, as in 1.; compiled with ``--compile-mode`` unless ``--no-compiled``) at batch 1 / 8 / 32 with every row constrained by the JSON
   schema :data:`STRUCTURED_SCHEMA` (``SamplingParams.structured``: llguidance's mask filled and
   applied each step, the token consumed), half of them (batch 1: none), and none; the three
   interleaved in each run, medians over ``--runs``. A constrained row ends (STOP) when its JSON
   closes, so the rows end at different steps; the rate counts the tokens the decode steps
   emitted. Also the schema's compile time (first, then cached).

Usage: ``python bench/decode.py [--tokens 32] [--runs 3] [--dtype f32] [--weights-dtype f32] [--threads 1]
[--no-compiled] [--no-hf] [--batch-invariant] [--no-prefix-caching | --prefix-caching-only]``;
``python bench/decode.py --structured-only [--tokens 32] [--runs 3]``;
``python bench/decode.py --model deepseek-v4 [--tokens 32] [--runs 3] [--threads 1] [--dsv4-prompt-tokens 120]
[--no-compiled] [--no-hf]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from model_families.block_layout import BlockLayout  # noqa: E402
from model_families.dtypes import COMPUTE_DTYPES, WEIGHTS_DTYPES  # noqa: E402
from runner_service.config import EngineConfig  # noqa: E402
from runner_service.decode_buffers import DecodeBuffers  # noqa: E402
from runner_service.engine import LLMEngine  # noqa: E402
from runner_service.sampling_params import SamplingParams  # noqa: E402
from services.structured import StructuredSpec  # noqa: E402
from weight_service.prepare import prepare  # noqa: E402
from weight_service.sources import bundled_smollm2_path  # noqa: E402

BATCHES = (1, 8, 32)
#: About the token count of a chat-less prompt below (for the program-only rate's context).
PROMPT_TOKENS = 12


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} (#{i})" for i in range(n)]


# -- 1. throughput ----------------------------------------------------------------------------


def warmserve_decode_tps(engine: LLMEngine, batch: int, tokens: int,
                         token_prompts: list[list[int]] | None = None, structured: int = 0) -> float:
    """Decode tokens/s of ``batch`` concurrent greedy requests (prefill steps excluded; the
    tokens the decode steps emitted, a speculative step's accepted drafts included): the
    chat-less text prompts of :func:`_prompts`, or ``token_prompts`` (token ids) when given.
    The first ``structured`` rows are constrained by :data:`STRUCTURED_SCHEMA`."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    constrained = replace(params, structured=StructuredSpec("json_schema", json.dumps(STRUCTURED_SCHEMA)))
    if token_prompts is not None:
        for i, ids in enumerate(token_prompts[:batch]):
            engine.add_request(constrained if i < structured else params, token_ids=ids)
    else:
        for i, p in enumerate(_prompts(batch)):
            engine.add_request(constrained if i < structured else params, text=p)
    decode_s, decode_tokens = 0.0, 0
    while engine.has_work():
        engine._drain_inbox()
        is_decode = not engine.scheduler.waiting and bool(engine.scheduler.running)
        before = engine.generated_tokens_total
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if is_decode:
            decode_s += dt
            decode_tokens += engine.generated_tokens_total - before
    return decode_tokens / decode_s


def program_tps(engine: LLMEngine, batch: int, context: int, steps: int = 20) -> float:
    """Tokens/s of the decode program alone (what ``engine.runner.decode`` runs: compiled or
    eager), without scheduling, sampling or detokenizing: ``batch`` rows, each decoding position
    ``context - 1`` over its own blocks (as many as the runner's block layout needs), filled once
    into the persistent buffers; median of ``steps`` calls. The served rate over this rate is the
    serving path's share of a step. Run it on an idle engine: it writes K/V into blocks it does
    not own, so it empties the prefix cache first."""
    engine.block_manager.reset_prefix_cache()
    runner = engine.runner
    per_seq = runner.layout.blocks_needed(context)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    vocab = runner.args.vocab_size
    runner.buffers.fill([(100 + i) % vocab for i in range(batch)], [context - 1] * batch, tables)
    fn, views = runner.decode, runner.decode_views(batch, per_seq)
    times = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            fn(*views)
            times.append(time.perf_counter() - t0)
    runner.buffers.fill([], [], [])
    return batch / statistics.median(times[2:])


def hf_generate_tps(model, inputs: dict, tokens: int, pad_token_id: int) -> float:
    """transformers ``generate`` decode tokens/s of ``inputs`` (``input_ids`` [B, S] and
    ``attention_mask``): the ``tokens``-token run minus the 1-token run (its prefill and first
    token) -> B * (tokens - 1) / seconds."""
    batch = inputs["input_ids"].shape[0]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                           pad_token_id=pad_token_id)
        return time.perf_counter() - t0

    return batch * (tokens - 1) / max(run(tokens) - run(1), 1e-9)


def hf_decode_tps(model, tokenizer, batch: int, tokens: int) -> float:
    """transformers ``generate`` decode tokens/s on :func:`_prompts` (left-padded)."""
    enc = tokenizer(_prompts(batch), return_tensors="pt", padding=True)
    return hf_generate_tps(model, dict(enc), tokens, tokenizer.pad_token_id)


# -- 2. host prepare ----------------------------------------------------------------------------


class _Seq:
    def __init__(self, token: int, length: int, blocks: list[int]) -> None:
        self.token, self.length, self.blocks = token, length, blocks


def _trajectory(batch: int, steps: int, layout: BlockLayout):
    """Sequence states for ``steps`` decode steps: lengths grow by one, a block is appended
    whenever ``layout`` needs one more for the length (every ``block_size`` tokens in the paged
    layout; for a ring layout, past the ring, as its slowest compressed pool fills a block), ids
    from a shared counter, as a block manager would hand them out."""
    next_block = [1]

    def take(n):
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return out

    seqs = []
    for i in range(batch):
        length = 200 + 16 * i % 500
        seqs.append(_Seq(100 + i, length, take(layout.blocks_needed(length))))
    for _ in range(steps):
        for s in seqs:
            s.length += 1
            if len(s.blocks) < layout.blocks_needed(s.length):
                s.blocks.append(take(1)[0])
        yield seqs


def _rebuild(seqs, layout: BlockLayout):
    """Fresh tensors per step from Python lists (nano-vllm ``prepare_decode`` style); slots
    through ``layout`` (the ring slot of the position for a ring layout)."""
    input_ids = torch.tensor([s.token for s in seqs], dtype=torch.int64)
    positions = torch.tensor([s.length - 1 for s in seqs], dtype=torch.int64)
    slots = torch.tensor([layout.slot(s.blocks, s.length - 1) for s in seqs], dtype=torch.int64)
    seq_lens = torch.tensor([s.length for s in seqs], dtype=torch.int64)
    width = max(len(s.blocks) for s in seqs)
    tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.int64)
    return input_ids, positions, slots, tables, seq_lens


def host_prepare_us(batch: int, steps: int = 512, block_size: int = 16, layout: BlockLayout | None = None) -> dict:
    """Figure 2 for ``layout`` (default: the paged layout of ``block_size``): median microseconds
    per step of :meth:`DecodeBuffers.fill` + :meth:`DecodeBuffers.views` vs :func:`_rebuild` over
    a ``steps``-step :func:`_trajectory`; block tables sized for 2,048 tokens."""
    layout = layout or BlockLayout(block_size)
    persistent, rebuilt = [], []
    max_blocks = layout.blocks_needed(2048)
    buf = DecodeBuffers(batch, max_blocks, layout.block_size, num_blocks=1 << 20, layout=layout)
    for seqs in _trajectory(batch, steps, layout):
        t0 = time.perf_counter()
        buf.fill([s.token for s in seqs], [s.length - 1 for s in seqs], [s.blocks for s in seqs])
        buf.views(batch, min(max_blocks, max(len(s.blocks) for s in seqs)))
        t1 = time.perf_counter()
        _rebuild(seqs, layout)
        t2 = time.perf_counter()
        persistent.append((t1 - t0) * 1e6)
        rebuilt.append((t2 - t1) * 1e6)
    p, r = statistics.median(persistent), statistics.median(rebuilt)
    return {"batch": batch, "persistent_us": round(p, 1), "rebuild_us": round(r, 1), "ratio": round(r / p, 2),
            "row_builds_per_step": round(buf.row_builds / steps, 3)}


def _rebuild_verify(seqs, drafts, layout: BlockLayout):
    """A verify step's tensors rebuilt from Python lists: ids / positions / slots [B, 1 + K]
    (last token, then the drafts, then padding in the scratch slot), lens [B], tables [B, nb]."""
    width = 1 + max(len(d) for d in drafts)
    ids, pos, slots = [], [], []
    for s, d in zip(seqs, drafts, strict=True):
        p = [s.length - 1 + j for j in range(1 + len(d))]
        pad = width - len(p)
        ids.append([s.token, *d] + [0] * pad)
        pos.append(p + [0] * pad)
        slots.append([layout.slot(s.blocks, q) for q in p] + [0] * pad)
    lens = torch.tensor([s.length + len(d) for s, d in zip(seqs, drafts, strict=True)], dtype=torch.int64)
    nb = max(len(s.blocks) for s in seqs)
    tables = torch.tensor([s.blocks + [0] * (nb - len(s.blocks)) for s in seqs], dtype=torch.int64)
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64), tables, lens)


def host_verify_prepare_us(batch: int, k: int = 3, steps: int = 512, block_size: int = 16) -> dict:
    """Figure 8b: median microseconds per speculative verify step of
    :meth:`DecodeBuffers.fill_verify` + :meth:`DecodeBuffers.verify_views` vs
    :func:`_rebuild_verify`, over the :func:`_trajectory` of figure 2 with 0 .. ``k`` drafts per
    row (seeded), each row's blocks covering its drafts' positions."""
    layout = BlockLayout(block_size)
    g = torch.Generator().manual_seed(0)
    persistent, rebuilt = [], []
    max_blocks = layout.blocks_needed(2048 + k)
    buf = DecodeBuffers(batch, max_blocks, block_size, num_blocks=1 << 20, layout=layout, max_draft_tokens=k)
    extra = 1 << 19  # block ids for the drafts' positions, apart from the trajectory's
    for seqs in _trajectory(batch, steps, layout):
        drafts = [torch.randint(2, 1000, (int(torch.randint(0, k + 1, (), generator=g)),), generator=g).tolist()
                  for _ in seqs]
        for s, d in zip(seqs, drafts, strict=True):
            while len(s.blocks) < layout.blocks_needed(s.length + len(d)):
                s.blocks.append(extra)
                extra += 1
        t0 = time.perf_counter()
        buf.fill_verify([s.token for s in seqs], [s.length - 1 for s in seqs], [s.blocks for s in seqs], drafts)
        buf.verify_views()
        t1 = time.perf_counter()
        _rebuild_verify(seqs, drafts, layout)
        t2 = time.perf_counter()
        persistent.append((t1 - t0) * 1e6)
        rebuilt.append((t2 - t1) * 1e6)
    p, r = statistics.median(persistent), statistics.median(rebuilt)
    return {"batch": batch, "draft_tokens": k, "persistent_us": round(p, 1), "rebuild_us": round(r, 1),
            "ratio": round(r / p, 2)}


def _rebuild_mtp(hidden, ids, starts, tables, layout: BlockLayout, dtype: torch.dtype):
    """One MTP block step's inputs rebuilt from Python lists, as ``MtpDrafter`` staged them before
    its buffers (and still stages a long catch-up after a prefill chunk): streams [B, S, n, H]
    padded with zeros, ids, positions [B, S], tables [B, nb] (scratch past a row's blocks), lens [B]."""
    B, S = len(ids), max(len(t) for t in ids)
    h = torch.zeros((B, S, *hidden[0].shape[1:]), dtype=dtype)
    tok = torch.zeros((B, S), dtype=torch.int64)
    start = torch.tensor(starts, dtype=torch.int64)
    lens = start + torch.tensor([len(t) for t in ids])
    nb = max(max(len(t) for t in tables), layout.blocks_needed(int(lens.max())))
    bt = torch.zeros((B, nb), dtype=torch.int64)
    for r in range(B):
        n = len(ids[r])
        h[r, :n] = hidden[r]
        tok[r, :n] = torch.tensor(ids[r])
        bt[r, :len(tables[r])] = torch.tensor(tables[r])
    return h, tok, start[:, None] + torch.arange(S), bt, lens


def host_mtp_prepare_us(batch: int, k: int = 3, steps: int = 256, stream_shape: tuple[int, int] = (4, 256),
                        layout: BlockLayout | None = None) -> dict:
    """Figure 8c: median microseconds per decode step of the MTP drafter's staging (the ``1 + (k
    - 1)`` block steps of one decode step: the catch-up of each row's accepted drafts and bonus
    token, 1 .. ``1 + k`` positions from the verify step's streams [B, 1 + k, n, H], seeded; then
    ``k - 1`` one-position draft steps from the block's own output streams), in
    :class:`~runner_service.mtp.MtpBuffers` (:meth:`~runner_service.mtp.MtpBuffers.fill`) vs
    rebuilt each step (:func:`_rebuild_mtp`), over the :func:`_trajectory` of figure 2 (paged
    layout of 16 by default), float32 streams of ``stream_shape`` ``(n, H)``; the model is not run."""
    from runner_service.mtp import MtpBuffers

    layout = layout or BlockLayout(16)
    g = torch.Generator().manual_seed(0)
    max_blocks = layout.blocks_needed(2048 + k)
    buf = MtpBuffers(batch, 1 + k, stream_shape, max_blocks, num_blocks=1 << 20, layout=layout)
    streams = torch.randn(batch, 1 + k, *stream_shape, generator=g)
    out = torch.randn(batch, 1, *stream_shape, generator=g)
    rows, zeros = list(range(batch)), [0] * batch
    persistent, rebuilt = [], []
    with torch.inference_mode():
        for seqs in _trajectory(batch, steps, layout):
            counts = torch.randint(1, k + 2, (batch,), generator=g).tolist()
            ids = [list(range(100, 100 + n)) for n in counts]
            starts = [s.length - 1 - n for s, n in zip(seqs, counts, strict=True)]
            tables = [s.blocks for s in seqs]
            draft_ids, draft_starts = [[7] for _ in seqs], [s.length - 1 for s in seqs]
            t0 = time.perf_counter()
            buf.fill(streams, rows, zeros, ids, starts, tables)
            for j in range(1, k):
                buf.fill(out, rows, zeros, draft_ids, [p + j for p in draft_starts], tables)
            t1 = time.perf_counter()
            _rebuild_mtp([streams[i, :n] for i, n in enumerate(counts)], ids, starts, tables, layout, streams.dtype)
            for j in range(1, k):
                _rebuild_mtp([out[i, 0][None] for i in rows], draft_ids, [p + j for p in draft_starts], tables,
                             layout, out.dtype)
            t2 = time.perf_counter()
            persistent.append((t1 - t0) * 1e6)
            rebuilt.append((t2 - t1) * 1e6)
    p, r = statistics.median(persistent), statistics.median(rebuilt)
    return {"batch": batch, "draft_tokens": k, "stream_shape": list(stream_shape), "persistent_us": round(p, 1),
            "rebuild_us": round(r, 1), "ratio": round(r / p, 2)}


# -- 8. speculative decoding ------------------------------------------------------------------

#: Chat requests whose answers copy their prompt (quoting: where prompt-lookup drafts are right).
COPY_REQUEST = "Repeat this text exactly, with nothing before or after it: {} {}"


def copy_chats(n: int) -> list[list[dict]]:
    """``n`` chats asking to repeat two sentences of the library guide (figure 5's)."""
    k = len(SYSTEM_SENTENCES)
    return [[{"role": "user", "content": COPY_REQUEST.format(SYSTEM_SENTENCES[i % k], SYSTEM_SENTENCES[(i + 3) % k])}]
            for i in range(n)]


def plain_chats(n: int) -> list[list[dict]]:
    """``n`` chats whose answers copy little: figure 5's user questions."""
    return [[{"role": "user", "content": USER_MESSAGES[i % len(USER_MESSAGES)] + f" (#{i})"}] for i in range(n)]


def generation_tps(engine: LLMEngine, chats: list[list[dict]], tokens: int) -> tuple[float, list[list[int]]]:
    """Completion tokens/s of the ``chats`` run together (greedy, at most ``tokens`` each, EOS
    honoured), wall time from the first add to the last token (prefill included), and the
    token ids (to check that speculation changed none)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    t0 = time.perf_counter()
    streams = [engine.add_request(params, messages=m) for m in chats]
    engine.run_until_done()
    seconds = time.perf_counter() - t0
    outs = [s.result(timeout=0).token_ids for s in streams]
    return sum(len(o) for o in outs) / seconds, outs


def speculative_report(sidecar: Path, args, kernel_cache: str | None) -> dict:
    """Figure 8: tokens/s with ``--speculative off`` vs ``ngram`` (K = ``--num-speculative-tokens``)
    on the copying and the plain chats at batch 1 / 8 / 32, interleaved (off, ngram) per run,
    medians over ``--runs``; the ngram engine's acceptance; whether every output was identical."""
    mode = "off" if args.no_compiled else args.compile_mode
    engines = {"off": _engine(sidecar, mode, kernel_cache, args.dtype),
               "ngram": _engine(sidecar, mode, kernel_cache, args.dtype, speculative="ngram",
                                num_speculative_tokens=args.num_speculative_tokens)}
    out: dict = {"compile": mode, "num_speculative_tokens": args.num_speculative_tokens, "tps": {}, "identical": True,
                 "acceptance": {}}
    for kind, chats in (("copy", copy_chats), ("plain", plain_chats)):
        for b in BATCHES:
            for eng in engines.values():
                generation_tps(eng, chats(b), 4)  # warm-up of the shapes
            samples: dict[str, list[float]] = {name: [] for name in engines}
            before = engines["ngram"].spec_stats()
            for _ in range(args.runs):
                results = {name: generation_tps(eng, chats(b), args.tokens) for name, eng in engines.items()}
                for name, (tps, _) in results.items():
                    samples[name].append(tps)
                out["identical"] &= results["off"][1] == results["ngram"][1]
            after = engines["ngram"].spec_stats()
            drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            row = {name: round(statistics.median(v), 1) for name, v in samples.items()}
            row["ratio"] = round(row["ngram"] / row["off"], 2)
            out["tps"][f"{kind} batch {b}"] = row
            out["acceptance"][f"{kind} batch {b}"] = {
                "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else 0.0}
    for eng in engines.values():
        eng.close()
    out["host_verify_prepare"] = [host_verify_prepare_us(b, args.num_speculative_tokens) for b in (8, 32)]
    return out


def _print_speculative(report: dict) -> None:
    spec = report["speculative"]
    print()
    print(f"| tokens/s (compile {spec['compile']}, K={spec['num_speculative_tokens']}) | speculative off | ngram | "
          "ratio | acceptance rate | tokens per drafted step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in spec["tps"].items():
        acc = spec["acceptance"][name]
        print(f"| {name} | {row['off']} | {row['ngram']} | {row['ratio']}x | {acc['acceptance_rate']} | "
              f"{acc['mean_acceptance_length']} |")
    print(f"\noutputs identical with and without speculation: {spec['identical']}")
    print()
    print("| host prepare per verify step | persistent buffers (us) | rebuild each step (us) | ratio |")
    print("|---|---:|---:|---:|")
    for h in spec["host_verify_prepare"]:
        print(f"| batch {h['batch']}, up to {h['draft_tokens']} drafts | {h['persistent_us']} | {h['rebuild_us']} | "
              f"{h['ratio']}x |")


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


# -- 6. DeepSeek V4 (--model deepseek-v4) ----------------------------------------------------

_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

#: The ``--model deepseek-v4`` checkpoint: transformers ``DeepseekV4Config`` kwargs for
#: ``tests/deepseek_v4_tiny.write_tiny_deepseek_v4`` (random weights; see the module docstring).
DSV4_CONFIG = dict(
    vocab_size=128,  # the writer's word tokenizer: TOKENIZER_WORDS (127) words + [UNK]
    hidden_size=256, num_hidden_layers=8, hc_mult=4,
    layer_types=[_SWA, _CSA, _HCA, _CSA, _HCA, _SWA, _CSA, _HCA],
    mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6,
    n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
    num_attention_heads=8, head_dim=64, q_lora_rank=128, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=64,
    index_n_heads=16, index_head_dim=32, index_topk=8, sliding_window=64,
    compress_rates={_CSA: 4, _HCA: 128},
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    bos_token_id=1, eos_token_id=2, initializer_range=0.02, num_nextn_predict_layers=1,
)
DSV4_MAX_MODEL_LEN = 512


def write_dsv4_checkpoint(directory: Path):
    """Write the :data:`DSV4_CONFIG` checkpoint (release naming, float32) to ``directory``;
    returns the transformers ``DeepseekV4ForCausalLM`` reference it was drawn from (eval)."""
    sys.path.insert(0, str(REPO / "tests"))
    from deepseek_v4_tiny import TOKENIZER_WORDS, write_tiny_deepseek_v4

    assert DSV4_CONFIG["vocab_size"] == TOKENIZER_WORDS + 1, "vocab_size must match the writer's tokenizer"
    return write_tiny_deepseek_v4(directory, DSV4_CONFIG)


def dsv4_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """``batch`` random prompts of exactly ``length`` token ids (3 .. 126: no BOS/EOS/pad), all the
    same length so transformers needs no padding."""
    g = torch.Generator().manual_seed(seed)
    return [[int(t) for t in torch.randint(3, DSV4_CONFIG["vocab_size"] - 1, (length,), generator=g)]
            for _ in range(batch)]


def _dsv4_engine(sidecar: Path, compile_mode: str, kernel_cache: str | None, **extra) -> LLMEngine:
    # KV cache sized by the engine: all 32 sequences at full length fit (ring + compressed pools).
    cfg = EngineConfig(max_num_seqs=32, max_model_len=DSV4_MAX_MODEL_LEN, dtype="f32", compile=compile_mode, **extra)
    return LLMEngine.from_sidecar(sidecar, cfg, model="deepseek-v4-tiny", kernel_cache=kernel_cache)


class _ForcedDrafts:
    """The MTP drafter run as usual (its cost counted), its drafts then replaced by the next
    tokens of the plain run's ``output`` (every request has the same prompt): forced-accept drafts."""

    def __init__(self, inner, output: list[int]) -> None:
        self.inner, self.output = inner, output

    def propose(self, seqs) -> None:
        pass

    def observe(self, seqs, starts, lengths, streams) -> None:
        self.inner.observe(seqs, starts, lengths, streams)
        for seq in seqs:
            if seq.draft_token_ids:
                done = seq.num_completion_tokens
                seq.draft_token_ids = self.output[done:done + len(seq.draft_token_ids)]


def dsv4_speculative_report(sidecar: Path, args, kernel_cache: str | None = None) -> dict:
    """Figure 8 on DeepSeek V4: decode tokens/s (prefill excluded) of plain decoding vs
    ``--speculative mtp`` (K = ``--num-speculative-tokens``) with the checkpoint's own (random)
    MTP block and with forced-accept drafts, at batch 1 / 8 / 32, eager and, with
    ``kernel_cache``, compiled (``--compile-mode``; names suffixed with the mode), every engine
    interleaved per run, medians; the acceptance of each MTP engine; whether the greedy outputs
    were identical."""
    k = args.num_speculative_tokens
    modes = {"": ("off", None)} | ({f"_{args.compile_mode}": (args.compile_mode, kernel_cache)} if kernel_cache else {})
    engines = {}
    for suffix, (mode, kc) in modes.items():
        engines[f"off{suffix}"] = _dsv4_engine(sidecar, mode, kc)
        for name in ("mtp", "mtp_forced_accept"):
            engines[f"{name}{suffix}"] = _dsv4_engine(sidecar, mode, kc, speculative="mtp", num_speculative_tokens=k)
    if kernel_cache:
        for name, e in engines.items():
            if name.endswith(f"_{args.compile_mode}") and e.runner.decode_program is None:
                raise RuntimeError(f"{name}: no compiled programs ({e.startup_report.line()})")
    prompt = dsv4_prompts(1, args.dsv4_prompt_tokens, seed=1)[0]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    stream = engines["off"].add_request(params, token_ids=prompt)
    engines["off"].run_until_done()
    reference = stream.result(timeout=0).token_ids
    for suffix in modes:
        forced = engines[f"mtp_forced_accept{suffix}"]
        forced.drafter = _ForcedDrafts(forced.drafter, reference)
    out: dict = {"num_speculative_tokens": k, "modes": [m for m, _ in modes.values()], "tps": {}, "acceptance": {},
                 "identical": True, "verify_program": {
                     n: e.runner.verify_program is not None for n, e in engines.items() if n.startswith("mtp")}}
    for b in BATCHES:
        prompts = [prompt] * b
        for e in engines.values():
            warmserve_decode_tps(e, b, 4, prompts)
        before = {n: e.spec_stats() for n, e in engines.items() if n.startswith("mtp")}
        samples: dict[str, list[float]] = {n: [] for n in engines}
        for r in range(args.runs):
            names = list(engines)
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(warmserve_decode_tps(engines[name], b, args.tokens, prompts))
        row = {n: round(statistics.median(v), 1) for n, v in samples.items()}
        for suffix in modes:
            row.update({f"{n}{suffix}_ratio": round(row[f"{n}{suffix}"] / row[f"off{suffix}"], 2)
                        for n in ("mtp", "mtp_forced_accept")})
        out["tps"][f"batch {b}"] = row
        for n, was in before.items():
            now = engines[n].spec_stats()
            drafts = now["spec_decode_num_drafts"] - was["spec_decode_num_drafts"]
            drafted = now["spec_decode_num_draft_tokens"] - was["spec_decode_num_draft_tokens"]
            accepted = now["spec_decode_num_accepted_tokens"] - was["spec_decode_num_accepted_tokens"]
            out["acceptance"].setdefault(n, {})[f"batch {b}"] = {
                "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else 0.0}
    for e in engines.values():
        s = e.add_request(params, token_ids=prompt)
        e.run_until_done()
        out["identical"] &= s.result(timeout=0).token_ids == reference
    for e in engines.values():
        e.close()
    out["host_mtp_prepare"] = [host_mtp_prepare_us(b, k, stream_shape=(DSV4_CONFIG["hc_mult"],
                                                                        DSV4_CONFIG["hidden_size"]))
                               for b in (8, 32)]
    out["long_identity"] = dsv4_long_identity(sidecar, args.dsv4_identity_tokens)
    return out


def dsv4_long_identity(sidecar: Path, tokens: int) -> dict:
    """The long greedy identity run: 8 concurrent requests of 40 .. 110 prompt tokens, ``tokens``
    each, plain vs ``--speculative mtp`` at K = 1 .. 4: whether each K's output equals plain's."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 120, (40 + 10 * i,), generator=g).tolist() for i in range(8)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def run(**extra) -> list[list[int]]:
        engine = _dsv4_engine(sidecar, "off", None, **extra)
        streams = [engine.add_request(params, token_ids=p) for p in prompts]
        engine.run_until_done()
        engine.close()
        return [s.result(timeout=0).token_ids for s in streams]

    plain = run()
    return {"tokens": tokens, "requests": len(prompts),
            "identical": {f"K={k}": run(speculative="mtp", num_speculative_tokens=k) == plain for k in range(1, 5)}}


def deepseek_v4_report(args, tmp: Path) -> dict:
    """Figures 1-3 on the :data:`DSV4_CONFIG` checkpoint: decode tokens/s of warmserve eager,
    compiled and transformers at each batch (contenders round-robin within each run, the start
    rotated run to run; medians), the decode program alone, and host prepare on the family's
    ring layout."""
    from model_families.deepseek_v4 import FAMILY

    report: dict = {"model": "DeepSeek V4 (tiny, random weights)", "dtype": "f32", "weights_dtype": "f32",
                    "config": {k: v for k, v in DSV4_CONFIG.items() if k not in ("bos_token_id", "eos_token_id")},
                    "prompt_tokens": args.dsv4_prompt_tokens, "tokens": args.tokens, "runs": args.runs,
                    "torch_threads": torch.get_num_threads(), "decode_tps": {}}
    t0 = time.perf_counter()
    hf = write_dsv4_checkpoint(tmp / "dsv4-ckpt")
    report["checkpoint_s"] = round(time.perf_counter() - t0, 2)
    report["parameters"] = sum(p.numel() for p in hf.parameters())
    t0 = time.perf_counter()
    root = Path(args.sidecar_dir or tmp / "sidecars")
    sidecar = prepare(str(tmp / "dsv4-ckpt"), root=root).path
    report["prepare_s"] = round(time.perf_counter() - t0, 2)

    eager = _dsv4_engine(sidecar, "off", None)
    report["startup_eager"] = eager.startup_report.line()
    layout = eager.runner.layout
    report["layout"] = {"block_size": layout.block_size, "ring_blocks": getattr(layout, "ring_blocks", None),
                        "rates": list(getattr(layout, "rates", ())),
                        "max_blocks_per_seq": eager.runner.max_blocks_per_seq}
    engines = {"warmserve_eager": eager}
    if args.no_compiled:
        report["compiled"] = "skipped (--no-compiled)"
    else:
        kc = args.kernel_cache_dir or str(tmp / "kernel-cache")
        t0 = time.perf_counter()
        compiled = _dsv4_engine(sidecar, args.compile_mode, kc)
        report["compiled_startup_s"] = round(time.perf_counter() - t0, 2)
        report["compiled_startup"] = compiled.startup_report.line()
        if compiled.runner.decode_program is not None:
            engines[f"warmserve_{args.compile_mode}"] = compiled
        else:
            programs = next(p for p in compiled.startup_report.phases if p.name == "programs")
            report["compiled"] = f"unavailable: {programs.detail}; only eager reported"
            compiled.close()

    def served(engine):
        return lambda b, prompts, n: warmserve_decode_tps(engine, b, n, prompts)

    def transformers_tps(b, prompts, n):
        ids = torch.tensor(prompts)
        return hf_generate_tps(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, n, pad_token_id=0)

    contenders = {name: served(e) for name, e in engines.items()}
    if args.no_hf:
        report["transformers"] = "skipped (--no-hf)"
    else:
        contenders["transformers"] = transformers_tps
    names = list(contenders)
    for b in BATCHES:
        prompts = dsv4_prompts(b, args.dsv4_prompt_tokens, seed=b)
        for name in names:  # first-shape warm-up
            contenders[name](b, prompts, 4)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.runs):
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(contenders[name](b, prompts, args.tokens))
        for name in names:
            report["decode_tps"].setdefault(name, {})[b] = round(statistics.median(samples[name]), 1)
        for name, engine in engines.items():
            report["decode_tps"].setdefault(f"{name}_program", {})[b] = round(
                program_tps(engine, b, args.dsv4_prompt_tokens + args.tokens // 2), 1)

    # The family's ring layout, and the paged layout of the same block size for reference (figure 2
    # of the SmolLM2 run: same trajectory, wider tables, a row build every 16 tokens).
    ring = FAMILY.block_layout(eager.runner.args, 16, 2048)
    report["host_prepare"] = [{**host_prepare_us(b, layout=ring), "layout": "ring"} for b in (8, 32)]
    report["host_prepare"] += [{**host_prepare_us(b), "layout": "paged"} for b in (8, 32)]
    report["host_prepare_layout"] = (f"ring: {ring.ring_blocks} ring blocks x 16 tokens, compressed rates "
                                     f"{list(ring.rates)}; paged: the SmolLM2 layout, for reference; "
                                     "tables sized for 2048 tokens")
    for engine in engines.values():
        engine.close()

    tps = report["decode_tps"]
    if "transformers" in tps:
        report["speedup_vs_transformers"] = {
            name: {b: round(tps[name][b] / tps["transformers"][b], 2) for b in BATCHES} for name in engines}
    for name in engines:
        report.setdefault("served_over_program", {})[name] = {
            b: round(tps[name][b] / tps[f"{name}_program"][b], 3) for b in BATCHES}
    key = f"warmserve_{args.compile_mode}"
    if key in tps:
        report["compiled_vs_eager"] = {b: round(tps[key][b] / tps["warmserve_eager"][b], 2) for b in BATCHES}
    return report


# -- main -------------------------------------------------------------------------------------


def _engine(sidecar: Path, compile_mode: str, kernel_cache: str | None, dtype: str, **extra) -> LLMEngine:
    # KV cache sized by the engine: all 32 sequences at full length (512 tokens) fit.
    cfg = EngineConfig(max_num_seqs=32, max_model_len=512, dtype=dtype, compile=compile_mode, **extra)
    return LLMEngine.from_sidecar(sidecar, cfg, model="smollm2-135m-instruct", kernel_cache=kernel_cache)


def batch_invariant_check(sidecar: Path, dtype: str, tokens: int = 16, alone: int = 8) -> dict:
    """The real-model check of ``--batch-invariant``: greedy and seeded (every third) token ids of
    the first ``alone`` of 32 prompts (one shared opening, then :func:`_prompts`), each run alone
    on an empty prefix cache, against the same prompts run together with all 32 (prefill chunked
    at 64 tokens a step; the opening's blocks hit once a first wave of 4 has run)."""
    eng = _engine(sidecar, "off", None, dtype, batch_invariant=True, max_num_batched_tokens=64)

    def params(i: int) -> SamplingParams:
        if i % 3:
            return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)

    shared = "You are a careful assistant. Answer in one short paragraph, plainly, without lists. "
    prompts = [shared * 2 + p for p in _prompts(32)]  # a shared prefix of full blocks: cache hits
    single = []
    for i in range(alone):
        eng.block_manager.reset_prefix_cache()
        stream = eng.add_request(params(i), text=prompts[i])
        eng.run_until_done()
        single.append(stream.result(timeout=0).token_ids)
    eng.block_manager.reset_prefix_cache()
    first = list(range(alone, alone + 4))
    streams = {i: eng.add_request(params(i), text=prompts[i]) for i in first}
    eng.run_until_done()
    streams |= {i: eng.add_request(params(i), text=p) for i, p in enumerate(prompts) if i not in first}
    eng.run_until_done()
    together = [streams[i].result(timeout=0).token_ids for i in range(alone)]
    saved = eng.stats()["prefix_cache_tokens_saved"]
    eng.close()
    return {"prompts_compared": alone, "tokens_each": tokens, "identical": single == together,
            "prefix_cache_tokens_saved": saved}


#: Figure 9's schema: an object whose array of short notes keeps a row generating for a while.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 6, "maxItems": 12},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["topic", "notes", "confidence"], "additionalProperties": False}


def structured_report(sidecar: Path, args, kernel_cache: str | None) -> dict:
    """Figure 9: decode tokens/s with every row, half the rows and no row constrained by
    :data:`STRUCTURED_SCHEMA`, batch 1 / 8 / 32, interleaved per run, medians over ``--runs``;
    and the schema's compile time on the engine's tokenizer (first compile, then a cached one).
    Compiled (``--compile-mode``, programs from ``kernel_cache``) unless ``--no-compiled``."""
    from runner_service import structured as structured_module

    mode = "off" if kernel_cache is None else args.compile_mode
    eng = _engine(sidecar, mode, kernel_cache, args.dtype, background_compile=False)
    spec = StructuredSpec("json_schema", json.dumps(STRUCTURED_SCHEMA))
    t0 = time.perf_counter()
    eng.grammars.compile(spec)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.grammars.compile(spec)
    cached = time.perf_counter() - t0
    out: dict = {"engine": eng.runner.computed_by(), "compile_ms": {"first (tokenizer + grammar)": round(first * 1e3, 1),
                                "cached": round(cached * 1e3, 3)},
                 "json_options": structured_module.JSON_OPTIONS, "tps": {}}
    for b in BATCHES:
        shares = {"none": 0, "half": b // 2, "all": b}
        for n in shares.values():
            warmserve_decode_tps(eng, b, 4, structured=n)  # warm-up of the shapes
        samples: dict[str, list[float]] = {name: [] for name in shares}
        for _ in range(args.runs):
            for name, n in shares.items():
                samples[name].append(warmserve_decode_tps(eng, b, args.tokens, structured=n))
        row = {name: round(statistics.median(v), 1) for name, v in samples.items()}
        row["all_over_none"] = round(row["all"] / row["none"], 3)
        out["tps"][f"batch {b}"] = row
    eng.close()
    return out


def _print_structured(report: dict) -> None:
    st = report["structured"]
    print(f"\ncompile: {json.dumps(st['compile_ms'])} ms; JSON options {json.dumps(st['json_options'])}")
    print(f"\n| decode tokens/s ({st['engine']}, JSON schema) | no row constrained | half the rows | every row | every / none |")
    print("|---|---:|---:|---:|---:|")
    for name, row in st["tps"].items():
        print(f"| {name} | {row['none']} | {row['half']} | {row['all']} | {row['all_over_none']}x |")


def _median_tps(fn, runs: int) -> float:
    return round(statistics.median(fn() for _ in range(runs)), 1)


def _print_tables(report: dict, title: str, host_title: str) -> None:
    """The Markdown tables of figures 1-3: tokens/s per contender and batch, then host prepare."""
    tps = report["decode_tps"]
    if tps:
        print()
        print(f"| {title} | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
        print("|---|" + "---:|" * len(BATCHES))
        for name, row in tps.items():
            print(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in BATCHES) + " |")
    if "host_prepare" in report:
        print()
        print(f"| {host_title} | persistent buffers (us) | rebuild each step (us) | ratio |")
        print("|---|---:|---:|---:|")
        for h in report["host_prepare"]:
            label = f"batch {h['batch']}" + (f", {h['layout']} layout" if "layout" in h else "")
            print(f"| {label} | {h['persistent_us']} | {h['rebuild_us']} | {h['ratio']}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per sequence (default 32)")
    parser.add_argument("--runs", type=int, default=3, help="runs per median (default 3)")
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES, default="f32", help="compute dtype (default f32)")
    parser.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default="f32",
                        help="warmserve's sidecar dtype (default f32)")
    parser.add_argument("--sidecar-dir", default=None, help="sidecar root (default: a temp dir)")
    parser.add_argument("--kernel-cache-dir", default=None, help="kernel cache for compiled programs")
    parser.add_argument("--compile-mode", choices=("aoti", "inductor"), default="aoti")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled comparison")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also measure the eager engine in batch-invariant mode and check its tokens alone vs batched")
    parser.add_argument("--no-prefix-caching", action="store_true", help="skip the prefix-caching figure")
    parser.add_argument("--prefix-caching-only", action="store_true", help="run only the prefix-caching figure")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every contender (default: torch's choice)")
    parser.add_argument("--model", choices=("smollm2", "deepseek-v4"), default="smollm2",
                        help="smollm2: the bundled SmolLM2-135M-Instruct (default); deepseek-v4: a tiny random "
                             "DeepSeek V4 checkpoint (figures 1-3 only, f32)")
    parser.add_argument("--dsv4-prompt-tokens", type=int, default=120,
                        help="prompt length of every DeepSeek V4 request (default 120: decode runs past the "
                             "64-token window and reaches the first 128-token HCA entry)")
    parser.add_argument("--speculative-only", action="store_true",
                        help="run only figure 8: speculative decoding off vs ngram (compiled unless --no-compiled); "
                             "with --model deepseek-v4: off vs mtp (eager), real and forced-accept drafts")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="figure 8's K (default 3)")
    parser.add_argument("--structured-only", action="store_true",
                        help="run only figure 9: decode tokens/s with JSON-schema-constrained rows (all, half, none)")
    parser.add_argument("--dsv4-identity-tokens", type=int, default=300,
                        help="figure 8 with --model deepseek-v4: tokens per request of the long identity run "
                             "(default 300)")
    args = parser.parse_args()
    if args.no_prefix_caching and args.prefix_caching_only:
        parser.error("--no-prefix-caching and --prefix-caching-only exclude each other")
    if args.model == "deepseek-v4" and (args.prefix_caching_only or args.dtype != "f32" or args.weights_dtype != "f32"):
        parser.error("--model deepseek-v4 runs figures 1-3 in f32 only (the family has no prefix caching)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="warmserve-bench-decode-")
    if args.model == "deepseek-v4" and args.speculative_only:
        hf_dir = Path(tmp.name) / "dsv4-ckpt"
        write_dsv4_checkpoint(hf_dir)
        sidecar = prepare(str(hf_dir), root=Path(args.sidecar_dir or Path(tmp.name) / "sidecars")).path
        report = {"model": "DeepSeek V4 (tiny, random weights)", "tokens": args.tokens, "runs": args.runs,
                  "prompt_tokens": args.dsv4_prompt_tokens, "torch_threads": torch.get_num_threads(),
                  "speculative": dsv4_speculative_report(
                      sidecar, args, None if args.no_compiled else (args.kernel_cache_dir or
                                                                    str(Path(tmp.name) / "kernel-cache")))}
        print(json.dumps(report, indent=2))
        spec = report["speculative"]
        print(f"\n| DeepSeek V4 decode tokens/s (K={spec['num_speculative_tokens']}) | steps | off | mtp | ratio | "
              "mtp, forced-accept drafts | ratio |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, row in spec["tps"].items():
            for mode in spec["modes"]:
                sfx = "" if mode == "off" else f"_{mode}"
                print(f"| {name} | {'eager' if mode == 'off' else mode} | {row[f'off{sfx}']} | {row[f'mtp{sfx}']} | "
                      f"{row[f'mtp{sfx}_ratio']}x | {row[f'mtp_forced_accept{sfx}']} | "
                      f"{row[f'mtp_forced_accept{sfx}_ratio']}x |")
        print(f"\nacceptance: {json.dumps(spec['acceptance'])}\noutputs identical: {spec['identical']}")
        print(f"long identity run ({spec['long_identity']['requests']} requests x {spec['long_identity']['tokens']} "
              f"tokens, mtp vs plain): {spec['long_identity']['identical']}")
        print("\n| MTP staging per decode step (host) | persistent buffers (us) | rebuild each step (us) | ratio |")
        print("|---|---:|---:|---:|")
        for h in spec["host_mtp_prepare"]:
            print(f"| batch {h['batch']}, K={h['draft_tokens']} (1 + {h['draft_tokens'] - 1} block steps) | "
                  f"{h['persistent_us']} | {h['rebuild_us']} | {h['ratio']}x |")
        tmp.cleanup()
        return 0
    if args.model == "deepseek-v4":
        report = deepseek_v4_report(args, Path(tmp.name))
        print(json.dumps(report, indent=2))
        _print_tables(report, f"DeepSeek V4 tiny decode tokens/s (f32, greedy, {args.dsv4_prompt_tokens}-token "
                              f"prompts, {args.tokens} tokens)", "host prepare per decode step (DeepSeek V4)")
        for key in ("compiled", "transformers"):
            if isinstance(report.get(key), str):
                print(f"\n{key}: {report[key]}")
        tmp.cleanup()
        return 0
    root = Path(args.sidecar_dir or Path(tmp.name) / "sidecars")
    sidecar = prepare(str(bundled_smollm2_path()), dtype=args.weights_dtype, root=root).path
    report: dict = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "weights_dtype": args.weights_dtype,
                    "tokens": args.tokens,
                    "runs": args.runs, "torch_threads": torch.get_num_threads(), "decode_tps": {}}

    if args.structured_only:
        kc = None if args.no_compiled else (args.kernel_cache_dir or str(Path(tmp.name) / "kernel-cache"))
        report["structured"] = structured_report(sidecar, args, kc)
        print(json.dumps(report, indent=2))
        _print_structured(report)
        tmp.cleanup()
        return 0
    if args.speculative_only:
        kc = args.kernel_cache_dir or str(Path(tmp.name) / "kernel-cache")
        report["speculative"] = speculative_report(sidecar, args, kc)
        print(json.dumps(report, indent=2))
        _print_speculative(report)
        tmp.cleanup()
        return 0
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

        if args.batch_invariant:
            inv = _engine(sidecar, "off", None, args.dtype, batch_invariant=True)
            for b in BATCHES:
                warmserve_decode_tps(inv, b, 4)
                report["decode_tps"].setdefault("warmserve_eager_batch_invariant", {})[b] = _median_tps(
                    lambda b=b: warmserve_decode_tps(inv, b, args.tokens), args.runs)
            inv.close()
            report["batch_invariant_check"] = batch_invariant_check(sidecar, args.dtype)

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
            if compiled.runner.decode_program is None:
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
    title = f"decode tokens/s ({args.weights_dtype} weights, {args.dtype} compute, greedy, {args.tokens} tokens)"
    _print_tables(report, title, "host prepare per decode step")
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
