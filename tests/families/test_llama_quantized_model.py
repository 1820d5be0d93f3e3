"""Acceptance: the runner on the bundled SmolLM2's int4 and int8 sidecars against the dequantized
model (the f32 sidecar, which tests/runner/test_runner_real_model.py checks against transformers).

Tolerances (last-position logits over TEXT_PROMPTS, max |difference|; measured values in
docs/quantization.md):

- int4, float32 compute: <= 0.15, greedy chats token-identical. The layers hold the GGUF's Q4_1
  values exactly (tests/weights/test_weights_real_model.py), so the whole difference is the
  bfloat16 token table (the tied head): measured 0.076.
- int8, float32 compute: <= 1.25, 3 of 5 greedy chats token-identical: int8 keeps one scale per
  row, so Q4_1's per-32 groups are requantized (measured 0.87; two chats leave the reference at
  tokens 5 and 22).
- int4, bf16 compute (what `--dtype auto` serves on this CPU): <= 1.0 from the float32 reference
  and no further than 1.25x the dequantized model's own bf16 error (measured 0.51 vs 0.57); the
  next token agrees on every text prompt. bf16 compute itself changes greedy text (the f32
  sidecar in bf16 leaves the float32 text on one chat), so greedy equality is asserted in
  float32 only.
- int4, bf16 compute with int8 activations (``--quantized-activations int8``, the default where
  the CPU has AVX512-VNNI; llama.cpp's Q8 activations, with a row's few massive activations kept
  exact): <= 2.0 max and <= 0.35 mean (measured 1.42 and 0.23; without the outliers kept exact
  3.47 and 0.55); the next token agrees on every text prompt.
"""

from __future__ import annotations

import pytest
import torch
from real_model_prompts import CHATS, TEXT_PROMPTS

from model_families import native
from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import ScheduledBatch
from runner_service.sequence import Sequence

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0)
TOLERANCE = {("int4", "f32"): 0.15, ("int8", "f32"): 1.25, ("int4", "bf16"): 1.0, ("int4", "bf16", "int8"): 2.0}
#: Mean |difference| of those logits with int8 activations (measured 0.23).
INT8_ACTIVATIONS_MEAN_TOLERANCE = 0.35


def _engine(path, dtype: str, activations: str = "bf16") -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=8, max_model_len=1024, kv_cache_bytes=160 << 20, warmup=False, dtype=dtype,
                       quantized_activations=activations)
    return LLMEngine.from_sidecar(path, cfg, model="SmolLM2-135M-Instruct")


def _run(engine: LLMEngine) -> tuple[torch.Tensor, list[list[int]], list[str]]:
    """Last-position logits of each text prompt [5, V], and the greedy 32-token chats (ids, text)."""
    logits = []
    for text in TEXT_PROMPTS:
        ids = engine.tokenizer.encode(text)
        seq = Sequence("logits", ids, GREEDY_32, engine.max_model_len)
        engine.block_manager.allocate(seq, len(ids))
        try:
            logits.append(engine.runner.run_prefill(ScheduledBatch(True, [seq], [len(ids)], [0]))[0].clone())
        finally:
            engine.block_manager.free(seq)
    streams = [engine.add_request(GREEDY_32, messages=m) for m in CHATS]
    engine.run_until_done()
    results = [s.result(timeout=0) for s in streams]
    return torch.stack(logits), [r.token_ids for r in results], [r.text for r in results]


@pytest.fixture(scope="module")
def runs(smollm2_sidecar, smollm2_int4_sidecar, smollm2_int8_sidecar):
    """Every (sidecar, compute dtype) the tests compare, run once."""
    paths = {"f32": smollm2_sidecar, "int4": smollm2_int4_sidecar, "int8": smollm2_int8_sidecar}
    out = {}
    for weights, dtype in [("f32", "f32"), ("int4", "f32"), ("int8", "f32"), ("f32", "bf16"), ("int4", "bf16")]:
        with _engine(paths[weights], dtype) as engine:
            assert engine.weights_dtype == weights and engine.dtype_name == dtype
            if weights != "f32":
                assert engine.weights.quantization == weights
            out[weights, dtype] = _run(engine)
    with _engine(paths["int4"], "bf16", "int8") as engine:
        # where the CPU lacks AVX512-VNNI the option falls back to bf16 activations (then the
        # tolerances below hold a fortiori)
        assert engine.runner.int8_activations == native.int8_activations_enabled()
        # the plain bf16 head (49152 x 576, tied to the embedding) is read by no matmul then: its
        # mapped pages leave the resident set
        prepack = next(p for p in engine.startup_report.phases if p.name == "prepack").detail
        assert ("the head's 54 MiB of mapped pages released" in prepack) == native.int8_activations_enabled()
        out["int4", "bf16", "int8"] = _run(engine)
    return out


def test_int4_float32_equals_the_dequantized_model(runs):
    logits, ids, texts = runs["int4", "f32"]
    ref_logits, ref_ids, ref_texts = runs["f32", "f32"]
    assert (logits - ref_logits).abs().max().item() <= TOLERANCE["int4", "f32"]
    assert ids == ref_ids and texts == ref_texts
    assert all(len(i) > 0 for i in ids)


def test_int8_float32_is_within_its_tolerance(runs):
    logits, ids, _ = runs["int8", "f32"]
    ref_logits, ref_ids, _ = runs["f32", "f32"]
    assert (logits - ref_logits).abs().max().item() <= TOLERANCE["int8", "f32"]
    assert sum(a == b for a, b in zip(ids, ref_ids, strict=True)) >= 3
    assert all(a[:4] == b[:4] for a, b in zip(ids, ref_ids, strict=True))


def test_int4_bf16_is_as_close_as_the_dequantized_model_in_bf16(runs):
    logits, _, _ = runs["int4", "bf16"]
    ref_logits = runs["f32", "f32"][0]
    error = (logits - ref_logits).abs().max().item()
    dequantized_bf16 = (runs["f32", "bf16"][0] - ref_logits).abs().max().item()
    assert error <= TOLERANCE["int4", "bf16"]
    assert error <= 1.25 * dequantized_bf16, (error, dequantized_bf16)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_int4_bf16_with_int8_activations_is_within_its_tolerance(runs):
    """The default on this CPU: each row's activations quantized to int8 per 32 values before
    the int4 and head matmuls (llama.cpp's Q8 activations)."""
    logits, _, _ = runs["int4", "bf16", "int8"]
    ref_logits = runs["f32", "f32"][0]
    diff = (logits - ref_logits).abs()
    assert diff.max().item() <= TOLERANCE["int4", "bf16", "int8"]
    assert diff.mean().item() <= INT8_ACTIVATIONS_MEAN_TOLERANCE
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
