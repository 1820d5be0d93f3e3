"""Packing tiny Llama-family checkpoints: the documented layout, exactly, for every variant
(single file or sharded, tied or untied, q/k/v bias, float32 or bfloat16)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from weights_tiny import write_tiny_checkpoint

from services.errors import InvalidArgument
from weight_service.gguf_reader import unpermute_rotary
from weight_service.loader import load_sidecar
from weight_service.prepare import prepare


def _expect_layout(sd: dict, layers: int, *, tied: bool, bias: bool, dtype=torch.float32) -> dict:
    """The layout the runner consumes, built from the HF state dict by the contract's definition."""

    def stack(fn):
        return torch.stack([fn(f"model.layers.{i}.") for i in range(layers)]).to(dtype)

    out = {
        "embed_tokens": sd["model.embed_tokens.weight"].to(dtype),
        "final_norm": sd["model.norm.weight"].to(dtype),
        "layers.input_norm": stack(lambda p: sd[p + "input_layernorm.weight"]),
        "layers.post_attn_norm": stack(lambda p: sd[p + "post_attention_layernorm.weight"]),
        "layers.qkv_proj": stack(lambda p: torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])),
        "layers.o_proj": stack(lambda p: sd[p + "self_attn.o_proj.weight"]),
        "layers.gate_up_proj": stack(lambda p: torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])),
        "layers.down_proj": stack(lambda p: sd[p + "mlp.down_proj.weight"]),
    }
    if not tied:
        out["lm_head"] = sd["lm_head.weight"].to(dtype)
    if bias:
        out["layers.qkv_bias"] = stack(lambda p: torch.cat([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    return out


@pytest.mark.parametrize(
    "tied,bias,shards,arch",
    [(True, False, 1, "LlamaForCausalLM"), (False, False, 3, "LlamaForCausalLM"), (False, True, 2, "Qwen2ForCausalLM")],
)
def test_pack_layout_equals_contract(tmp_path, tied, bias, shards, arch):
    sd = write_tiny_checkpoint(tmp_path / "ckpt", layers=3, tied=tied, bias=bias, shards=shards, architecture=arch)
    handle = prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc")
    assert handle.state == "BUILT" and handle.family == "llama" and handle.dtype == "f32"
    expected = _expect_layout(sd, 3, tied=tied, bias=bias)
    with load_sidecar(handle.path) as sc:
        assert set(sc.tensors) == set(expected)
        for name, ref in expected.items():
            assert sc.tensors[name].dtype == torch.float32
            assert torch.equal(sc.tensors[name], ref), name
        assert sc.config["tie_word_embeddings"] is tied and sc.config["attention_bias"] is bias
        assert sc.config["architecture"] == arch
        assert sc.tensors["layers.qkv_proj"].shape == (3, (4 + 2 * 2) * 8, 32)


def test_bf16_pack_rounds_each_value(tmp_path):
    sd = write_tiny_checkpoint(tmp_path / "ckpt", tied=False)
    handle = prepare(str(tmp_path / "ckpt"), dtype="bf16", root=tmp_path / "sc")
    assert handle.dtype == "bf16" and handle.path.name.endswith("-llama-bf16")
    expected = _expect_layout(sd, 2, tied=False, bias=False, dtype=torch.bfloat16)
    with load_sidecar(handle.path) as sc:
        assert sc.metadata["warmserve.dtype"] == "bf16"
        for name, ref in expected.items():
            assert sc.tensors[name].dtype == torch.bfloat16
            assert torch.equal(sc.tensors[name], ref), name
    # f32 and bf16 sidecars of one source live side by side with different fingerprints.
    f32 = prepare(str(tmp_path / "ckpt"), dtype="f32", root=tmp_path / "sc")
    assert f32.path != handle.path and f32.fingerprint != handle.fingerprint


def test_sidecar_is_standard_safetensors_with_contract_metadata(tmp_path):
    sd = write_tiny_checkpoint(tmp_path / "ckpt", tokenizer=True)
    handle = prepare(str(tmp_path / "ckpt"), root=tmp_path / "sc")
    weights = handle.path / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata()
    assert meta["warmserve.format_version"] == "2" and meta["warmserve.family"] == "llama"
    assert meta["warmserve.dtype"] == "f32" and meta["warmserve.fingerprint"] == handle.fingerprint
    assert meta["warmserve.source"] == str((tmp_path / "ckpt").resolve())
    assert len(meta["warmserve.source_fingerprint"]) == 64 and len(meta["warmserve.names_fingerprint"]) == 64
    cfg = json.loads(meta["warmserve.config"])
    assert cfg == json.loads((handle.path / "config.json").read_text())
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_scaling"] is None and cfg["eos_token_id"] == [2, 3]
    assert cfg["head_dim"] == 8 and cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 256
    loaded = load_file(str(weights))  # the reference reader accepts the file
    assert torch.equal(loaded["embed_tokens"], sd["model.embed_tokens.weight"])
    assert handle.size_bytes == weights.stat().st_size
    # Tokenizer copied; tokenizer_config reduced to the runner's keys, tokens as strings.
    assert (handle.path / "tokenizer.json").read_bytes() == (tmp_path / "ckpt" / "tokenizer.json").read_bytes()
    tcfg = json.loads((handle.path / "tokenizer_config.json").read_text())
    assert tcfg == {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                    "bos_token": "w1", "eos_token": "w2", "add_bos_token": True}


def test_llama3_rope_scaling_and_transformers_checkpoint(tmp_path):
    """A checkpoint written by transformers itself (sharded save_pretrained): the pack equals its
    state dict, and the llama3 rope parameters pass through with HF semantics."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                      max_position_embeddings=256, rope_parameters=rope)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    handle = prepare(str(tmp_path / "hf"), root=tmp_path / "sc")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    expected = _expect_layout(sd, 2, tied=False, bias=False)
    with load_sidecar(handle.path) as sc:
        for name, ref in expected.items():
            assert torch.equal(sc.tensors[name], ref), name
        assert sc.config["rope_theta"] == 500000.0
        assert sc.config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
        assert sc.config["num_key_value_heads"] == 1 and sc.config["head_dim"] == 8


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF -> GGUF row order).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 8)])
def test_unpermute_inverts_llamacpp_permutation(n_head, head_dim):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, 12)).astype(np.float32)
    permuted = _llamacpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rotary(permuted, n_head), w)
    b = np.arange(n_head * head_dim, dtype=np.float32)
    assert np.array_equal(unpermute_rotary(_llamacpp_permute(b, n_head), n_head), b)


def test_unsupported_checkpoints_are_invalid_arguments(tmp_path):
    write_tiny_checkpoint(tmp_path / "gpt", architecture="GPT2LMHeadModel")
    with pytest.raises(InvalidArgument, match="no pack spec for architecture 'GPT2LMHeadModel'"):
        prepare(str(tmp_path / "gpt"), root=tmp_path / "sc")
    from safetensors.torch import save_file

    sd = write_tiny_checkpoint(tmp_path / "obias")
    sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(sd, str(tmp_path / "obias" / "model.safetensors"))
    with pytest.raises(InvalidArgument, match="no place for model.layers.0.self_attn.o_proj.bias"):
        prepare(str(tmp_path / "obias"), root=tmp_path / "sc")
    assert not list((tmp_path / "sc").glob("obias-*/model.safetensors"))
    assert not list((tmp_path / "sc").glob("obias-*/.tmp-*"))
