"""The AOTI decode program built for a fixed thread count vs one that reads it at run time, on the
bundled SmolLM2-135M-Instruct: prints JSON, then a Markdown table.

``fixed-N``: the package as the runner builds it (:data:`runner_service.programs.aoti.AOTI_INDUCTOR_CONFIGS`,
Inductor's defaults: the code is planned for, and where N differs from the core count fixed to,
the N threads of the building process), built under N threads and run on N. ``dynamic``: with
``cpp.dynamic_threads`` (the code reads the thread count at run time) and ``cpp.threads`` = the
host's cores (the count its loops are planned for), built once and run on every thread count:
what a program key without the thread count would need. Each figure is the decode program alone (``bench/decode.py``'s
``program_tps``: the installed callable on the persistent buffers, no scheduling or sampling) at
batch 1, 8 and 32 over a ``--context``-token context, tokens/s, median over ``--runs`` interleaved
rounds of ``--steps`` calls each. The build seconds of each package are reported beside.

Usage: ``python bench/program_threads.py [--dtype bf16] [--threads 1 2] [--context 128] [--runs 3]``
(each build is one AOTI compile of the decode program, tens of seconds to minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from decode import program_tps  # noqa: E402

from model_families.dtypes import COMPUTE_DTYPES  # noqa: E402
from runner_service.config import EngineConfig  # noqa: E402
from runner_service.engine import LLMEngine  # noqa: E402
from runner_service.programs import aoti  # noqa: E402
from weight_service.prepare import prepare  # noqa: E402
from weight_service.sources import bundled_smollm2_path  # noqa: E402

BATCHES = (1, 8, 32)
#: The Inductor options of the fixed builds (the runner's), and of the thread-count-free build.
FIXED = dict(aoti.AOTI_INDUCTOR_CONFIGS)
DYNAMIC = {**FIXED, "cpp.dynamic_threads": True, "cpp.threads": os.cpu_count() or 1}


def build(engine: LLMEngine, configs: dict, threads: int, work: Path) -> tuple[aoti.AotiProgram, float]:
    """The decode package of ``engine``'s runner built with Inductor ``configs`` under ``threads``
    torch threads, loaded; and its build seconds."""
    torch.set_num_threads(threads)
    saved = aoti.AOTI_INDUCTOR_CONFIGS
    aoti.AOTI_INDUCTOR_CONFIGS = configs  # compile_aoti reads the module's options at the call
    try:
        spec = engine.runner.program_spec()
        t = time.perf_counter()
        package = aoti.compile_program(spec, "decode", work / f"decode-{len(list(work.iterdir()))}.pt2")
        seconds = time.perf_counter() - t
    finally:
        aoti.AOTI_INDUCTOR_CONFIGS = saved
    return aoti.AotiProgram(package, spec.decode_module, spec.device), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES, default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    parser.add_argument("--context", type=int, default=128, help="context tokens of every row (default 128)")
    parser.add_argument("--steps", type=int, default=20, help="program calls per figure (default 20)")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds per median (default 3)")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="warmserve-bench-threads-")
    work = Path(tmp.name)
    sidecar = prepare(str(bundled_smollm2_path()), dtype="f32", root=work / "sidecars").path
    cfg = EngineConfig(max_num_seqs=max(BATCHES), max_model_len=512, dtype=args.dtype, compile="off")
    engine = LLMEngine.from_sidecar(sidecar, cfg, model="smollm2-135m-instruct")
    (work / "programs").mkdir()
    programs, build_s = {}, {}
    for n in args.threads:
        programs[f"fixed-{n}"], build_s[f"fixed-{n}"] = build(engine, FIXED, n, work / "programs")
    programs["dynamic"], build_s["dynamic"] = build(engine, DYNAMIC, max(args.threads), work / "programs")
    runs = [(name, n) for n in args.threads for name in (f"fixed-{n}", "dynamic")]
    samples: dict[tuple[str, int], dict[int, list[float]]] = {r: {b: [] for b in BATCHES} for r in runs}
    for _ in range(args.runs):
        for name, n in runs:
            torch.set_num_threads(n)
            engine.runner.install_program("decode", programs[name])
            for b in BATCHES:
                samples[(name, n)][b].append(program_tps(engine, b, args.context, args.steps))
    engine.close()
    report = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "context": args.context, "runs": args.runs,
              "steps": args.steps, "cpu_count": DYNAMIC["cpp.threads"],
              "build_s": {k: round(v, 1) for k, v in build_s.items()},
              "decode_program_tps": {f"{name} @ {n} threads": {b: round(statistics.median(v), 1) for b, v in s.items()}
                                     for (name, n), s in samples.items()}}
    print(json.dumps(report, indent=2))
    print()
    print(f"| decode program tok/s ({args.dtype}, context {args.context}) | "
          + " | ".join(f"batch {b}" for b in BATCHES) + " |")
    print("|---|" + "---:|" * len(BATCHES))
    for label, row in report["decode_program_tps"].items():
        print(f"| {label} | " + " | ".join(f"{row[b]:.1f}" for b in BATCHES) + " |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
