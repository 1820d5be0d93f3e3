"""DeepSeek V4 groundwork (issue 12): our config against transformers' ``DeepseekV4Config``, its
validation, and the tiny release-named checkpoint writer (``tests/deepseek_v4_tiny.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_v4_tiny import TINY_ALL_KINDS, TINY_HC4, release_state_dict, tiny_config, write_tiny_deepseek_v4
from safetensors import safe_open

from model_families.deepseek_v4.config import CSA, HCA, WINDOW, DeepseekV4Config
from services.errors import InvalidArgument

PRESETS = {"all_kinds": TINY_ALL_KINDS, "hc4": TINY_HC4}
SEQ = 24  # > sliding_window 8 and HCA rate 8; 6 CSA entries > index_topk 2


def _agrees(ours: DeepseekV4Config, ref) -> None:
    """Every field serving derives agrees with transformers' resolved config."""
    assert list(ours.layer_types) == ref.layer_types
    assert list(ours.mlp_layer_types) == ref.mlp_layer_types
    assert ours.compress_rates == ref.compress_rates
    assert ours.qk_rope_head_dim == ref.qk_rope_head_dim
    # transformers keeps a legacy ``type`` key next to ``rope_type``; we drop it
    assert ours.rope_parameters == {label: {k: v for k, v in rope.items() if k != "type"}
                                    for label, rope in ref.rope_parameters.items()}
    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
                 "n_shared_experts", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                 "sliding_window", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "rms_norm_eps",
                 "rope_theta", "compress_rope_theta", "scoring_func", "routed_scaling_factor",
                 "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                 "num_nextn_predict_layers"):
        assert getattr(ours, name) == getattr(ref, name), name
    ratios = {WINDOW: 0, **ref.compress_rates}
    assert ours.compress_ratios == tuple(ratios[t] for t in ref.layer_types)
    assert ours.hash_layers == tuple(i for i, t in enumerate(ref.mlp_layer_types) if t == "hash_moe")
    for i in range(ref.num_hidden_layers):
        assert ours.rope_label(i) == ("main" if ref.layer_types[i] == WINDOW else "compress")


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_config_json_agrees_with_transformers(tmp_path, preset) -> None:
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    write_tiny_deepseek_v4(tmp_path, PRESETS[preset])
    data = json.loads((tmp_path / "config.json").read_text())
    ours, ref = DeepseekV4Config.from_dict(data), HFConfig.from_pretrained(tmp_path)
    _agrees(ours, ref)
    assert ours == DeepseekV4Config.from_hf(data) == DeepseekV4Config.from_dict(json.loads(ours.to_json()))
    rotary = DeepseekV4RotaryEmbedding(ref)
    for label in ("main", "compress"):
        assert ours.rope_attention_factor(label) == getattr(rotary, f"{label}_attention_scaling")
    assert ours.hc_mix_size == (2 + ref.hc_mult) * ref.hc_mult


def test_presets_cover_the_acceptance_configs() -> None:
    kinds = DeepseekV4Config.from_hf(TINY_ALL_KINDS)
    assert kinds.hc_mult == 2 and set(kinds.layer_types) == {WINDOW, CSA, HCA}
    assert kinds.layers_of(WINDOW) == (0,) and kinds.layers_of(CSA) == (1,) and kinds.layers_of(HCA) == (2,)
    hc4 = DeepseekV4Config.from_hf(TINY_HC4)
    assert hc4.hc_mult == 4 and hc4.num_hidden_layers == 2
    for c in (kinds, hc4):
        assert SEQ > c.sliding_window and SEQ > c.hca_compress_rate
        assert c.index_topk < SEQ // c.csa_compress_rate


