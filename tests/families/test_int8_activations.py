"""int8 activations over warmserve's int4 and int8 tiles (``warmserve::int4_mm_tiles_a8`` /
``int8_mm_tiles_a8``, ``--quantized-activations int8``): the products against a float64
reference that quantizes the activations by the stated rule (per row and group of 32: ``d = amax /
127``, ``xq = round(x * (127 / amax))``, ties to even; for int4 a row's outliers, its at most 4
largest ``|x_k|`` above 10 times its mean ``|x|``, ties to the lower ``k``, are left out of the
groups and added exactly), rows that do not depend on their batch, the error against the
unquantized product, and the runner's switch (weights, head, program key)."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import tiny_args, tiny_config

from model_families import native, quant
from model_families.linear import linear
from model_families.quantized_weights import Int4TileWeight, int4_tiles_matmul, pack_int8_tiles

needs_vnni = pytest.mark.skipif(not native.int8_activations_enabled(),
                                reason="this host cannot build or run the AVX512-VNNI kernels")
G = quant.INT4_GROUP


def _int4(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    return quant.quantize_parts(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), "int4")


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, d)`` of bf16 ``x [M, K]`` by the rule: float64 ``xq [M, K/G, G]`` and ``d [M, K/G, 1]``,
    computed in float32 as the rule states."""
    xf = x.float().reshape(x.shape[0], -1, G)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv).double(), (amax / 127).double()


OUTLIERS, OUTLIER_RATIO = 4, 10.0


def _outliers(x: torch.Tensor) -> torch.Tensor:
    """Bool [M, K]: each row's outliers by the rule (the test data keep every |x| far from the
    threshold, so the float32 sums' order does not matter)."""
    a = x.float().abs()
    above = a > OUTLIER_RATIO * a.mean(1, keepdim=True)
    order = torch.sort(torch.where(above, a, torch.full_like(a, -1.0)), dim=1, descending=True, stable=True).indices
    picked = torch.zeros_like(above).scatter_(1, order[:, :OUTLIERS], True)
    return picked & above


