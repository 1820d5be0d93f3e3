"""DeepSeek V4 pack spec: the FP8/FP4 dequantizers against first-principles values, the three
namings read as one, stack placement, layout facts, and errors for missing tensors."""

from __future__ import annotations

import math

import pytest
import torch
from deepseek_v4_tiny import TINY_ALL_KINDS, TINY_HC4, write_tiny_deepseek_v4

from model_families.deepseek_v4 import checkpoint_names, pack, quantized
from model_families.deepseek_v4.config import DeepseekV4Config
from services.errors import InvalidArgument
from weight_service.safetensors_reader import SafetensorsCheckpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def e2m1_value(code: int) -> float:
    """e2m1 from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is
    subnormal (``m * 0.5``)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def e4m3_value(byte: int) -> float:
    """float8_e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal; 0x7f / 0xff are NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 15, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    return sign * (man / 8 * 2.0 ** -6 if exp == 0 else 2.0 ** (exp - 7) * (1 + man / 8))


def e8m0(exponents) -> torch.Tensor:
    return torch.tensor(exponents, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ---- dequantizers ----


def test_ue8m0_scales_are_powers_of_two():
    raw = [0, 1, 126, 127, 128, 130, 254]
    expected = torch.tensor([2.0 ** (b - 127) for b in raw], dtype=torch.float64).to(torch.float32)
    assert torch.equal(quantized.scale_values(e8m0(raw)), expected)
    assert torch.equal(quantized.scale_values(torch.tensor(raw, dtype=torch.uint8)), expected)
    assert quantized.scale_values(e8m0([255])).isnan().all()
    assert torch.equal(quantized.scale_values(torch.tensor([0.375])), torch.tensor([0.375]))


def test_e2m1_unpacks_every_byte_low_nibble_first():
    table = [e2m1_value(c) for c in range(16)]
    assert [abs(v) for v in table[:8]] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    packed = torch.arange(256, dtype=torch.uint8).view(torch.int8).reshape(16, 16)
    out = quantized.unpack_e2m1(packed)
    assert out.shape == (16, 32) and out.dtype == torch.float32
    expected = torch.tensor([[table[b & 15], table[b >> 4]] for b in range(256)]).reshape(16, 32)
    assert torch.equal(out, expected)
    assert quantized.unpack_e2m1(torch.tensor([[0x21, 0xF3]], dtype=torch.uint8)).tolist() == [[0.5, 1.0, 1.5, -6.0]]
    f4 = torch.tensor([[0x21, 0xF3]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert quantized.unpack_e2m1(f4).tolist() == [[0.5, 1.0, 1.5, -6.0]]


def test_fp4_scale_applies_per_32_values_of_a_row():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 40), generator=g, dtype=torch.uint8).view(torch.int8)  # K = 80: 3 groups
    exps = torch.randint(120, 134, (3, 3), generator=g)
    out = quantized.dequantize_fp4(packed, e8m0(exps.tolist()))
    u8 = packed.view(torch.uint8)
    for n in range(3):
        for k in range(80):
            byte = int(u8[n, k // 2])
            code = byte & 15 if k % 2 == 0 else byte >> 4
            assert out[n, k].item() == e2m1_value(code) * 2.0 ** (int(exps[n, k // 32]) - 127)
    with pytest.raises(InvalidArgument, match=r"scale of shape \[3, 2\], expected \[3, 3\]"):
        quantized.dequantize_fp4(packed, e8m0(exps[:, :2].tolist()))


def test_fp8_hand_codes_and_partial_128_blocks():
    codes = torch.tensor([[0x38, 0x3C, 0xC0, 0x7E, 0x01]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert [e4m3_value(b) for b in (0x38, 0x3C, 0xC0, 0x7E, 0x01)] == [1.0, 1.5, -2.0, 448.0, 2.0 ** -9]
    assert quantized.dequantize_fp8(codes, e8m0([[130]])).tolist() == [[8.0, 12.0, -16.0, 3584.0, 2.0 ** -6]]

    g = torch.Generator().manual_seed(1)
    rows, cols = 200, 300  # 2 x 3 blocks, the last row and column of blocks partial
    raw = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x38  # no NaN codes
    exps = torch.randint(110, 140, (2, 3), generator=g)
    out = quantized.dequantize_fp8(raw.view(torch.float8_e4m3fn), e8m0(exps.tolist()))
    lut = torch.tensor([e4m3_value(b) if (b & 0x7F) != 0x7F else 0.0 for b in range(256)], dtype=torch.float64)
    r = torch.arange(rows)[:, None] // 128
    c = torch.arange(cols)[None, :] // 128
    expected = lut[raw.long()] * torch.pow(2.0, exps[r, c].double() - 127)
    assert torch.equal(out, expected.to(torch.float32))
    with pytest.raises(InvalidArgument, match=r"expected \[2, 3\]"):
        quantized.dequantize_fp8(raw.view(torch.float8_e4m3fn), e8m0([[127, 127]]))


def test_merged_gate_up_fp8_uses_one_grid_per_half():
    g = torch.Generator().manual_seed(2)
    half = 200  # ceil(200/128) = 2 block rows per half, 4 in all (the merged 400 rows would need 4 too, misaligned)
    w1 = torch.randn(half, 64, generator=g).to(torch.float8_e4m3fn)
    w3 = torch.randn(half, 64, generator=g).to(torch.float8_e4m3fn)
    s1, s3 = e8m0([[126], [128]]), e8m0([[129], [125]])
    merged = quantized.dequantize(torch.cat([w1, w3]), torch.cat([s1, s3]), halves=True)
    expected = torch.cat([quantized.dequantize_fp8(w1, s1), quantized.dequantize_fp8(w3, s3)])
    assert torch.equal(merged, expected)
    assert torch.equal(expected[:128], w1[:128].float() * 0.5) and torch.equal(expected[half + 128:], w3[128:].float() / 4)


# ---- namings ----


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (reader, reference model) for a release, a transformers and a saved checkpoint."""
    root = tmp_path_factory.mktemp("dsv4")
    out = {}
    for naming in ("release", "transformers", "saved"):
        model = write_tiny_deepseek_v4(root / naming, TINY_ALL_KINDS, naming=naming)
        out[naming] = (SafetensorsCheckpoint(root / naming), model)
    return out


@pytest.mark.parametrize("naming", ["release", "transformers", "saved"])
def test_naming_is_detected_and_every_tensor_matches_transformers(checkpoints, naming):
    ckpt, model = checkpoints[naming]
    assert checkpoint_names.ReleaseView(ckpt).naming == naming
    sd, c = model.state_dict(), ckpt.config
    g = pack.global_tensors(ckpt)
    assert torch.equal(g["embed"], sd["model.embed_tokens.weight"]) and torch.equal(g["head"], sd["lm_head.weight"])
    assert torch.equal(g["hc_head_fn"], sd["model.hc_head.hc_fn"])
    for layer in range(c.num_hidden_layers):
        t = pack.layer_tensors(ckpt, layer)
        p = f"model.layers.{layer}."
        assert torch.equal(t["layers.kv_norm"], sd[p + "self_attn.kv_norm.weight"])  # attn.norm.weight when saved
        assert torch.equal(t["layers.experts_gate_up"], sd[p + "mlp.experts.gate_up_proj"])
        assert torch.equal(t["layers.shared_gate_up"], torch.cat([sd[p + "mlp.shared_experts.gate_proj.weight"],
                                                                  sd[p + "mlp.shared_experts.up_proj.weight"]]))
        assert set(t) == {n for n in pack.tensor_specs(c, "f32") if n.startswith("layers.")} | {
            {"hash_moe": "hash.tid2eid"}.get(c.mlp_layer_types[layer], "layers.gate")} | {
            n for n in pack.tensor_specs(c, "f32") if n.startswith({"compressed_sparse_attention": "csa.",
                                                                   "heavily_compressed_attention": "hca."}
                                                                  .get(c.layer_types[layer], "-"))}
    assert torch.equal(pack.layer_tensors(ckpt, 0)["hash.tid2eid"], sd["model.layers.0.mlp.gate.tid2eid"].int())
    assert pack.layer_tensors(ckpt, 0)["hash.tid2eid"].dtype == torch.int32
    assert torch.equal(pack.layer_tensors(ckpt, 0)["layers.gate_bias"], torch.zeros(c.n_routed_experts))
    assert torch.equal(pack.layer_tensors(ckpt, 1)["csa.idx_wkv_gate"], torch.cat([
        sd["model.layers.1.self_attn.compressor.indexer.kv_proj.weight"],
        sd["model.layers.1.self_attn.compressor.indexer.gate_proj.weight"]]))
    assert torch.equal(pack.layer_tensors(ckpt, 2)["hca.ape"], sd["model.layers.2.self_attn.compressor.position_bias"])


class _Without:
    """A checkpoint reader with some names hidden (or renamed) over a real one."""

    def __init__(self, ckpt, hidden: set[str], renamed: dict[str, str] | None = None) -> None:
        self.ckpt, self.hidden, self.renamed = ckpt, hidden, renamed or {}
        self.config = ckpt.config

    def names(self):
        return [self.renamed.get(n, n) for n in self.ckpt.names() if n not in self.hidden]

    def has(self, name):
        return name in self.names()

    def tensor(self, name):
        if not self.has(name):
            raise InvalidArgument(f"no tensor {name}")
        back = {v: k for k, v in self.renamed.items()}
        return self.ckpt.tensor(back.get(name, name))


@pytest.mark.parametrize("naming,hidden,release,looked_for", [
    ("release", "layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.weight"),
    ("release", "layers.2.ffn.gate.bias", "layers.2.ffn.gate.bias", "layers.2.ffn.gate.bias"),
    ("release", "hc_head_base", "hc_head_base", "hc_head_base"),
    ("release", "layers.0.ffn.experts.3.w2.weight", "layers.0.ffn.experts.3.w2.weight",
     "layers.0.ffn.experts.3.w2.weight"),
    ("saved", "model.layers.1.attn.norm.weight", "layers.1.attn.kv_norm.weight",
     "model.layers.1.attn.kv_norm.weight, model.layers.1.attn.norm.weight"),
    ("saved", "model.hc_head.hc_fn", "hc_head_fn", "model.hc_head.hc_fn"),
    ("transformers", "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "layers.1.attn.indexer.weights_proj.weight", "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("transformers", "model.layers.2.mlp.experts.down_proj", "layers.2.ffn.experts.*.w2.weight",
     "model.layers.2.mlp.experts.down_proj"),
])
@pytest.mark.parametrize("how", ["missing", "renamed"])
def test_a_missing_or_renamed_tensor_is_named(checkpoints, naming, hidden, release, looked_for, how):
    ckpt = checkpoints[naming][0]
    broken = _Without(ckpt, {hidden}) if how == "missing" else _Without(ckpt, set(), {hidden: hidden + "_x"})
    with pytest.raises(InvalidArgument) as err:
        pack.global_tensors(broken)
        for layer in range(ckpt.config.num_hidden_layers):
            pack.layer_tensors(broken, layer)
    assert release in str(err.value) and f"looked for {looked_for})" in str(err.value)


def test_unknown_naming_is_an_invalid_argument(checkpoints):
    ckpt = checkpoints["release"][0]
    with pytest.raises(InvalidArgument, match="in no DeepSeek V4 naming"):
        pack.global_tensors(_Without(ckpt, {"layers.0.attn_norm.weight"}))


def test_an_fp8_tensor_without_its_scale_is_refused(tmp_path):
    write_tiny_deepseek_v4(tmp_path, TINY_HC4, quantized=True)
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(InvalidArgument, match=r"layers\.1\.attn\.wo_b\.weight is stored FP8 but .* no scale"):
        pack.layer_tensors(_Without(ckpt, {"layers.1.attn.wo_b.scale"}), 1)


# ---- stacks and facts ----


def _config(layer_types, mlp_types):
    return DeepseekV4Config.from_hf(dict(TINY_ALL_KINDS, num_hidden_layers=len(layer_types), layer_types=layer_types,
                                         mlp_layer_types=mlp_types, architectures=["DeepseekV4ForCausalLM"]))


def test_stack_index_is_the_rank_among_layers_of_the_kind():
    W, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    c = _config([C, H, W, C, H, C], ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"])
    assert [pack.stack_index(c, "layers.wq_a", i) for i in range(6)] == list(range(6))
    assert [pack.stack_index(c, "csa.ape", i) for i in (0, 3, 5)] == [0, 1, 2]
    assert [pack.stack_index(c, "hca.norm", i) for i in (1, 4)] == [0, 1]
    assert [pack.stack_index(c, "hash.tid2eid", i) for i in (0, 1)] == [0, 1]
    with pytest.raises(InvalidArgument, match=r"layer 2 has no slice of csa.ape \(its layers: \[0, 3, 5\]\)"):
        pack.stack_index(c, "csa.ape", 2)
    specs = pack.tensor_specs(c, "bf16")
    assert specs["csa.ape"].shape[0] == 3 and specs["hca.ape"].shape[0] == 2 and specs["hash.tid2eid"].shape[0] == 2
    assert specs["hash.tid2eid"].dtype == torch.int32 and specs["layers.wq_a"].dtype == torch.bfloat16


def test_stacked_names_cover_every_group():
    from model_families.deepseek_v4 import FAMILY

    c = _config(["compressed_sparse_attention", "heavily_compressed_attention"], ["hash_moe", "moe"])
    stacked = FAMILY.stacked_names(c)
    assert {"layers.wq_a", "hash.tid2eid", "csa.idx_wq_b", "hca.wkv_gate"} <= set(stacked)
    specs = pack.tensor_specs(c, "f32")
    mtp = {n for n in specs if n.startswith("mtp.")}  # stacked over the MTP blocks, written whole
    assert len(mtp) == 30 and all(specs[n].shape[0] == c.num_nextn_predict_layers == 1 for n in mtp)
    assert set(specs) - set(stacked) - mtp == {"embed", "head", "final_norm", "hc_head_fn", "hc_head_base",
                                               "hc_head_scale"}
    assert [FAMILY.stack_index(c, n, 1) for n in ("layers.gate", "hca.ape")] == [1, 0]


def test_layout_facts_state_kinds_rates_and_window():
    c = _config(["sliding_attention", "compressed_sparse_attention"], ["hash_moe", "moe"])
    assert pack.layout_facts(c) == {
        "layer_types": ["sliding_attention", "compressed_sparse_attention"], "mlp_layer_types": ["hash_moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 8, "hc_mult": 2, "index_topk": 2}
