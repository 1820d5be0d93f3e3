"""warmserve's int4 kernel (``warmserve::int4_mm_tiles``, model_families/kernels/int4_tiles.cpp)
and its tile layout (model_families/quantized_weights.pack_int4_tiles): the bytes against the
layout's rule written out element by element, the product against a float64 matmul of the
dequantized weights, rows that do not depend on their batch, the dense path, bad input, and the
build (model_families/native.py)."""

from __future__ import annotations

import pytest
import torch

from model_families import native, quant
from model_families.linear import linear
from model_families.quantized_weights import (
    INT4_TILES_DENSE_MIN_ROWS,
    Int4TileWeight,
    Int4Weight,
    dequantize_int4_tiles,
    int4_tiles_matmul,
    pack_int4_tiles,
    quantized_weight,
)

#: The tests that run the kernels (the layout and build tests run everywhere).
needs_kernels = pytest.mark.skipif(not native.int4_tiles_enabled(),
                                   reason="this host cannot build or run the AVX512-BF16 kernel")


def _matrix(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    return quant.quantize_parts(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), "int4")


def _reference(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """x @ w.T in float64, w = (q - 8) * scale + zero with scales and zeros rounded to bf16 (as the
    kernel takes them)."""
    q = quant.unpack_nibbles(parts["qweight"]).double()
    s = parts["scales"].bfloat16().double().repeat_interleave(quant.INT4_GROUP, -1)
    z = parts["zeros"].bfloat16().double().repeat_interleave(quant.INT4_GROUP, -1)
    return x.double() @ ((q - 8) * s + z).T


def test_tile_bytes_follow_the_stated_layout():
    """Byte 2l + b of chunk c of tile t holds the codes of row 16t + l//2 at k = 8c + 4b + l%2
    (low nibble) and k + 2 (high nibble); scales_zeros[t, g, 0 / 1, i] is row 16t + i's scale /
    zero of group g."""
    n, k = 32, 64
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    scales, zeros = torch.rand(n, k // 32), torch.rand(n, k // 32)
    tiles, sz = pack_int4_tiles(codes[:, 0::2] | (codes[:, 1::2] << 4), scales, zeros)  # the stored bytes
    assert tiles.shape == (2, 8, 64) and tiles.dtype == torch.uint8 and sz.shape == (2, 2, 2, 16)
    for t in range(2):
        for c in range(8):
            for byte in range(64):
                word, b = divmod(byte, 2)
                row, kk = 16 * t + word // 2, 8 * c + 4 * b + word % 2
                assert tiles[t, c, byte].item() == codes[row, kk].item() | (codes[row, kk + 2].item() << 4)
        for g in range(2):
            for i in range(16):
                assert sz[t, g, 0, i].item() == scales[16 * t + i, g].bfloat16().item()
                assert sz[t, g, 1, i].item() == zeros[16 * t + i, g].bfloat16().item()
    with pytest.raises(ValueError, match="N % 16"):
        pack_int4_tiles(codes[:24, 0::2], scales[:24], zeros[:24])


@needs_kernels
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (160, 64), (576, 1536)])
def test_kernel_is_the_dequantized_product_to_bf16_rounding(n, k):
    """Every row count up to a block and past it (1..17, 40), past a 64-row pass (65, 130) and tile
    counts that leave tails of the 8- and 2-tile blocks: within one bf16 rounding of the float64
    product, plus the float32 accumulation's error."""
    parts = _matrix(n, k, seed=n + k)
    w = Int4TileWeight.from_parts(parts).matrix()
    g = torch.Generator().manual_seed(3)
    for m in (*range(1, 18), 40, 65, 130):
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = _reference(x, parts)
        got = torch.ops.warmserve.int4_mm_tiles(x, w.tiles, quant.INT4_GROUP, w.scales_zeros)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        err = (got.double() - ref).abs()
        bound = ref.abs() * 2.0 ** -8 + 1e-5 * k * x.double().abs().max() * ref.abs().max().clamp(min=1)
        assert bool((err <= bound).all()), (m, err.max().item())


