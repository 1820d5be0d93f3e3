"""AOTI compile time of the Llama decode (and prefill) program, by phase and layer count, and the
compiled step's speed: layers unrolled vs one ``scan`` loop (issue 24, "compile in seconds").

Model: SmolLM2-135M's shape (hidden 576, 9/3 heads of 64, intermediate 1536, vocabulary 49152,
tied head) with ``--layers`` layers (default 2, 8) and random weights (no download; the compile
does not depend on the values), float32, block size 16, ``max_num_seqs`` 32, ``max_model_len``
2048, the runner's prepacked matrices, ``--threads`` torch threads (default 1). KV pools of
``--blocks`` blocks, filled with random values so attention reads real history.

Per layer count and variant (``--variants``, default ``unrolled,scan``; ``unrolled`` is
:attr:`LlamaModel.scan_layers` off, the default; ``scan*`` turn it on):

- ``compile_s``: wall time of :func:`runner_service.programs.aoti.compile_aoti`, split into
  ``export_s`` (``torch.export``), ``cpp_s`` (every C++ compiler run: ``CppBuilder.build``,
  each listed in the JSON) and ``inductor_s`` (the rest: AOT autograd, Inductor's lowering,
  scheduling and C++ code generation). Inductor's FX graph cache is off, so no variant reuses
  another's graph; its other caches (precompiled headers, ISA probes) are warm after the first
  compile of the run.
- ``step_ms_bB``: the loaded program's step at batch B (1, 8, 32) over ``B`` rows of context
  100 / 300 / 200, median of ``--steps`` calls; the variants are called round-robin in the same
  loop, so a busy host slows them alike.
- ``max_abs_diff``: the largest absolute difference of the program's logits and K/V rows from
  the eager decode (the unrolled Python loop) over those inputs.

``--prefill`` also compiles the prefill program (``forward``, unrolled in every variant) once
per layer count and reports its phases; ``--prefill-scan`` tries a looped prefill
(:class:`PrefillScan`: the layers as one ``scan`` writing the pools, its extra operands, in place)
and reports how far it gets (torch 2.13: its functionalization refuses the in-place write).

Prints JSON, then a Markdown table. Usage: ``python bench/compile_spike.py [--layers 2,8]
[--variants unrolled,scan] [--prefill] [--prefill-scan] [--threads 1] [--steps 12] [--blocks 450]``.
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

from model_families.llama import FAMILY as LLAMA  # noqa: E402
from model_families.llama.config import LlamaConfig  # noqa: E402
from runner_service.config import EngineConfig  # noqa: E402
from runner_service.kv_cache import KVCache  # noqa: E402
from runner_service.model_runner import ModelRunner  # noqa: E402
from runner_service.programs import aoti, export_specs  # noqa: E402

#: (batch, context) of the step-time and equality cases.
CASES = ((1, 100), (8, 300), (32, 200))
#: Inductor options a variant adds to :data:`aoti.AOTI_INDUCTOR_CONFIGS` (and whether it scans).
VARIANTS: dict[str, tuple[bool, dict]] = {
    "unrolled": (False, {}),
    "scan": (True, {}),
    # G layers per loop iteration (LlamaModel.scan_layers = G): fewer iterations, a longer body
    "scan-g2": (2, {}),
    "scan-g3": (3, {}),
    "scan-g5": (5, {}),
    # the C++ wrapper at -O0 and without line tables: less g++ work on the wrapper's code
    "scan-o0-wrapper": (True, {"aot_inductor.compile_wrapper_opt_level": "O0",
                               "aot_inductor.enable_line_tables": False}),
    # no precompiled AOTI header: each compile parses the headers, none builds the ~40 s .gch
    "scan-no-pch": (True, {"aot_inductor.precompile_headers": False}),
    "scan-o0-no-pch": (True, {"aot_inductor.compile_wrapper_opt_level": "O0", "aot_inductor.enable_line_tables": False,
                              "aot_inductor.precompile_headers": False}),
}


def smollm2_shape(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
                       tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_id=[2],
                       architecture="LlamaForCausalLM")


def make_runner(layers: int, blocks: int) -> ModelRunner:
    args = smollm2_shape(layers)
    weights = LLAMA.random_weights(args, dtype=torch.float32, seed=0)
    kv = KVCache(LLAMA.cache_specs(args, 16), blocks, 16, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for pool in kv.tensors:
        pool.copy_(0.5 * torch.randn(pool.shape, generator=g))
    config = EngineConfig(max_num_seqs=32, block_size=16, max_model_len=2048, kv_cache_bytes=None, warmup=False,
                          compile="aoti", device="cpu")
    return ModelRunner(args, weights, kv, config, 2048, torch.device("cpu"))


class Phases:
    """Times ``torch.export.export`` and every ``CppBuilder.build`` while active."""

    def __enter__(self) -> Phases:
        from torch._inductor import cpp_builder

        self.export_s, self.cpp = 0.0, []
        self._export, self._build = torch.export.export, cpp_builder.CppBuilder.build
        phases = self

        def export(*a, **k):
            t = time.perf_counter()
            try:
                return phases._export(*a, **k)
            finally:
                phases.export_s += time.perf_counter() - t

        def build(builder, *a, **k):
            t = time.perf_counter()
            try:
                return phases._build(builder, *a, **k)
            finally:
                name = Path(str(getattr(builder, "_target_file", "?"))).name
                phases.cpp.append((name.split(".", 1)[-1], round(time.perf_counter() - t, 2)))

        torch.export.export, cpp_builder.CppBuilder.build = export, build
        return self

    def __exit__(self, *exc) -> None:
        from torch._inductor import cpp_builder

        torch.export.export, cpp_builder.CppBuilder.build = self._export, self._build


def compile_timed(module, example, dynamic, package: Path, configs: dict) -> dict:
    saved = dict(aoti.AOTI_INDUCTOR_CONFIGS)
    aoti.AOTI_INDUCTOR_CONFIGS.update(configs)
    try:
        with Phases() as ph:
            t = time.perf_counter()
            aoti.compile_aoti(module, example, dynamic, package)
            total = time.perf_counter() - t
    finally:
        aoti.AOTI_INDUCTOR_CONFIGS.clear()
        aoti.AOTI_INDUCTOR_CONFIGS.update(saved)
    cpp_s = sum(s for _n, s in ph.cpp)
    return {"compile_s": round(total, 1), "export_s": round(ph.export_s, 1), "cpp_s": round(cpp_s, 1),
            "inductor_s": round(total - ph.export_s - cpp_s, 1), "cpp_builds": ph.cpp}


class PrefillScan(torch.nn.Module):
    """The prefill forward with its layers as one ``scan`` (the spike): the pools are extra
    operands, written in place at the layer's offset (``index_copy_``) and read through the block
    tables shifted by ``layer * num_blocks``; called like :meth:`LlamaModel.forward`."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, caches, input_ids, positions, slot_mapping, block_tables, seq_lens, last_index):
        import torch.nn.functional as F
        from torch._higher_order_ops.scan import scan_op

        from model_families.attention import paged_attention
        from model_families.linear import linear
        from model_families.norm_rope import rms_norm

        m, c = self.model, self.model.config
        dtype = m.final_norm.dtype
        cos, sin = m.cos_table[positions].to(dtype), m.sin_table[positions].to(dtype)
        h = F.embedding(input_ids, m.embed_tokens)

        def body(h, i, input_norm, qkv, o, post, gate_up, down, kc, vc, cos, sin, tables, pos, lens, slots, _b):
            blocks, rows = kc.shape[1], kc.shape[1] * kc.shape[2]

            def attend(q, k, v):
                kc.view(-1, *kc.shape[3:]).index_copy_(0, slots + i * rows, k.reshape(-1, *k.shape[2:]))
                vc.view(-1, *vc.shape[3:]).index_copy_(0, slots + i * rows, v.reshape(-1, *v.shape[2:]))
                return paged_attention(q, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]),
                                       tables + i * blocks, pos, lens)

            return [m._layer(h, input_norm, qkv, None, o, post, gate_up, down, cos, sin, attend)[0]]

        xs = [torch.arange(c.num_hidden_layers), m.input_norm, m.qkv_proj, m.o_proj, m.post_attn_norm,
              m.gate_up_proj, m.down_proj]
        (h,) = scan_op(body, [h], xs, (*caches, cos, sin, block_tables, positions, seq_lens,
                                       slot_mapping.reshape(-1), h.shape[0]))
        last = h[torch.arange(h.shape[0]), last_index]
        return (linear(rms_norm(last, m.final_norm, c.rms_norm_eps), m.lm_head).float(),)