def _int4_reference(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's outliers (:func:`_outliers`) exactly, the rest ``x'``: sum_g s d (xq' . q) +
    (z - 8 s) sum_k x'_k; float64, scales and zeros rounded to bf16."""
    picked = _outliers(x)
    rest = x.masked_fill(picked, 0)
    xq, d = _quantized_rows(rest)
    n = parts["qweight"].shape[0]
    q = quant.unpack_nibbles(parts["qweight"]).double()  # [N, K]
    s, z = parts["scales"].bfloat16().double(), parts["zeros"].bfloat16().double()  # [N, K/G]
    acc = torch.einsum("mgk,ngk->mng", xq, q.reshape(n, -1, G))
    sums = rest.double().reshape(x.shape[0], -1, G).sum(-1)  # [M, K/G]
    w = (q - 8) * s.repeat_interleave(G, -1) + z.repeat_interleave(G, -1)  # [N, K]
    outliers = x.double().masked_fill(~picked, 0)
    return (acc * s * d[:, None, :, 0]).sum(-1) + sums @ (z - 8 * s).T + outliers @ w.T


def _exact_int4(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    q = quant.unpack_nibbles(parts["qweight"]).double()
    s = parts["scales"].bfloat16().double().repeat_interleave(G, -1)
    z = parts["zeros"].bfloat16().double().repeat_interleave(G, -1)
    return x.double() @ ((q - 8) * s + z).T


def _within_bf16(got: torch.Tensor, ref: torch.Tensor, k: int) -> bool:
    """One bf16 rounding of the result plus float32 accumulation error."""
    return bool(((got.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-5 * k * ref.abs().max().clamp(min=1)).all())


@needs_vnni
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (160, 64), (576, 1536)])
def test_int4_a8_is_the_quantized_product_to_bf16_rounding(n, k):
    """Row counts inside a block, past it, and past a 64-row pass; tile counts that leave tails."""
    parts = _int4(n, k, seed=n + k)
    w = Int4TileWeight.from_parts(parts).matrix()
    g = torch.Generator().manual_seed(4)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 70):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        cols = torch.randint(0, k, (m, 6), generator=g)  # 0-6 massive activations a row, some shared
        x.scatter_(1, cols, 300.0 * torch.randn(m, 6, generator=g).sign() * (torch.rand(m, 6, generator=g) < 0.5))
        x[::3, 5] = -250.0
        x = x.bfloat16()
        assert _outliers(x).any()
        got = torch.ops.warmserve.int4_mm_tiles_a8(x, w.tiles, G, w.scales_zeros)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert _within_bf16(got, _int4_reference(x, parts), k), m


@needs_vnni
@pytest.mark.parametrize("n,k", [(16, 32), (160, 96), (48, 576)])
def test_int8_a8_is_the_quantized_product_to_bf16_rounding(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.1
    tiles, sz = pack_int8_tiles(w)
    s = sz[:, :, 0, :].double().transpose(1, 2).reshape(n, k // G)  # [N, K/G]
    q = torch.round(w.double().reshape(n, -1, G) / s[..., None].clamp(min=1e-30)).clamp(-127, 127)
    for m in (1, 2, 5, 8, 9, 17, 66):
        x = torch.randn(m, k, generator=g).bfloat16()
        xq, d = _quantized_rows(x)
        ref = (torch.einsum("mgk,ngk->mng", xq, q) * s * d[:, None, :, 0]).sum(-1)
        got = torch.ops.warmserve.int8_mm_tiles_a8(x, tiles, G, sz)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert _within_bf16(got, ref, k), m


@needs_vnni
def test_int8_activations_stay_close_to_the_unquantized_product():
    """Each activation is off by at most d/2 = amax/254 of its group, so a row's error is bounded
    by sum_g amax_g/254 * sum_k |w_k| (plus bf16 rounding): a few tenths of a percent here."""
    parts = _int4(96, 576, seed=20)
    w = Int4TileWeight.from_parts(parts).matrix()
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(21)).bfloat16()
    x[3, 100] = 60.0  # a massive activation: computed exactly, it leaves its group's steps alone
    x[5, 7::64] = 40.0  # more of them in one row than are taken out: they coarsen their groups
    exact = _exact_int4(x, parts)
    got = torch.ops.warmserve.int4_mm_tiles_a8(x, w.tiles, G, w.scales_zeros).double()
    q = quant.unpack_nibbles(parts["qweight"]).double()
    wd = (q - 8) * parts["scales"].bfloat16().double().repeat_interleave(G, -1) + \
        parts["zeros"].bfloat16().double().repeat_interleave(G, -1)
    amax = x.double().abs().reshape(12, -1, G).amax(-1)  # [M, K/G]
    bound = (amax / 254) @ wd.abs().reshape(96, -1, G).sum(-1).T + exact.abs() * 2.0 ** -8 + 1e-4
    assert bool(((got - exact).abs() <= bound).all())
    err = (got - exact).abs().amax(1)
    assert err[torch.arange(12) != 5].max().item() < 0.01 * exact.abs().max().item()
    assert err[3].item() <= 2 * err[[0, 1, 2, 4]].max().item()  # the row with one outlier as good as the others
    assert err[5].item() > err[3].item()


@needs_vnni
def test_a_row_does_not_depend_on_its_batch_and_zero_rows_give_zero_products():
    """Bitwise the same alone and in batches of every shape (blocks, passes, tiles); an all-zero
    row's group scale is 0 and its product is the zero term alone (no NaN)."""
    parts = _int4(96, 128, seed=5)
    w = Int4TileWeight.from_parts(parts).matrix()
    x = torch.randn(130, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[7] = 0
    alone = torch.cat([torch.ops.warmserve.int4_mm_tiles_a8(x[i:i + 1], w.tiles, G, w.scales_zeros)
                       for i in range(130)])
    for m in (2, 4, 5, 8, 63, 64, 65, 130):
        assert torch.equal(torch.ops.warmserve.int4_mm_tiles_a8(x[:m], w.tiles, G, w.scales_zeros), alone[:m]), m
    assert torch.equal(alone[7], torch.zeros_like(alone[7]))  # sum_k x_k = 0 too


@needs_vnni
def test_a_weight_with_int8_activations_runs_the_a8_kernel_at_every_row_count():
    """linear() and int4_tiles_matmul over a weight flagged for int8 activations run
    int4_mm_tiles_a8, also from INT4_TILES_DENSE_MIN_ROWS rows (no dense path)."""
    from model_families.quantized_weights import INT4_TILES_DENSE_MIN_ROWS

    qw = Int4TileWeight.from_parts(_int4(48, 64, seed=7))
    assert qw.matrix().int8_activations is False
    qw.int8_activations = True
    m = qw.matrix()
    assert m.int8_activations is True
    for rows in (3, INT4_TILES_DENSE_MIN_ROWS):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
        a8 = torch.ops.warmserve.int4_mm_tiles_a8(x, m.tiles, G, m.scales_zeros)
        assert torch.equal(linear(x, m), a8)
        assert torch.equal(int4_tiles_matmul(x, m.tiles, G, m.scales_zeros, int8_activations=True), a8)
        assert not torch.equal(a8, torch.ops.warmserve.int4_mm_tiles(x, m.tiles, G, m.scales_zeros))


@needs_vnni
def test_a_head_copy_for_int8_activations_serves_every_row_count():
    from model_families import prepack

    w = (torch.randn(64, 96, generator=torch.Generator().manual_seed(14)) * 0.1).bfloat16()
    packed = prepack.PackedMatrices([], batch_hint=4, head=w, int8_activations=True)
    tiles, sz, a8 = prepack._INT8_HEADS[prepack._matrix_key(w)]
    assert a8 is True
    for rows in (1, prepack.INT8_HEAD_MAX_ROWS, 40):
        x = torch.randn(rows, 96).bfloat16()
        assert torch.equal(prepack.onednn_linear(x, w, None), torch.ops.warmserve.int8_mm_tiles_a8(x, tiles, G, sz))
    packed.close()


@needs_vnni
def test_bad_group_size_is_refused_with_a_sentence():
    w = Int4TileWeight.from_parts(_int4(32, 64, seed=10)).matrix()
    with pytest.raises(RuntimeError, match="group_size 8 must be a multiple of 16"):
        torch.ops.warmserve.int4_mm_tiles_a8(torch.randn(2, 64).bfloat16(), w.tiles, 8, w.scales_zeros)
    with pytest.raises(RuntimeError, match="2-D bf16"):
        torch.ops.warmserve.int4_mm_tiles_a8(torch.randn(2, 64), w.tiles, G, w.scales_zeros)


def _runner(activations: str, weights_dtype: str = "int4", dtype: torch.dtype = torch.bfloat16):
    from model_families.llama import FAMILY as LLAMA
    from runner_service.kv_cache import KVCache
    from runner_service.model_runner import ModelRunner

    args = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=128)
    weights = LLAMA.random_weights(args, dtype=dtype, seed=3, weights_dtype=weights_dtype)
    kv = KVCache(LLAMA.cache_specs(args, 4), 16, 4, dtype, torch.device("cpu"))
    config = tiny_config(max_num_seqs=4, block_size=4, max_model_len=64, dtype="bf16" if dtype == torch.bfloat16
                         else "f32", compile="aoti", device="cpu", quantized_activations=activations)
    return ModelRunner(args, weights, kv, config, 64, torch.device("cpu"))


@needs_vnni
def test_the_runner_flags_its_int4_weights_and_the_key_tells_the_two_apart():
    """--quantized-activations int8 flags every int4 tile weight and is in the program key (the
    traced code calls another kernel); bf16 leaves them and float weights unflagged."""
    from runner_service.programs.key import program_key

    on, off = _runner("int8"), _runner("bf16")
    assert on.int8_activations and not off.int8_activations
    from model_families import prepack

    assert prepack._INT8_HEADS[on.packed._head_key][2] is True
    for runner, want in ((on, True), (off, False)):
        tiles = [m for m in runner.model.modules() if isinstance(m, Int4TileWeight)]
        assert tiles and all(m.int8_activations is want for m in tiles)
    assert program_key(on.program_spec(), "aoti") != program_key(off.program_spec(), "aoti")
    assert not _runner("int8", weights_dtype="bf16").int8_activations  # float weights: nothing to quantize for


def test_the_option_is_checked():
    from services.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="quantized_activations must be one of"):
        tiny_config(quantized_activations="int4")


def test_a_loop_body_rebuilds_the_matrix_with_its_flag():
    """A loop body (the layers as one scan) rebuilds each layer's matrix from the stacked parts'
    slices: layer_matrix gives what w[i] gives, int8 activations included."""
    from model_families.quantized_weights import QuantizedWeight, quantized_weight

    w = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(30))
    for dtype in (torch.bfloat16, torch.float32):
        for fmt in ("int4", "int8"):
            qw = quantized_weight(quant.quantize_parts(w, fmt), dtype, torch.device("cpu"))
            assert isinstance(qw, QuantizedWeight)
            if isinstance(qw, Int4TileWeight):
                qw.int8_activations = True
            parts = list(qw.tensors().values())
            for i in range(3):
                rebuilt, direct = qw.layer_matrix(*[p[i] for p in parts]), qw[i]
                assert type(rebuilt) is type(direct) and len(rebuilt) == len(direct)
                for a, b in zip(rebuilt, direct, strict=True):
                    assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                if isinstance(qw, Int4TileWeight):
                    assert rebuilt.int8_activations is True