@needs_kernels
def test_a_row_does_not_depend_on_its_batch():
    """Each row of a batch equals that row computed alone, bitwise, at every batch size below the
    dense path (the kernel splits no row's sum across threads or blocks)."""
    parts = _matrix(96, 128, seed=5)
    w = Int4TileWeight.from_parts(parts).matrix()
    x = torch.randn(INT4_TILES_DENSE_MIN_ROWS - 1, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    alone = torch.cat([torch.ops.warmserve.int4_mm_tiles(x[i:i + 1], w.tiles, 32, w.scales_zeros)
                       for i in range(130)])
    for m in (2, 7, 8, 9, 40, 64, 65, 130, INT4_TILES_DENSE_MIN_ROWS - 1):
        batch = int4_tiles_matmul(x[:m], w.tiles, 32, w.scales_zeros)
        assert torch.equal(batch[:130], alone[:min(m, 130)])


@needs_kernels
def test_dense_path_dequantizes_the_stored_formula():
    """From INT4_TILES_DENSE_MIN_ROWS rows: the matrix dequantized (each value the one bf16
    rounding of (q - 8) * scale + zero) and one dense matmul; the two paths agree to bf16 rounding."""
    parts = _matrix(64, 96, seed=7)
    w = Int4TileWeight.from_parts(parts).matrix()
    q = quant.unpack_nibbles(parts["qweight"]).float()
    s = parts["scales"].bfloat16().float().repeat_interleave(32, -1)
    z = parts["zeros"].bfloat16().float().repeat_interleave(32, -1)
    dense = dequantize_int4_tiles(w.tiles, w.scales_zeros, 32)
    assert dense.shape == (96, 64) and torch.equal(dense, ((q - 8) * s + z).bfloat16().T)
    x = torch.randn(INT4_TILES_DENSE_MIN_ROWS, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    ref = _reference(x, parts)
    many = int4_tiles_matmul(x, w.tiles, 32, w.scales_zeros)
    kernel = int4_tiles_matmul(x, w.tiles, 32, w.scales_zeros, dense_from=10**9)
    for got in (many, kernel):
        assert (got.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


@needs_kernels
def test_stacked_weight_round_trips_and_serves_linear():
    """A stacked weight's parts come back as stored (scales and zeros as rounded to bf16); linear()
    over a layer equals the kernel; f16 compute converts to PyTorch's layout; float32 is refused."""
    w = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(9))
    parts = quant.quantize_parts(w, "int4")
    qw = quantized_weight(parts, torch.bfloat16, torch.device("cpu"))
    assert type(qw) is Int4TileWeight and qw.tiles.shape == (3, 3, 8, 64)
    back = qw.parts()
    assert torch.equal(back["qweight"], parts["qweight"])
    assert torch.equal(back["scales"], parts["scales"].bfloat16().float())
    assert torch.equal(back["zeros"], parts["zeros"].bfloat16().float())
    x = torch.randn(2, 5, 64).bfloat16()
    got = linear(x, qw[1])
    assert torch.equal(got.reshape(10, 48), torch.ops.warmserve.int4_mm_tiles(x.reshape(10, 64), qw.tiles[1], 32,
                                                                             qw.scales_zeros[1]))
    half = qw.converted(torch.float16, torch.device("cpu"))
    assert type(half) is Int4Weight and half.dtype == torch.float16
    from services.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="cannot serve float32"):
        qw.converted(torch.float32, torch.device("cpu"))


@needs_kernels
def test_bad_input_is_refused_with_a_sentence():
    w = Int4TileWeight.from_parts(_matrix(32, 64, seed=10)).matrix()
    with pytest.raises(RuntimeError, match="2-D bf16"):
        torch.ops.warmserve.int4_mm_tiles(torch.randn(2, 64), w.tiles, 32, w.scales_zeros)
    with pytest.raises(RuntimeError, match=r"tiles must be contiguous uint8 \[N/16, K/8, 64\]"):
        torch.ops.warmserve.int4_mm_tiles(torch.randn(2, 96).bfloat16(), w.tiles, 32, w.scales_zeros)
    with pytest.raises(RuntimeError, match="group_size 12"):
        torch.ops.warmserve.int4_mm_tiles(torch.randn(2, 64).bfloat16(), w.tiles, 12, w.scales_zeros)
    with pytest.raises(RuntimeError, match="scales_zeros must be"):
        torch.ops.warmserve.int4_mm_tiles(torch.randn(2, 64).bfloat16(), w.tiles, 32, w.scales_zeros.float())


@needs_kernels
def test_disabled_by_the_environment(monkeypatch):
    """WARMSERVE_NATIVE_KERNELS=0 gets PyTorch's int4 layout, read when the weights load."""
    assert type(quantized_weight(_matrix(32, 64, seed=11), torch.bfloat16, torch.device("cpu"))) is Int4TileWeight
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert not native.int4_tiles_enabled()
    assert type(quantized_weight(_matrix(32, 64, seed=12), torch.bfloat16, torch.device("cpu"))) is Int4Weight


def test_build_is_published_whole_under_its_fingerprint(tmp_path, monkeypatch):
    """A build lands as <stem>-<fingerprint>.so in the first writable build directory, with no
    temporary file left; a second call finds it; a source that does not compile raises with the
    compiler's words and leaves nothing behind."""
    src = tmp_path / "probe.cpp"
    src.write_text('#include <torch/library.h>\nTORCH_LIBRARY_FRAGMENT(warmserve_probe, m) {}\n')
    monkeypatch.setattr(native, "build_dirs", lambda: [tmp_path / "a-file" / "x", tmp_path / "out"])
    (tmp_path / "a-file").write_text("not a directory: nothing can be built below it\n")
    built = native.build(src)
    assert built == tmp_path / "out" / f"probe-{native.fingerprint(src)}.so" and built.is_file()
    assert native.build(src) == built
    src.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="failed to build probe.cpp"):
        native.build(src)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([built.name, "probe.lock"])


