"""The Llama family config from a sidecar config, EngineConfig validation, device selection."""

from __future__ import annotations

import pytest
import torch

from model_families.llama.config import LlamaConfig
from runner_service.config import EngineConfig
from runner_service.device import select_device, torch_dtype
from services.errors import InvalidArgument

SMOLLM2 = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "architecture": "LlamaForCausalLM",
}


def test_model_args_from_the_sidecar_config():
    a = LlamaConfig.from_dict(SMOLLM2)
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (30, 576, 9, 3, 64)
    assert a.qkv_size == (9 + 2 * 3) * 64 and a.eos_token_ids == (2,) and a.rope_type == "default"
    b = LlamaConfig.from_dict({**SMOLLM2, "eos_token_id": [2, 7], "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert b.eos_token_ids == (2, 7) and b.rope_type == "llama3"


@pytest.mark.parametrize("change", [
    {"num_hidden_layers": None}, {"num_attention_heads": 8}, {"rope_scaling": {"rope_type": "yarn", "factor": 2}},
    {"architecture": "GPT2LMHeadModel"}, {"hidden_size": 0}, {"vocab_size": "many"},
])
def test_model_args_reject_bad_configs(change):
    cfg = {k: v for k, v in {**SMOLLM2, **change}.items() if v is not None or k == "rope_scaling"}
    with pytest.raises(InvalidArgument):
        LlamaConfig.from_dict(cfg)


@pytest.mark.parametrize("bad", [
    dict(max_num_seqs=0), dict(block_size=0), dict(max_model_len=1), dict(kv_cache_bytes=0),
    dict(dtype="f16"), dict(compile="jit"), dict(kv_cache_memory_fraction=0), dict(num_threads=0),
    dict(max_num_batched_tokens=0), dict(default_max_tokens=0),
])
def test_engine_config_rejects_bad_values(bad):
    with pytest.raises(InvalidArgument):
        EngineConfig(**bad)


def test_context_length_defaults_and_limits():
    args = LlamaConfig.from_dict(SMOLLM2)
    assert EngineConfig().resolved_max_model_len(args) == 2048
    assert EngineConfig(max_model_len=8192).resolved_max_model_len(args) == 8192
    with pytest.raises(InvalidArgument, match="max_position_embeddings"):
        EngineConfig(max_model_len=8193).resolved_max_model_len(args)
    assert EngineConfig(max_model_len=4096).resolved_max_num_batched_tokens(4096) == 4096
    assert EngineConfig().resolved_max_num_batched_tokens(512) == 2048
    assert EngineConfig(max_num_batched_tokens=256).resolved_max_num_batched_tokens(4096) == 256


def test_device_selection_on_a_cpu_host():
    assert select_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device("auto").type in (expected, "npu")
    with pytest.raises(InvalidArgument):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="CUDA"):
            select_device("cuda:0")
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("f32") is torch.float32
    with pytest.raises(InvalidArgument):
        torch_dtype("int8")


def test_engine_config_defaults_are_the_declared_library_defaults():
    """Each option that sets an EngineConfig field declares that field's default (the library's;
    `runner serve` may differ on purpose: compile aoti, dtype auto, background compile on)."""
    import dataclasses

    from runner_service.options import COMPILE, DTYPE, RUNNER_OPTIONS

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    fielded = [o for o in RUNNER_OPTIONS if o.field]
    assert fielded and all(defaults[o.field] == o.default for o in fielded)
    assert (COMPILE.default, COMPILE.serve_default, DTYPE.default, DTYPE.serve_default) == ("off", "aoti", "f32", "auto")
