"""Weight-only quantized matrices (model_families/quant.py and the kernels behind
model_families/linear.linear): the stored formats, the quantization rules against a numpy
reimplementation, and PyTorch's int4/int8 matmuls against a float matmul of the dequantized
weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runner_tiny import tiny_args

from model_families import native, quant
from model_families.linear import linear
from model_families.llama import FAMILY as LLAMA
from model_families.quantized_weights import (
    INT4_DENSE_MIN_ROWS,
    Int4GroupWeight,
    Int4TileWeight,
    Int4Weight,
    Int8Weight,
    dequantize_int4pack,
    int4_matmul,
    int4pack_block_n,
    quantized_weight,
)
from services.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _np_int4(w: np.ndarray):
    """The documented int4 rule, independently: per group of 32, scale = (max - min) / 15,
    q = clip(round((w - min) / scale), 0, 15), zero = min + 8 scale (float32 throughout)."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)
    scale = (hi - lo) / np.float32(15)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.clip(np.round((g - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8).reshape(n, k)
    return q, scale, (lo + np.float32(8) * scale).astype(np.float32)


def test_nibbles_hold_column_2j_low_and_2j_plus_1_high():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(quant.unpack_nibbles(packed), codes)
    every = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(quant.unpack_nibbles(quant.pack_nibbles(every)), every)


def test_int4_rule_matches_numpy_and_bounds_the_error():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    w[3, :32] = 0.25  # a constant group: scale 0, every value exact
    groups = quant.quantize_int4(w)
    q, scale, zero = _np_int4(w.numpy())
    assert np.array_equal(groups.q.numpy(), q)
    assert np.array_equal(groups.scales.numpy(), scale) and np.array_equal(groups.zeros.numpy(), zero)
    parts = quant.int4_parts(groups)
    assert parts["qweight"].shape == (48, 48) and parts["qweight"].dtype == torch.uint8
    back = quant.dequantize(parts)
    bound = torch.from_numpy(scale).repeat_interleave(32, -1) / 2 + 1e-6
    assert ((back - w).abs() <= bound).all()
    assert torch.equal(back[3, :32], w[3, :32])


def test_int8_rule_matches_numpy_and_bounds_the_error():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    w[7] = 0  # an all-zero row: scale 0
    q, scales = quant.quantize_int8(w)
    ref_scale = np.abs(w.numpy()).max(-1) / np.float32(127)
    inv = np.where(ref_scale > 0, np.float32(1) / np.where(ref_scale > 0, ref_scale, 1), 0).astype(np.float32)
    ref_q = np.clip(np.round(w.numpy() * inv[:, None]), -127, 127).astype(np.int8)
    assert np.array_equal(q.numpy(), ref_q) and np.array_equal(scales.numpy(), ref_scale)
    back = quant.dequantize({"qweight": q, "scales": scales})
    assert ((back - w).abs() <= scales[:, None] / 2 + 1e-6).all() and (back[7] == 0).all()


def test_part_specs_and_shapes_int4_cannot_hold():
    specs = quant.part_specs("layers.x", (3, 64, 96), "int4")
    assert specs == {"layers.x.qweight": ((3, 64, 48), torch.uint8), "layers.x.scales": ((3, 64, 3), torch.float32),
                     "layers.x.zeros": ((3, 64, 3), torch.float32)}
    assert quant.part_specs("w", (8, 5), "int8") == {"w.qweight": ((8, 5), torch.int8), "w.scales": ((8,), torch.float32)}
    with pytest.raises(InvalidArgument, match="multiple of 32 input features and of 16 output rows, it has 48 and 64"):
        quant.part_specs("down", (64, 48), "int4")
    with pytest.raises(InvalidArgument, match="it has 64 and 40"):
        quant.part_specs("odd", (40, 64), "int4")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_equals_float_matmul_of_the_dequantized_weights(fmt, dtype):
    """bf16: PyTorch's weight-only kernels compute x @ dequantized(W).T to bf16 rounding
    (activations, scales and output in bf16). float32: the matrix is dequantized (the formula
    of quant.dequantize) and multiplied in float32, so it *is* the float matmul."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 48, 96, generator=g)  # 2 stacked layers; N = 48: a multiple of 16, not of 64
    parts = quant.quantize_parts(w, fmt)
    ref_w = quant.dequantize(parts)
    qw = quantized_weight(parts, dtype, torch.device("cpu"))
    bf16_int4 = Int4TileWeight if native.int4_tiles_enabled() else Int4Weight
    kind = {"int8": Int8Weight, "int4": Int4GroupWeight if dtype == torch.float32 else bf16_int4}[fmt]
    assert type(qw) is kind and qw.format == fmt and qw.dtype == dtype
    x = torch.randn(3, 5, 96, generator=g)  # [B, S, K]: linear flattens the leading dims
    bias = torch.randn(48, generator=g)
    for layer in range(2):
        got = linear(x.to(dtype), qw[layer], bias.to(dtype))
        assert got.shape == (3, 5, 48) and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, torch.nn.functional.linear(x, ref_w[layer], bias))
        else:
            ref = x.to(dtype).float() @ ref_w[layer].T + bias.to(dtype).float()
            assert (got.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), layer


def test_dequantized_int4pack_is_the_stored_formula_in_bf16():
    """The dense matrix read back from the kernel's opaque int4pack layout is w = (q - 8) * scale
    + zero of the stored parts (quant.dequantize), each value the one bf16 rounding of that float32
    value (scales and zeros rounded to bf16 first, as the kernel takes them); transposed [K, N]."""
    assert int4pack_block_n() == 64  # this host's build (AVX-512); the layout the docstring states
    g = torch.Generator().manual_seed(7)
    w = torch.randn(192, 96, generator=g)
    parts = quant.quantize_parts(w, "int4")
    m = Int4Weight.from_parts(parts, torch.bfloat16).matrix()
    got = dequantize_int4pack(m.packed, 32, m.scales_and_zeros)
    q = quant.unpack_nibbles(parts["qweight"]).float()
    scales = parts["scales"].bfloat16().float().repeat_interleave(32, -1)
    zeros = parts["zeros"].bfloat16().float().repeat_interleave(32, -1)
    assert got.shape == (96, 192) and got.dtype == torch.bfloat16
    assert torch.equal(got, ((q - 8) * scales + zeros).bfloat16().T)


def test_int4_matmul_from_the_dense_threshold_computes_the_same_product():
    """From INT4_DENSE_MIN_ROWS rows the int4 matmul is dequantize-then-matmul, below it the
    weight-only kernel: both are x @ dequantized(W).T to bf16 rounding, and a row's result does
    not depend on which path its batch took beyond that rounding. N = 48 is not a multiple of the
    layout's block: the kernel serves it at every row count."""
    g = torch.Generator().manual_seed(8)
    for n in (128, 48):
        parts = quant.quantize_parts(torch.randn(n, 64, generator=g), "int4")
        m = Int4Weight.from_parts(parts, torch.bfloat16).matrix()
        ref_w = quant.dequantize(parts)
        assert (dequantize_int4pack(m.packed, 32, m.scales_and_zeros) is None) == (n == 48)
        x = torch.randn(INT4_DENSE_MIN_ROWS + 3, 64, generator=g).bfloat16()
        many, few = int4_matmul(x, m.packed, 32, m.scales_and_zeros), int4_matmul(x[:3], m.packed, 32, m.scales_and_zeros)
        ref = x.float() @ ref_w.T
        for got, r in ((many, ref), (few, ref[:3])):
            assert got.dtype == torch.bfloat16 and got.shape == r.shape
            assert (got.float() - r).abs().max().item() <= 1e-2 * r.abs().max().item()
        # the kernel at the same rows: the two paths agree to bf16 rounding of the output
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, 32, m.scales_and_zeros)
        torch.testing.assert_close(many.float(), kernel.float(), atol=2e-2 * ref.abs().max().item(), rtol=0)
        assert torch.equal(int4_matmul(x, m.packed, 32, m.scales_and_zeros, dense_from=10**9), kernel)


def test_int4_kernel_float32_reference_path_agrees_too():
    """PyTorch's int4 kernel with float32 activations (its scalar reference path, which the
    runner does not use: too slow) computes the same product to float32 rounding: the formula
    w = (q - 8) * scale + zero is the kernel's."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    parts = quant.quantize_parts(w, "int4")
    kernel = Int4Weight.from_parts(parts, torch.float32).matrix()
    x = torch.randn(4, 128)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, kernel.packed, 32, kernel.scales_and_zeros)
    torch.testing.assert_close(got, x @ quant.dequantize(parts).T, atol=1e-4, rtol=1e-5)


def test_converted_between_compute_dtypes_cpu_only():
    parts = quant.quantize_parts(torch.randn(32, 64), "int4")
    qw = quantized_weight(parts, torch.float32, torch.device("cpu"))
    assert type(qw) is Int4GroupWeight and qw.qweight is parts["qweight"]  # zero-copy
    assert qw.converted(torch.float32, torch.device("cpu")) is qw
    bf16 = qw.converted(torch.bfloat16, torch.device("cpu"))  # warmserve's tiles where its kernel runs
    assert type(bf16) is (Int4TileWeight if native.int4_tiles_enabled() else Int4Weight) and bf16.dtype == torch.bfloat16
    half = qw.converted(torch.float16, torch.device("cpu"))
    assert type(half) is Int4Weight and half.scales_and_zeros.dtype == torch.float16
    assert torch.equal(half.packed, Int4Weight.from_parts(parts, torch.float16).packed)
    with pytest.raises(InvalidArgument, match="cannot serve float32 compute"):
        half.converted(torch.float32, torch.device("cpu"))
    eight = quantized_weight(quant.quantize_parts(torch.randn(32, 64), "int8"), torch.float32, torch.device("cpu"))
    assert eight.converted(torch.bfloat16, torch.device("cpu")).scales.dtype == torch.bfloat16
    with pytest.raises(InvalidArgument, match="laid out for the CPU kernels"):
        qw.converted(torch.float32, torch.device("meta"))
    # another device gets the dequantized matrix (no kernel there): a float tensor of the float shape
    other = quantized_weight(parts, torch.bfloat16, torch.device("meta"))
    assert isinstance(other, torch.Tensor) and other.shape == (32, 64) and other.dtype == torch.bfloat16


@pytest.mark.parametrize("weights_dtype", ["int4", "int8"])
def test_llama_forward_over_quantized_weights_equals_the_dequantized_model(weights_dtype):
    """The whole tiny Llama on int4/int8 weights (float32 compute) against the same model on
    float weights that are the dequantized parts: every matmul dispatches to the kernel."""
    args = tiny_args(vocab=64, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16)
    qw = LLAMA.random_weights(args, seed=4, weights_dtype=weights_dtype)
    assert qw.quantization == weights_dtype and qw.dtype == torch.float32
    assert qw.embed_tokens.dtype == torch.float32 and qw.lm_head is qw.embed_tokens  # float table, tied
    # the same random draw, through the sidecar layout, dequantized
    g = torch.Generator().manual_seed(4)
    floats = {}
    for name, shape in LLAMA.tensor_shapes(args).items():
        t = torch.randn(shape, generator=g)
        floats[name] = 1.0 + 0.1 * t if name.endswith("norm") else 0.02 * t
    specs = LLAMA.tensor_specs(args, weights_dtype)
    for name in [n for n in floats if n not in specs]:
        fmt = "int4" if f"{name}.zeros" in specs else "int8"
        floats[name] = quant.dequantize(quant.quantize_parts(floats[name], fmt))
    fw = LLAMA.load_weights(args, floats, torch.float32, torch.device("cpu"))
    qm, fm = LLAMA.build_model(args, qw, 64), LLAMA.build_model(args, fw, 64)
    assert {n for n, _ in qm.named_buffers()} >= {"qkv_proj.qweight" if weights_dtype == "int4" else "qkv_proj.weight"}
    ids = torch.randint(0, 64, (2, 6), generator=g)
    pos = torch.arange(6).repeat(2, 1)
    tables, lens, last = torch.tensor([[1, 2], [3, 4]]), torch.tensor([6, 6]), torch.tensor([5, 5])
    slots = torch.stack([torch.arange(4, 10), torch.arange(12, 18)])  # block * 4 + offset
    outs = []
    for model in (qm, fm):
        kv = tuple(torch.zeros(2, 5, 4, 2, 16) for _ in range(2))
        outs.append(model(kv, ids, pos, slots, tables, lens, last))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    # bf16 compute: the kernels, against the same dequantized model in bf16
    qb = LLAMA.build_model(args, qw.to(torch.bfloat16, torch.device("cpu")), 64)
    kv = tuple(torch.zeros(2, 5, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    got = qb(kv, ids, pos, slots, tables, lens, last)
    assert (got - outs[1]).abs().max().item() <= 0.05 * outs[1].abs().max().item()