@needs_vnni
def test_rows_sharing_massive_columns_do_not_depend_on_their_batch():
    """Rows of one block that share outlier columns (the kernel extracts a column's weights once
    per block and tile) give the bits they give alone; so does the int8 head path."""
    parts = _int4(96, 256, seed=31)
    w = Int4TileWeight.from_parts(parts).matrix()
    g = torch.Generator().manual_seed(32)
    x = torch.randn(70, 256, generator=g)
    x[:, 17] = 200.0  # every row: the same massive channel
    x[::2, 200] = -150.0  # every other row: a second one
    x[5, 3:9] = 90.0  # one row with more than fit
    x = x.bfloat16()
    alone = torch.cat([torch.ops.warmserve.int4_mm_tiles_a8(x[i:i + 1], w.tiles, G, w.scales_zeros) for i in range(70)])
    for m in (3, 4, 9, 64, 70):
        assert torch.equal(torch.ops.warmserve.int4_mm_tiles_a8(x[:m], w.tiles, G, w.scales_zeros), alone[:m]), m
    assert _within_bf16(alone, _int4_reference(x, parts), 256)
    tiles, sz = pack_int8_tiles(torch.randn(48, 256, generator=g) * 0.1)
    alone8 = torch.cat([torch.ops.warmserve.int8_mm_tiles_a8(x[i:i + 1], tiles, G, sz) for i in range(70)])
    for m in (3, 5, 66, 70):
        assert torch.equal(torch.ops.warmserve.int8_mm_tiles_a8(x[:m], tiles, G, sz), alone8[:m]), m