LEGACY = {  # the release's own config.json spellings, folded by transformers' __post_init__
    "vocab_size": 128, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5,
    "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "num_experts_per_tok": 2,
    "n_routed_experts": 4, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16,
    "index_topk": 2, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("drop", [(), ("compress_ratios",), ("num_hash_layers",), ("qk_rope_head_dim", "rope_scaling")])
def test_defaults_and_legacy_keys_match_transformers(drop) -> None:
    from transformers import DeepseekV4Config as HFConfig

    data = {k: v for k, v in LEGACY.items() if k not in drop}
    _agrees(DeepseekV4Config.from_hf(data), HFConfig(**json.loads(json.dumps(data))))


def test_legacy_layer_kinds_and_defaults() -> None:
    ours = DeepseekV4Config.from_hf(LEGACY)
    assert ours.layer_types == (WINDOW, CSA, HCA, CSA, WINDOW)
    assert ours.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe")
    assert ours.rope_parameters["compress"] == {
        "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
        "beta_slow": 1, "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "attention_factor": 1.0}
    assert ours.rope_parameters["main"] == {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25}
    default = DeepseekV4Config.from_hf({k: v for k, v in LEGACY.items() if k != "compress_ratios"})
    assert default.layer_types == (HCA, HCA, HCA, CSA, HCA)
    assert default.compress_ratios == (128, 128, 128, 4, 128)


@pytest.mark.parametrize(("change", "message"), [
    ({"head_dim": None}, "lacks 'head_dim'"),
    ({"index_topk": None, "o_groups": None}, "lacks 'o_groups', 'index_topk'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
    ({"n_shared_experts": 2}, "n_shared_experts must be 1"),
    ({"layer_types": [WINDOW, CSA]}, "layer_types must list one entry per layer (3)"),
    ({"layer_types": [WINDOW, CSA, "full_attention"]}, "layer_types entries must be one of"),
    ({"mlp_layer_types": ["moe", "dense", "moe"]}, "mlp_layer_types entries must be one of"),
    ({"compress_ratios": [0, 4, 64]}, "compress_ratios entries must be 0 (window-only), the CSA rate (4) or the HCA"),
    ({"compress_rates": {CSA: 4}}, "compress_rates must map exactly"),
    ({"compress_rates": {CSA: 0, HCA: 8}}, "compress_rates['compressed_sparse_attention'] must be a positive"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) exceeds n_routed_experts (4)"),
    ({"o_groups": 3}, "must be a multiple of o_groups (3)"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in (0, 1]"),
    ({"partial_rotary_factor": 3 / 32}, "qk_rope_head_dim (3) must be even"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type must be one of ('default', 'yarn')"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "is yarn and needs a factor >= 1"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ({"scoring_func": "relu"}, "scoring_func 'relu' is not one of"),
    ({"architectures": ["LlamaForCausalLM"]}, "is not DeepSeek V4"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
])
def test_bad_configs_say_what_is_wrong(change, message) -> None:
    data = {**TINY_ALL_KINDS, **change}
    if "compress_ratios" in change:
        data.pop("layer_types")
    with pytest.raises(InvalidArgument) as err:
        DeepseekV4Config.from_hf({k: v for k, v in data.items() if v is not None})
    assert message in str(err.value)


def test_from_dict_round_trips_and_rejects_non_objects() -> None:
    ours = DeepseekV4Config.from_hf(TINY_HC4)
    assert DeepseekV4Config.from_dict(ours.to_dict()) == ours
    assert ours.eos_token_ids == (2,) and ours.qk_nope_head_dim == 24
    with pytest.raises(InvalidArgument, match="must be an object"):
        DeepseekV4Config.from_hf([1, 2])
    with pytest.raises(InvalidArgument, match="layer kind 'x' is not one of"):
        ours.layers_of("x")


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_writer_checkpoint_round_trips(tmp_path, preset) -> None:
    model = write_tiny_deepseek_v4(tmp_path, PRESETS[preset])
    hf_state = model.state_dict()
    expected = release_state_dict(hf_state)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    mtp = {k for k in written if k.startswith("mtp.")}
    assert mtp and set(written) - mtp == set(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    # release names, spot-checked against the examples
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.wq_a.weight",
            "layers.0.ffn.experts.3.w1.weight", "layers.0.ffn.gate.tid2eid"} <= set(written)
    cfg = model.config
    e, inter, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    merged = torch.stack([torch.cat([written[f"layers.1.ffn.experts.{i}.w1.weight"],
                                     written[f"layers.1.ffn.experts.{i}.w3.weight"]]) for i in range(e)])
    assert merged.shape == (e, 2 * inter, h)
    assert torch.equal(merged, hf_state["model.layers.1.mlp.experts.gate_up_proj"])
    # the parameters transformers initialises to zero were re-randomised
    for name, tensor in written.items():
        if name.endswith(("attn_sink", ".ape", "_base", "gate.bias", "tid2eid")):
            assert tensor.count_nonzero() > tensor.numel() // 2, name
    tid2eid = written["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert int(tid2eid.max()) < e and all(len(set(row.tolist())) == len(row) for row in tid2eid)
    assert (tmp_path / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")  # restores the thread count: it is part of program keys
@pytest.mark.parametrize("preset", PRESETS)
def test_transformers_loads_the_release_names_and_runs(tmp_path, preset) -> None:
    from transformers import DeepseekV4ForCausalLM

    model = write_tiny_deepseek_v4(tmp_path, PRESETS[preset])
    loaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    ref, got = model.state_dict(), loaded.state_dict()
    assert set(ref) == set(got)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    ids = torch.randint(0, 127, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = loaded(ids, use_cache=False).logits
    assert logits.shape == (2, SEQ, model.config.vocab_size) and torch.isfinite(logits).all()
    with torch.no_grad():
        assert torch.equal(logits, model(ids, use_cache=False).logits)
    assert logits.std() > 0.1  # the random model is not near-constant


@pytest.mark.slow
def test_tiny_config_matches_preset() -> None:
    cfg = tiny_config(TINY_ALL_KINDS)
    assert cfg.layer_types == TINY_ALL_KINDS["layer_types"] and cfg.hc_mult == 2