def test_int8_tiles_follow_the_stated_layout_and_round_the_scale_up():
    """Byte 2l + b of chunk c of tile t holds q + 128 of row 16t + l//2 at k = 4c + 2b + l%2; the
    group's scale is the bf16 value at or above max|w| / 127, so |q| <= 127 and q * s is within
    half a step of w."""
    from model_families.quantized_weights import pack_int8_tiles

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(13))
    w[5, :32] = 0  # an all-zero group: scale 0, codes 0
    tiles, sz = pack_int8_tiles(w)
    assert tiles.shape == (2, 16, 64) and sz.shape == (2, 2, 2, 16) and sz.dtype == torch.bfloat16
    s = sz[:, :, 0, :].float().transpose(1, 2).reshape(32, 2)  # [N, groups]
    assert torch.equal(sz[:, :, 1, :], torch.zeros_like(sz[:, :, 1, :]))
    amax = w.reshape(32, 2, 32).abs().amax(-1)
    assert bool((s * 127 >= amax).all()) and s[5, 0].item() == 0
    q = torch.empty(32, 64)
    for t in range(2):
        for c in range(16):
            for byte in range(64):
                word, b = divmod(byte, 2)
                q[16 * t + word // 2, 4 * c + 2 * b + word % 2] = tiles[t, c, byte].item() - 128
    assert q.abs().max().item() <= 127
    deq = q * s.repeat_interleave(32, 1)
    assert bool(((deq - w).abs() <= s.repeat_interleave(32, 1) / 2 + 1e-7).all())


@needs_kernels
@pytest.mark.parametrize("n,k", [(16, 32), (160, 96), (48, 576)])
def test_int8_kernel_is_the_dequantized_product_to_bf16_rounding(n, k):
    from model_families.quantized_weights import pack_int8_tiles

    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.1
    tiles, sz = pack_int8_tiles(w)
    s = sz[:, :, 0, :].double().transpose(1, 2).reshape(n, k // 32).repeat_interleave(32, 1)
    q = torch.round(w.double() / s.clamp(min=1e-30)).clamp(-127, 127)
    for m in (1, 2, 7, 8, 9, 17, 66, 130):
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = x.double() @ (q * s).T
        got = torch.ops.warmserve.int8_mm_tiles(x, tiles, 32, sz)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        err = (got.double() - ref).abs()
        assert bool((err <= ref.abs() * 2.0 ** -8 + 1e-5 * k * ref.abs().max().clamp(min=1)).all()), (m, err.max())


@needs_kernels
def test_a_head_gets_an_int8_copy_used_below_the_row_threshold():
    """PackedMatrices(head=w): onednn_linear runs the int8 copy below INT8_HEAD_MAX_ROWS rows and
    oneDNN's bf16 matmul from there; close() drops the copy."""
    from model_families import prepack

    w = (torch.randn(64, 96, generator=torch.Generator().manual_seed(14)) * 0.1).bfloat16()
    packed = prepack.PackedMatrices([], batch_hint=4, head=w)
    few = torch.randn(prepack.INT8_HEAD_MAX_ROWS - 1, 96).bfloat16()
    many = torch.randn(prepack.INT8_HEAD_MAX_ROWS, 96).bfloat16()
    tiles, sz, a8 = prepack._INT8_HEADS[prepack._matrix_key(w)]
    assert a8 is False
    assert torch.equal(prepack.onednn_linear(few, w, None), torch.ops.warmserve.int8_mm_tiles(few, tiles, 32, sz))
    dense = torch.ops.mkldnn._linear_pointwise(many, w, None, "none", [], "")
    assert torch.equal(prepack.onednn_linear(many, w, None), dense)
    torch.testing.assert_close(prepack.onednn_linear(few, w, None).float(), few.float() @ w.float().T,
                               atol=2e-2, rtol=2e-2)
    packed.close()
    assert prepack._matrix_key(w) not in prepack._INT8_HEADS
    assert torch.equal(prepack.onednn_linear(few, w, None),
                       torch.ops.mkldnn._linear_pointwise(few, w, None, "none", [], ""))
