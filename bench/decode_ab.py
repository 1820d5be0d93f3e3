"""Unconstrained decode tokens/s of this checkout against another, interleaved by process.

Each round starts one process per checkout, alternating (``--ref`` first): the process loads the
bundled SmolLM2 as an int4 sidecar (``--sidecar-dir``), builds ``bench/decode.py``'s engine of
that checkout (compiled with AOTInductor from ``--kernel-cache-dir``, bf16, 2 threads) and takes
``--runs`` samples of :func:`decode.warmserve_decode_tps` at batch 1 / 8 / 32 (greedy, EOS
ignored, decode steps only). Prints one JSON document, then a Markdown table of the medians
and their ratio. Usage:

``python bench/decode_ab.py --ref DIR [--rounds 3] [--runs 3] [--tokens 64] --kernel-cache-dir K
--sidecar-dir S`` (``DIR``: a checkout, e.g. ``git worktree add DIR <commit>``). The first
round of each checkout compiles its programs when the kernel cache lacks them: run once with
``--rounds 1`` to warm it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCHES = (1, 8, 32)

#: The child's program: ``root runs tokens kc sidecars`` -> one ``RESULT {json}`` line.
_CHILD = r"""
import json, os, sys
root, runs, tokens, kc, sidecars = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path[:0] = [root, os.path.join(root, "bench")]
import torch
torch.set_num_threads(2)
import decode as D
from pathlib import Path
from weight_service.prepare import prepare
sidecar = prepare(str(D.bundled_smollm2_path()), dtype="int4", root=Path(sidecars)).path
eng = D._engine(sidecar, "aoti", kc, "bf16", background_compile=False)
out = {}
for b in (1, 8, 32):
    D.warmserve_decode_tps(eng, b, 4)
    out[b] = [D.warmserve_decode_tps(eng, b, tokens) for _ in range(runs)]
print("RESULT " + json.dumps({"tps": out, "computed_by": eng.runner.computed_by()}))
eng.close()
"""


def run_one(root: Path, args) -> dict:
    """One process of ``root``'s code; its samples (tokens/s per batch)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(args.runs), str(args.tokens),
                          args.kernel_cache_dir, args.sidecar_dir], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(root)), check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{root}: no result (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="the other checkout's directory")
    p.add_argument("--rounds", type=int, default=3, help="processes per checkout, alternating (default 3)")
    p.add_argument("--runs", type=int, default=3, help="samples per process and batch (default 3)")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per sequence (default 64)")
    p.add_argument("--kernel-cache-dir", required=True)
    p.add_argument("--sidecar-dir", required=True)
    args = p.parse_args()
    roots = {"ref": Path(args.ref).resolve(), "this": REPO}
    samples: dict[str, dict[str, list[float]]] = {k: {str(b): [] for b in BATCHES} for k in roots}
    engines = {}
    for _ in range(args.rounds):
        for name, root in roots.items():
            got = run_one(root, args)
            engines[name] = got["computed_by"]
            for b, values in got["tps"].items():
                samples[name][b] += values
    medians = {k: {b: round(statistics.median(v), 1) for b, v in s.items()} for k, s in samples.items()}
    print(json.dumps({"ref": str(roots["ref"]), "engines": engines, "samples": samples, "medians": medians},
                     indent=2))
    print(f"\n| decode tokens/s | ref ({roots['ref'].name}) | this | this / ref |")
    print("|---|---:|---:|---:|")
    for b in BATCHES:
        ref, this = medians["ref"][str(b)], medians["this"][str(b)]
        print(f"| batch {b} | {ref} | {this} | {this / ref:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
