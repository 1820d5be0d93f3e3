"""int4 / int8 sidecars from tiny checkpoints: GGUF Q4_0/Q4_1 blocks land in the sidecar as int4
groups whose values are exactly GGUF's own dequantization (``gguf.quants.dequantize`` is the
reference, q/k rows permuted back with llama.cpp's own permutation), ``auto`` keeps the
checkpoint's storage, float checkpoints are quantized by the documented rules, and what a
layout cannot hold is a clear InvalidArgument."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from weights_tiny import _llamacpp_permute, write_tiny_checkpoint, write_tiny_gguf

from model_families import quant
from services.errors import InvalidArgument
from weight_service.loader import load_sidecar
from weight_service.prepare import prepare
from weight_service.sidecar import InvalidSidecar, validate_sidecar

HEADS, KV_HEADS = 4, 2
#: GGUF name -> (sidecar projection, row slice within the fused matrix) for the tiny shapes.
_ROWS = {"attn_q": ("layers.qkv_proj", 0, 64), "attn_k": ("layers.qkv_proj", 64, 96),
         "attn_v": ("layers.qkv_proj", 96, 128), "attn_output": ("layers.o_proj", 0, 64),
         "ffn_gate": ("layers.gate_up_proj", 0, 96), "ffn_up": ("layers.gate_up_proj", 96, 192),
         "ffn_down": ("layers.down_proj", 0, 64)}


def _gguf_tensors(path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GGUF name -> (its own dequantization [rows, cols] float32, raw block bytes)."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        rows, cols = (int(d) for d in reversed(t.shape.tolist())) if len(t.shape) == 2 else (int(t.shape[0]), 1)
        deq = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, -1)
        out[t.name] = (deq, np.asarray(t.data))
    return out


def _layer_parts(sc, name: str, layer: int) -> dict[str, torch.Tensor]:
    return {p: sc.tensors[f"{name}.{p}"][layer] for p in quant.FORMATS["int4"]}


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_gguf_q4_blocks_are_int4_groups_with_gguf_values_exactly(tmp_path, kind):
    write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=kind)
    handle = prepare(str(tmp_path / "tiny.gguf"), dtype="auto", root=tmp_path / "sc")
    assert handle.dtype == "int4" and handle.path.name.endswith("-llama-int4")
    reference = prepare(str(tmp_path / "tiny.gguf"), dtype="f32", root=tmp_path / "sc")  # the dequantized model
    assert reference.path != handle.path and reference.fingerprint != handle.fingerprint
    file = _gguf_tensors(tmp_path / "tiny.gguf")
    with load_sidecar(handle.path) as sc, load_sidecar(reference.path) as ref:
        assert sc.weights_dtype == "int4" and sc.tensors["layers.qkv_proj.qweight"].dtype == torch.uint8
        for layer in range(2):
            for stem, (name, a, b) in _ROWS.items():
                parts = {p: t[a:b] for p, t in _layer_parts(sc, name, layer).items()}
                ours = quant.dequantize(parts).numpy()  # (q - 8) * scale + zero, float32
                expected, raw = file[f"blk.{layer}.{stem}.weight"]
                heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(stem)
                # the file's rows are llama.cpp-permuted; so are its scales, row by row
                permuted = _llamacpp_permute(ours, heads) if heads else ours
                assert np.array_equal(permuted, expected), (layer, stem)
                d = raw.reshape(raw.shape[0], -1, 18 if kind == "Q4_0" else 20)[..., :2].copy().view(np.float16)[..., 0]
                scales = parts["scales"].numpy()
                assert np.array_equal(_llamacpp_permute(scales, heads) if heads else scales, d.astype(np.float32))
                if kind == "Q4_0":
                    assert not parts["zeros"].any()
                assert np.array_equal(ours, ref.tensors[name][layer][a:b].numpy()), (layer, stem)
        # tables and norms: float (embedding bf16-rounded, norms float32 exactly)
        assert sc.tensors["embed_tokens"].dtype == torch.bfloat16 and "lm_head" not in sc.tensors
        assert torch.equal(sc.tensors["embed_tokens"], ref.tensors["embed_tokens"].to(torch.bfloat16))
        assert torch.equal(sc.tensors["layers.input_norm"], ref.tensors["layers.input_norm"])
    validate_sidecar(handle.path)


def test_auto_keeps_what_the_checkpoint_stores(tmp_path):
    cases = {"Q8_0": "int8", "F32": "f32", "F16": "f32", "Q4_0": "int4"}
    for kind, expected in cases.items():
        write_tiny_gguf(tmp_path / f"{kind}.gguf", matrix_type=kind, embed_type="F32")
        assert prepare(str(tmp_path / f"{kind}.gguf"), dtype="auto", root=tmp_path / "sc").dtype == expected, kind
    write_tiny_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    write_tiny_checkpoint(tmp_path / "f32")
    assert prepare(str(tmp_path / "bf16"), dtype="auto", root=tmp_path / "sc").dtype == "bf16"
    assert prepare(str(tmp_path / "f32"), dtype="auto", root=tmp_path / "sc").dtype == "f32"


@pytest.mark.parametrize("weights_dtype", ["int4", "int8"])
def test_float_checkpoint_is_quantized_by_the_documented_rules(tmp_path, weights_dtype):
    sd = write_tiny_checkpoint(tmp_path / "ckpt", hidden=32, intermediate=64, tied=False, bias=True)
    handle = prepare(str(tmp_path / "ckpt"), dtype=weights_dtype, root=tmp_path / "sc")
    with load_sidecar(handle.path) as sc:
        assert sc.tensors["lm_head"].dtype == torch.bfloat16
        assert torch.equal(sc.tensors["lm_head"], sd["lm_head.weight"].to(torch.bfloat16))
        assert torch.equal(sc.tensors["layers.qkv_bias"][1], torch.cat(
            [sd[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"]))
        for layer in range(2):
            w = torch.cat([sd[f"model.layers.{layer}.mlp.{x}_proj.weight"] for x in ("gate", "up")])
            parts = {p: sc.tensors[f"layers.gate_up_proj.{p}"][layer] for p in quant.FORMATS[weights_dtype]}
            back = quant.dequantize(parts)
            if weights_dtype == "int4":
                g = w.view(w.shape[0], -1, 32)
                lo, hi = g.amin(-1), g.amax(-1)
                assert torch.equal(parts["scales"], (hi - lo) / 15)
                assert torch.equal(parts["zeros"], lo + 8 * parts["scales"])
                bound = parts["scales"].repeat_interleave(32, -1) / 2 + 1e-6
            else:
                assert torch.equal(parts["scales"], w.abs().amax(-1) / 127)
                bound = parts["scales"][:, None] / 2 + 1e-6
            assert ((back - w).abs() <= bound).all()


def test_what_a_layout_cannot_hold_is_an_invalid_argument(tmp_path):
    write_tiny_checkpoint(tmp_path / "ckpt", intermediate=48)  # down_proj has 48 input features
    with pytest.raises(InvalidArgument, match="layers.down_proj to have a multiple of 32 input features"):
        prepare(str(tmp_path / "ckpt"), dtype="int4", root=tmp_path / "sc")
    assert not list((tmp_path / "sc").glob("*/model.safetensors"))
    assert prepare(str(tmp_path / "ckpt"), dtype="int8", root=tmp_path / "sc").dtype == "int8"
    with pytest.raises(InvalidArgument, match="dtype must be one of auto, f32, bf16, int8, int4, got 'int2'"):
        prepare(str(tmp_path / "ckpt"), dtype="int2", root=tmp_path / "sc")


def test_int4_sidecar_dtypes_are_validated(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    handle = prepare(str(tmp_path / "tiny.gguf"), dtype="int4", root=tmp_path / "sc")
    weights = handle.path / "model.safetensors"
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"layers.o_proj.qweight":{"dtype":"U8"', b'"layers.o_proj.qweight":{"dtype":"I8"', 1)
    assert header != raw[8:8 + n]
    weights.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(InvalidSidecar, match="tensor layers.o_proj.qweight has dtype I8, expected U8"):
        validate_sidecar(handle.path)
    assert prepare(str(tmp_path / "tiny.gguf"), dtype="int4", root=tmp_path / "sc").state == "REBUILT"
