"""The prefill token budget at the OpenAI door: `warmserve up --runners 1` with each
``--max-num-batched-tokens`` in turn, vLLM's serving benchmark as the client.

Per round, for each budget (the order alternates between rounds): start the stack on the
``bench/peers.py`` door home (its sidecar and kernel cache; a budget not compiled yet compiles
its prefill program once), then per concurrency one unrecorded warm-up run and one measured run
of :func:`peers.serve_bench` (random 128-token prompts, 128 new tokens, ``ignore_eos``,
``num_prompts`` = max(4, 2 x streams), all sent at once), then stop the stack. Prints one JSON document
(every run, and the medians per budget and concurrency), then a Markdown table: output tok/s,
TTFT, TPOT and inter-token latency (ms, p50 / p99). Needs the vLLM venv of ``make bench-peers``.

    python bench/prefill_budget.py --budgets 512,1024,2048 --concurrency 16,32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers  # noqa: E402  (bench/peers.py, beside this file)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=_int_list, default=[512, 2048], help="prefill budgets, tokens (512,2048)")
    p.add_argument("--concurrency", type=_int_list, default=[16], help="streams at the door (16)")
    p.add_argument("--rounds", type=int, default=2, help="measured runs per budget and concurrency (2)")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("WARMSERVE_BENCH_CACHE",
                                                                        Path.home() / ".cache" / "warmserve-bench")),
                   help="bench/peers.py's cache folder (default $WARMSERVE_BENCH_CACHE or ~/.cache/warmserve-bench)")
    args = p.parse_args()
    from warmserve.stack import LocalStack
    from warmserve.stack_auth import OPENAI_KEY_FILE, auth_dir
    from warmserve.stack_config import StackConfig

    home = args.cache / "warmserve-up" / "home"
    client = args.cache / "vllm-venv" / "bin" / "python"
    checkpoint = next(args.cache.glob("hf-smollm2-*"), None)
    if not home.is_dir() or not client.exists() or checkpoint is None:
        print(f"run `make bench-peers` (bench/peers.py --parts door) first: it makes {home}, {client} and the "
              "tokenizer's checkpoint", file=sys.stderr)
        return 2
    bench_args = types.SimpleNamespace(door_input_len=128, door_tokens=128, request_timeout=900)
    runs: list[dict] = []
    out = args.cache / "logs" / time.strftime("prefill-budget-%Y%m%d-%H%M%S")  # the client's logs and results
    for r in range(args.rounds):
        for budget in args.budgets if r % 2 == 0 else args.budgets[::-1]:
            cfg = StackConfig(runners=1, base_port=0, home=home, openai=True, openai_port=0, record_state=False,
                              served_model_name=peers.SERVED_NAME, max_num_batched_tokens=budget)
            with LocalStack(cfg, progress=None) as stack:
                stack.wait_programs(0, final=True)
                door = types.SimpleNamespace(port=stack.port("openai"),
                                             api_key=(auth_dir(home) / OPENAI_KEY_FILE).read_text().strip())
                for conc in args.concurrency:
                    for kind, seed in (("warm", 7), ("run", 100 * r + conc)):
                        result = peers.serve_bench(door, bench_args, vllm_python=client, tokenizer=checkpoint,
                                                   concurrency=conc, seed=seed,
                                                   out=out / f"{kind}-{budget}-c{conc}-r{r}.json")
                    if result.get("failed") or any(result.get(k) is None for k in peers.DOOR_FIGURES):
                        raise RuntimeError(f"budget {budget}, {conc} streams: {result.get('failed')} requests failed "
                                           f"or figures missing; the client's log is beside {out}")
                    rec = {k: result.get(k) for k in peers.DOOR_FIGURES}
                    rec.update(budget=budget, concurrency=conc, round=r, failed=result.get("failed"))
                    runs.append(rec)
                    print(f"round {r}, budget {budget}, {conc} streams: {rec['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {rec['median_ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
    medians = {}
    for budget in args.budgets:
        for conc in args.concurrency:
            recs = [x for x in runs if x["budget"] == budget and x["concurrency"] == conc]
            medians[f"{budget}/{conc}"] = {k: statistics.median(x[k] for x in recs) for k in peers.DOOR_FIGURES}
    print(json.dumps({"runs": runs, "medians": medians}, indent=2))
    print("\n| budget (tokens) | streams | output tok/s | TTFT ms p50 / p99 | TPOT ms p50 / p99 | ITL ms p50 / p99 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for key, m in medians.items():
        budget, conc = key.split("/")
        print(f"| {budget} | {conc} | {m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | "
              f"{m['median_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | {m['median_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
