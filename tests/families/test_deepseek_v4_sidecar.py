"""DeepSeek V4 sidecars end to end (prepare -> validate -> load): every tensor equals the
transformers reference parameter it came from (dequantized where the checkpoint stores it
FP8/FP4), for the release, transformers and save_pretrained namings, sharded or not, the MTP
block's included (its reference is built from transformers' modules, ``deepseek_v4_tiny.TinyMTP``);
a checkpoint whose MTP block is missing a tensor or has a block its config does not declare is
refused at pack time; layout facts fingerprinted; stale and edited sidecars refused with reasons."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from deepseek_v4_tiny import (
    TINY_ALL_KINDS,
    TINY_HC4,
    write_tiny_deepseek_v4,
)
from safetensors.torch import load_file, save_file

from model_families.deepseek_v4 import FAMILY
from services.errors import InvalidArgument
from weight_service.loader import load_sidecar
from weight_service.prepare import prepare
from weight_service.sidecar import FORMAT_VERSION, InvalidSidecar, sidecar_fingerprint, validate_sidecar

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

#: sidecar ``layers.*`` name -> transformers parameter(s) under ``model.layers.N.`` (rows in order).
_LAYERS = {
    "attn_norm": ("input_layernorm.weight",), "ffn_norm": ("post_attention_layernorm.weight",),
    "hc_attn_fn": ("attn_hc.fn",), "hc_attn_base": ("attn_hc.base",), "hc_attn_scale": ("attn_hc.scale",),
    "hc_ffn_fn": ("ffn_hc.fn",), "hc_ffn_base": ("ffn_hc.base",), "hc_ffn_scale": ("ffn_hc.scale",),
    "wq_a": ("self_attn.q_a_proj.weight",), "q_norm": ("self_attn.q_a_norm.weight",),
    "wq_b": ("self_attn.q_b_proj.weight",), "wkv": ("self_attn.kv_proj.weight",),
    "kv_norm": ("self_attn.kv_norm.weight",), "wo_a": ("self_attn.o_a_proj.weight",),
    "wo_b": ("self_attn.o_b_proj.weight",), "attn_sink": ("self_attn.sinks",), "gate": ("mlp.gate.weight",),
    "shared_gate_up": ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "shared_down": ("mlp.shared_experts.down_proj.weight",),
    "experts_gate_up": ("mlp.experts.gate_up_proj",), "experts_down": ("mlp.experts.down_proj",),
}
_CSA = {
    "wkv_gate": ("self_attn.compressor.kv_proj.weight", "self_attn.compressor.gate_proj.weight"),
    "ape": ("self_attn.compressor.position_bias",), "norm": ("self_attn.compressor.kv_norm.weight",),
    "idx_wkv_gate": ("self_attn.compressor.indexer.kv_proj.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    "idx_ape": ("self_attn.compressor.indexer.position_bias",),
    "idx_norm": ("self_attn.compressor.indexer.kv_norm.weight",),
    "idx_wq_b": ("self_attn.compressor.indexer.q_b_proj.weight",),
    "idx_weights": ("self_attn.compressor.indexer.scorer.weights_proj.weight",),
}
_HCA = {k: _CSA[k] for k in ("wkv_gate", "ape", "norm")}


def expected_sidecar(model) -> dict[str, torch.Tensor]:
    """The sidecar a transformers ``DeepseekV4ForCausalLM`` implies, built from its own
    parameter names (independent of the pack spec's name resolution)."""
    sd, c = model.state_dict(), model.config
    out = {"embed": sd["model.embed_tokens.weight"], "head": sd["lm_head.weight"], "final_norm": sd["model.norm.weight"],
           "hc_head_fn": sd["model.hc_head.hc_fn"], "hc_head_base": sd["model.hc_head.hc_base"],
           "hc_head_scale": sd["model.hc_head.hc_scale"]}
    L = c.num_hidden_layers

    def rows(layer, names):
        return torch.cat([sd[f"model.layers.{layer}.{n}"] for n in names])

    for name, parts in _LAYERS.items():
        out[f"layers.{name}"] = torch.stack([rows(i, parts) for i in range(L)])
    hashed = [i for i in range(L) if c.mlp_layer_types[i] == "hash_moe"]
    out["layers.gate_bias"] = torch.stack([
        torch.zeros(c.n_routed_experts) if i in hashed else sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        for i in range(L)])
    if hashed:
        out["hash.tid2eid"] = torch.stack([sd[f"model.layers.{i}.mlp.gate.tid2eid"] for i in hashed]).int()
    for kind, prefix, table in ((CSA, "csa", _CSA), (HCA, "hca", _HCA)):
        layers = [i for i in range(L) if c.layer_types[i] == kind]
        if layers:
            out.update({f"{prefix}.{n}": torch.stack([rows(i, parts) for i in layers]) for n, parts in table.items()})
    blocks = getattr(model, "mtp_blocks", [])
    if blocks:  # the MTP blocks: their layer's tensors as a layer's, then their own
        own = {"e_proj": "e_proj.weight", "h_proj": "h_proj.weight", "enorm": "enorm.weight",
               "hnorm": "hnorm.weight", "norm": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
               "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
        states = [b.state_dict() for b in blocks]
        for name, parts in _LAYERS.items():
            out[f"mtp.{name}"] = torch.stack([torch.cat([st[f"layer.{n}"] for n in parts]) for st in states])
        out["mtp.gate_bias"] = torch.stack([st["layer.mlp.gate.e_score_correction_bias"] for st in states])
        out.update({f"mtp.{name}": torch.stack([st[n] for st in states]) for name, n in own.items()})
    return out


#: What transformers keeps in float32 at any dtype (``_keep_in_fp32_modules_strict``: the
#: hyper-connections, sinks, position biases, router bias and norms), by sidecar name.
FLOAT32_NAMES = {
    "final_norm", "hc_head_fn", "hc_head_base", "hc_head_scale", "layers.attn_norm", "layers.ffn_norm",
    "layers.hc_attn_fn", "layers.hc_attn_base", "layers.hc_attn_scale", "layers.hc_ffn_fn", "layers.hc_ffn_base",
    "layers.hc_ffn_scale", "layers.q_norm", "layers.kv_norm", "layers.attn_sink", "layers.gate_bias",
    "csa.ape", "csa.norm", "csa.idx_ape", "csa.idx_norm", "hca.ape", "hca.norm",
    "mtp.attn_norm", "mtp.ffn_norm", "mtp.hc_attn_fn", "mtp.hc_attn_base", "mtp.hc_attn_scale", "mtp.hc_ffn_fn",
    "mtp.hc_ffn_base", "mtp.hc_ffn_scale", "mtp.q_norm", "mtp.kv_norm", "mtp.attn_sink", "mtp.gate_bias",
    "mtp.enorm", "mtp.hnorm", "mtp.norm", "mtp.hc_head_fn", "mtp.hc_head_base", "mtp.hc_head_scale",
}


def _check(sidecar_path: Path, model, dtype: torch.dtype = torch.float32) -> None:
    expected = expected_sidecar(model)
    with load_sidecar(sidecar_path) as sc:
        assert set(sc.tensors) == set(expected)
        for name, want in expected.items():
            got = sc.tensors[name]
            want = want if not want.is_floating_point() else want.to(
                torch.float32 if name in FLOAT32_NAMES else dtype)
            assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("case", [
    dict(naming="release"),
    dict(naming="release", shards=3, preset=TINY_HC4),
    dict(naming="release", quantized=True),
    dict(naming="release", quantized=True, shards=4, fp4_dtype=torch.float4_e2m1fn_x2),
    dict(naming="transformers"),
    dict(naming="transformers", quantized=True, shards=2),
    dict(naming="saved"),
], ids=["release", "release-sharded", "release-fp8-fp4", "release-fp8-f4-sharded", "transformers",
        "transformers-fp8-fp4-sharded", "saved"])
def test_every_sidecar_tensor_is_the_checkpoint_tensor(tmp_path, case):
    case = dict(case)
    preset = case.pop("preset", TINY_ALL_KINDS)
    model = write_tiny_deepseek_v4(tmp_path / "ckpt", preset, **case)
    handle = prepare(str(tmp_path / "ckpt"), dtype="f32", root=tmp_path / "sc")
    assert handle.family == "deepseek_v4" and handle.state == "BUILT"
    assert len(model.mtp_blocks) == 1
    _check(handle.path, model)
    if case.get("quantized"):  # the checkpoint really stores FP8 / FP4 codes and ue8m0 scales
        dtypes = set()
        for shard in (tmp_path / "ckpt").glob("*.safetensors"):
            raw = shard.read_bytes()
            header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
            dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
        fp4 = "F4" if case.get("fp4_dtype") == torch.float4_e2m1fn_x2 else "I8"
        assert {"F8_E4M3", "F8_E8M0", fp4} <= dtypes


def test_bf16_sidecar_rounds_each_dequantized_value(tmp_path):
    """bf16 sidecar: matrices rounded to bfloat16, the float32-kept tensors exact."""
    model = write_tiny_deepseek_v4(tmp_path / "ckpt", TINY_ALL_KINDS, quantized=True, mtp=False)
    handle = prepare(str(tmp_path / "ckpt"), dtype="bf16", root=tmp_path / "sc")
    _check(handle.path, model, dtype=torch.bfloat16)


def test_sidecar_metadata_records_layout_facts(tmp_path):
    model = write_tiny_deepseek_v4(tmp_path / "ckpt", TINY_ALL_KINDS, quantized=True)
    info = validate_sidecar(prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc").path)
    facts = json.loads(info.metadata["warmserve.layout_facts"])
    assert facts == {"layer_types": list(model.config.layer_types), "mlp_layer_types": ["hash_moe", "moe", "moe"],
                     "compress_rates": {CSA: 4, HCA: 8}, "sliding_window": 8, "hc_mult": 2, "index_topk": 2}
    assert "warmserve.extra_tensors" not in info.metadata
    names = sorted(FAMILY.tensor_specs(info.config, "f32"))
    assert {"mtp.e_proj", "mtp.experts_gate_up", "mtp.hc_head_fn"} <= set(names)
    names_fp = hashlib.sha256("\n".join(names).encode()).hexdigest()
    assert info.metadata["warmserve.names_fingerprint"] == names_fp
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    text = "\n".join([f"format={FORMAT_VERSION}", "family=deepseek_v4", f"spec={FAMILY.pack_version}", "dtype=f32",
                      f"source={info.metadata['warmserve.source_fingerprint']}", f"names={names_fp}",
                      f"layout={canonical}"])
    assert info.fingerprint == hashlib.sha256(text.encode()).hexdigest()


def test_empty_layout_facts_leave_the_fingerprint_formula_unchanged():
    legacy = hashlib.sha256("\n".join([f"format={FORMAT_VERSION}", "family=llama", "spec=1", "dtype=f32",
                                       "source=s", "names=n"]).encode()).hexdigest()
    assert sidecar_fingerprint("llama", "1", "f32", "s", "n") == legacy
    assert sidecar_fingerprint("llama", "1", "f32", "s", "n", "") == legacy
    assert sidecar_fingerprint("llama", "1", "f32", "s", "n", '{"a":1}') != legacy


# ---- staleness and edits ----


def _edit_header(weights: Path, edit) -> None:
    """Rewrite the safetensors header with ``edit(dict) -> dict``, padded to its old length."""
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    new = json.dumps(edit(header), separators=(",", ":")).encode()
    assert len(new) <= n
    weights.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


@pytest.fixture
def packed(tmp_path):
    write_tiny_deepseek_v4(tmp_path / "ckpt", TINY_ALL_KINDS)
    return tmp_path, prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc")


def _renamed(old: str, new: str):
    return lambda h: {(new if k == old else k): v for k, v in h.items()}


@pytest.mark.parametrize("edit,reason", [
    (lambda h: {k: v for k, v in h.items() if k != "csa.ape"}, r"missing \['csa.ape'\]"),
    (_renamed("hca.norm", "hca.nrm"), r"unexpected \['hca.nrm'\], missing \['hca.norm'\]"),
    (_renamed("mtp.hnorm", "mtp.hnrm"), r"unexpected \['mtp.hnrm'\], missing \['mtp.hnorm'\]"),
    (lambda h: {k: v for k, v in h.items() if k != "mtp.norm"}, r"missing \['mtp.norm'\]"),
])
def test_a_sidecar_lacking_or_renaming_a_tensor_is_stale_with_its_name(packed, edit, reason):
    tmp_path, handle = packed
    _edit_header(handle.path / "model.safetensors", edit)
    with pytest.raises(InvalidSidecar, match="is stale or edited: its tensor names do not match its metadata .*" + reason):
        validate_sidecar(handle.path)
    again = prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc")
    assert again.state == "REBUILT" and again.fingerprint == handle.fingerprint


def test_edited_layout_facts_are_stale_with_the_fact(packed):
    tmp_path, handle = packed

    def edit(h):
        meta = h["__metadata__"]
        meta["warmserve.layout_facts"] = meta["warmserve.layout_facts"].replace('"sliding_window":8', '"sliding_window":9')
        return h

    _edit_header(handle.path / "model.safetensors", edit)
    with pytest.raises(InvalidSidecar, match=re.escape("is stale: sidecar layout facts differ from what its config "
                                                       "implies: sliding_window (sidecar 9, config 8)")):
        validate_sidecar(handle.path)


def test_changed_layout_rules_make_the_sidecar_stale_and_repack(packed, monkeypatch):
    tmp_path, handle = packed
    facts = FAMILY.layout_facts
    monkeypatch.setattr(type(FAMILY), "layout_facts", lambda self, c: {**facts(c), "index_topk": 3})
    with pytest.raises(InvalidSidecar, match=r"layout facts differ .*index_topk \(sidecar 2, config 3\)"):
        validate_sidecar(handle.path)
    again = prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc")
    assert again.state == "REBUILT" and again.fingerprint != handle.fingerprint


def test_config_disagreeing_with_the_weights_is_invalid_argument_and_leaves_nothing(tmp_path):
    """A config.json whose vocab_size does not match the tensors is bad input (INVALID_ARGUMENT,
    exit 2), and the failed first pack leaves no sidecar directory behind."""
    write_tiny_deepseek_v4(tmp_path / "ckpt", TINY_ALL_KINDS)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["vocab_size"] = 64
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match=r"checkpoint tensor for embed has shape \[128, 64\]"):
        prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc")
    assert [p for p in (tmp_path / "sc").iterdir() if not p.name.startswith(".")] == []  # only the lock dir


@pytest.mark.parametrize("naming", ["release", "transformers"])
def test_a_checkpoint_missing_an_mtp_tensor_or_holding_an_undeclared_block_is_refused_at_pack_time(tmp_path, naming):
    ckpt = tmp_path / "ckpt"
    write_tiny_deepseek_v4(ckpt, TINY_ALL_KINDS, naming=naming)
    weights = ckpt / "model.safetensors"
    state = load_file(str(weights))
    for drop in ("mtp.0.h_proj.weight", "mtp.0.ffn.experts.3.w2.weight", "mtp.0.attn.attn_sink"):
        save_file({k: v for k, v in state.items() if k != drop}, str(weights))
        with pytest.raises(InvalidArgument, match=re.escape(f"lacks tensor {drop}") + ".*declares 1 MTP block"):
            prepare(str(ckpt), root=tmp_path / "sc")
        assert not any((tmp_path / "sc").glob("*/model.safetensors"))  # nothing published
    extra = {k.replace("mtp.0.", "mtp.1.", 1): v.clone() for k, v in state.items() if k.startswith("mtp.0.")}
    save_file({**state, **extra}, str(weights))
    with pytest.raises(InvalidArgument, match=re.escape("holds MTP block mtp.1.* but its config declares 1")):
        prepare(str(ckpt), root=tmp_path / "sc")
    save_file(state, str(weights))  # the whole block again: packs
    assert prepare(str(ckpt), root=tmp_path / "sc").state == "BUILT"