def case_inputs(runner: ModelRunner, batch: int, context: int) -> tuple[torch.Tensor, ...]:
    per = runner.layout.blocks_needed(context)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
    runner.buffers.fill([(100 + i) % runner.args.vocab_size for i in range(batch)], [context - 1] * batch, tables)
    return tuple(x.contiguous() for x in runner.decode_views(batch, per))


def run_layers(layers: int, variants: list[str], args, work: Path) -> dict:
    runner = make_runner(layers, args.blocks)
    spec = runner.program_spec()
    model = runner.model
    example, dynamic = export_specs.example_inputs(spec), export_specs.dynamic_shapes(spec)
    out: dict = {"layers": layers, "variants": {}}
    programs = {}
    for name in variants:
        scan, configs = VARIANTS[name]
        model.scan_layers = scan
        try:
            row = compile_timed(spec.decode_module, example, dynamic, work / f"{layers}-{name}.pt2", configs)
        finally:
            del model.scan_layers  # back to the class default
        programs[name] = aoti.AotiProgram(work / f"{layers}-{name}.pt2", spec.decode_module, spec.device)
        out["variants"][name] = row
        print(json.dumps({"layers": layers, name: row}), file=sys.stderr, flush=True)
    pools = runner.kv.tensors
    for batch, context in CASES if programs else ():
        inputs = case_inputs(runner, batch, context)
        with torch.inference_mode():
            want = spec.decode_module(pools, *inputs)  # eager: the Python loop whatever scan_layers says
            for name, program in programs.items():
                got = program(pools, *inputs)
                diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
                row = out["variants"][name]
                row["max_abs_diff"] = max(row.get("max_abs_diff", 0.0), diff)
            times: dict[str, list[float]] = {n: [] for n in programs}
            for _ in range(args.steps + 2):
                for name, program in programs.items():
                    t = time.perf_counter()
                    program(pools, *inputs)
                    times[name].append(time.perf_counter() - t)
        for name in programs:
            out["variants"][name][f"step_ms_b{batch}"] = round(1000 * statistics.median(times[name][2:]), 2)
    runner.buffers.fill([], [], [])
    if args.prefill:
        example = export_specs.prefill_example_inputs(spec)
        out["prefill"] = compile_timed(spec.model, example, export_specs.prefill_dynamic_shapes(spec),
                                       work / f"{layers}-prefill.pt2", {})
    if args.prefill_scan:
        example = export_specs.prefill_example_inputs(spec)
        try:
            out["prefill_scan"] = compile_timed(PrefillScan(model), example, export_specs.prefill_dynamic_shapes(spec),
                                                work / f"{layers}-prefill-scan.pt2", {})
        except Exception as e:  # noqa: BLE001 - the spike reports where it stops
            out["prefill_scan"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    return out


def markdown(report: dict) -> str:
    cols = ["compile_s", "export_s", "inductor_s", "cpp_s", *(f"step_ms_b{b}" for b, _ in CASES), "max_abs_diff"]
    lines = ["| layers | program | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for entry in report["runs"]:
        rows = [(f"decode {n}", r) for n, r in entry["variants"].items()]
        if "prefill" in entry:
            rows.append(("prefill (unrolled)", entry["prefill"]))
        if "prefill_scan" in entry and "error" not in entry["prefill_scan"]:
            rows.append(("prefill scan", entry["prefill_scan"]))
        for label, r in rows:
            cells = ["-" if c not in r else f"{r[c]:.1e}" if c == "max_abs_diff" else str(r[c]) for c in cols]
            lines.append(f"| {entry['layers']} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8", help="comma-separated layer counts (default 2,8)")
    parser.add_argument("--variants", default="unrolled,scan",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default unrolled,scan)")
    parser.add_argument("--prefill", action="store_true", help="also compile the prefill program")
    parser.add_argument("--prefill-scan", action="store_true", help="also try a looped prefill (PrefillScan)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per case (default 12)")
    parser.add_argument("--blocks", type=int, default=450, help="KV blocks (default 450)")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    report = {"model": "SmolLM2-135M shape, random weights, f32", "threads": args.threads, "runs": []}
    with tempfile.TemporaryDirectory(prefix="compile-spike-") as tmp:
        for layers in (int(x) for x in args.layers.split(",")):
            report["runs"].append(run_layers(layers, variants, args, Path(tmp)))
    print(json.dumps(report, indent=1))
    print()
    print(markdown(report))
    for entry in report["runs"]:
        if "error" in entry.get("prefill_scan", {}):
            print(f"\nprefill scan, {entry['layers']} layers: {entry['prefill_scan']['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