@needs_vnni
def test_a_nan_or_inf_activation_makes_its_row_nan_and_leaves_the_others():
    """A NaN or an infinity in a row's group gives that row NaN products (as the bf16 path does),
    int4 and int8 alike, and no other row changes."""
    parts = _int4(32, 64, seed=33)
    w = Int4TileWeight.from_parts(parts).matrix()
    tiles, sz = pack_int8_tiles(torch.randn(32, 64, generator=torch.Generator().manual_seed(34)) * 0.1)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(35)).bfloat16()
    clean4 = torch.ops.warmserve.int4_mm_tiles_a8(x, w.tiles, G, w.scales_zeros)
    clean8 = torch.ops.warmserve.int8_mm_tiles_a8(x, tiles, G, sz)
    for bad in (float("nan"), float("inf")):
        for col in (3, 20, 40):  # the first or second half of a group
            y = x.clone()
            y[1, col] = bad
            got4 = torch.ops.warmserve.int4_mm_tiles_a8(y, w.tiles, G, w.scales_zeros)
            got8 = torch.ops.warmserve.int8_mm_tiles_a8(y, tiles, G, sz)
            for got, clean in ((got4, clean4), (got8, clean8)):
                assert bool(got[1].isnan().all()), (bad, col)
                assert torch.equal(got[[0, 2, 3]], clean[[0, 2, 3]])


@needs_vnni
def test_tiny_activations_are_quantized_not_overflowed():
    """A group whose largest |x| is tiny (127 / amax overflows float32) gives the products of its
    values rounded to zero, never a wrong sign or NaN."""
    tiles, sz = pack_int8_tiles(torch.randn(16, 32, generator=torch.Generator().manual_seed(36)) * 0.1)
    x = torch.full((1, 32), 1e-38).bfloat16()
    x[0, ::2] = -1e-38
    got = torch.ops.warmserve.int8_mm_tiles_a8(x, tiles, G, sz)
    assert bool(got.isfinite().all()) and got.abs().max().item() < 1e-30


def test_without_vnni_the_option_falls_back_to_bf16_activations(monkeypatch):
    """Where the int8-activation kernels do not run (no AVX512-VNNI, or no build), asking for them
    leaves the weights, the head copy and the program key on bf16 activations."""
    from model_families import prepack
    from runner_service.programs.key import program_key

    monkeypatch.setattr(native, "int8_activations_enabled", lambda: False)
    runner = _runner("int8")
    assert not runner.int8_activations
    assert all(not m.int8_activations for m in runner.model.modules() if isinstance(m, Int4TileWeight))
    assert prepack._INT8_HEADS[runner.packed._head_key][2] is False  # the head's int8 copy, bf16 activations
    assert program_key(runner.program_spec(), "aoti") == program_key(_runner("bf16").program_spec(), "aoti")
