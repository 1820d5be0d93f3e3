"""Build share: how a background build in a child process (``runner_service/programs/build_child.py``)
shares the CPU with an engine serving back-to-back requests (``docs/architecture.md`` §9).

One in-process engine per way (``LLMEngine.launch``, ``--threads`` torch threads, a random Llama
of the given shape: eager steps cost what a small real model's do), each with an empty kernel
cache and an empty Inductor cache, serving ``--streams`` back-to-back requests of
``--max-tokens`` tokens from launch until its programs are installed (or ``--limit`` seconds):

- ``off``: ``--compile off`` for ``--off-seconds``: the baseline gap between tokens;
- ``cede`` (the default share): the child at nice 0 confined to the CPUs the engine leaves; the
  engine steps on one thread fewer while it builds when its threads fill every core;
- ``nice``: the child at nice +10 beside the engine's threads, no thread ceded (the share of the
  in-process background compile before);
- ``fair``: the child at nice 0 beside them, no thread ceded.

Per way: ``installed_s`` (start-up to both programs installed, ``null`` past the limit),
``max_gap_s`` (the longest gap between two tokens of a stream while the build ran; for
``off`` the whole run), ``p50_gap_s``, ``tokens_per_s`` and ``gap_vs_off`` (``max_gap_s`` over
the ``off`` way's). Prints one JSON document, then a Markdown table.

Usage: ``python bench/build_share.py [--ways off,cede,nice,fair] [--threads 2] [--streams 2]
[--max-tokens 64] [--hidden 512] [--layers 4] [--limit 900]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import runner_service.engine as engine_module  # noqa: E402
from model_families.llama import FAMILY as LLAMA  # noqa: E402
from model_families.llama.config import LlamaConfig  # noqa: E402
from runner_service.config import EngineConfig  # noqa: E402
from runner_service.engine import LLMEngine  # noqa: E402
from runner_service.program_installer import ProgramInstaller  # noqa: E402
from runner_service.sampling_params import SamplingParams  # noqa: E402

WAYS = ("off", "cede", "nice", "fair")


def model_args(hidden: int, layers: int) -> LlamaConfig:
    heads = max(1, hidden // 64)
    return LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False,
                       bos_token_id=None, eos_token_id=[1], architecture="LlamaForCausalLM")


def run_way(way: str, args: argparse.Namespace, work: Path) -> dict:
    """One engine served back-to-back while it builds (see the module docstring)."""
    home = work / way
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home / "inductor")  # empty: a real compile (not in the key)
    os.environ["WARMSERVE_HOME"] = str(home / "home")
    share = "cede" if way == "off" else way
    engine_module.ProgramInstaller = functools.partial(ProgramInstaller, share=share)
    margs = model_args(args.hidden, args.layers)
    config = EngineConfig(max_num_seqs=4, max_model_len=512, block_size=16, kv_cache_bytes=64 << 20,
                          compile="off" if way == "off" else "aoti", background_compile=True, num_threads=args.threads,
                          warmup=True)
    weights = LLAMA.random_weights(margs, seed=0)
    t0 = time.perf_counter()
    eng = LLMEngine.launch(lambda: LLMEngine(margs, weights, config, kernel_cache=str(home / "kc")))
    stop = threading.Event()
    gaps: list[float] = []
    tokens = [0]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def client(i: int) -> None:
        while not stop.is_set():
            stream = eng.add_request(params, token_ids=[2 + (i * 7 + j) % 8000 for j in range(16)])
            last = None
            for delta in stream:
                now = time.perf_counter()
                if last is not None and eng.programs.state != "installed":
                    gaps.append(now - last)
                last = now
                tokens[0] += len(delta.token_ids)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
    for c in clients:
        c.start()
    limit = args.off_seconds if way == "off" else args.limit
    while time.perf_counter() - t0 < limit and (way == "off" or eng.programs.state == "pending"):
        time.sleep(0.2)
    served_s = time.perf_counter() - t0
    stop.set()
    for c in clients:
        c.join(timeout=120)
    result = {"way": way, "installed_s": eng.programs.installed_at_s if eng.programs.state == "installed" else None,
              "state": eng.programs.state, "detail": eng.programs.detail,
              "max_gap_s": max(gaps, default=None), "p50_gap_s": statistics.median(gaps) if gaps else None,
              "tokens_per_s": tokens[0] / served_s, "served_s": served_s}
    eng.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--limit", type=float, default=900.0, help="seconds a way may wait for its programs")
    p.add_argument("--off-seconds", type=float, default=60.0)
    args = p.parse_args()
    ways = args.ways.split(",")
    bad = [w for w in ways if w not in WAYS]
    if bad:
        p.error(f"--ways takes {', '.join(WAYS)}; got {bad[0]!r}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="build-share-") as tmp:
        results = [run_way(w, args, Path(tmp)) for w in ways]
    off = next((r["max_gap_s"] for r in results if r["way"] == "off"), None)
    for r in results:
        r["gap_vs_off"] = r["max_gap_s"] / off if off and r["max_gap_s"] else None
    print(json.dumps({"threads": args.threads, "streams": args.streams, "max_tokens": args.max_tokens,
                      "hidden": args.hidden, "layers": args.layers, "cpus": len(os.sched_getaffinity(0)),
                      "results": results}, indent=2))

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    print("\n| way | programs installed (s) | longest gap (s) | vs off | p50 gap (s) | tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['way']} | {f(r['installed_s'], '{:.1f}')} | {f(r['max_gap_s'])} | {f(r['gap_vs_off'])} | "
              f"{f(r['p50_gap_s'], '{:.3f}')} | {f(r['tokens_per_s'], '{:.1f}')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
