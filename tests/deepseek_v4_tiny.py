"""Tiny random DeepSeek V4 checkpoints in the original release naming (test helper, and the
documented way to get a DeepSeek V4 checkpoint to try warmserve on without downloading one).

``write_tiny_deepseek_v4(directory, TINY_ALL_KINDS)`` writes ``model.safetensors`` (release
names: ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``mtp.0.*`` ...), transformers' ``config.json`` and a word-level tokenizer, and returns the
transformers ``DeepseekV4ForCausalLM`` it was drawn from (the reference). ``release_state_dict``
is the one statement of the transformers -> release naming: the inverse of the ``deepseek_v4``
entry of ``transformers/conversion_mapping.py``; ``DeepseekV4ForCausalLM.from_pretrained`` loads
the written directory back through that mapping (the test checks it).

transformers' initialisation zeroes ``tid2eid``, the attention ``sinks``, the compressor and
indexer ``position_bias``, the hyper-connection ``base`` terms and the router bias, and sets norm
weights and hyper-connection scales to one; :func:`tiny_model` re-randomises all of them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from weights_tiny import write_word_tokenizer

_COMMON = dict(
    vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4, sliding_window=8, o_groups=2,
    o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=2, max_position_embeddings=256,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    bos_token_id=1, eos_token_id=2, initializer_range=0.1, num_nextn_predict_layers=1,
)

#: hc_mult 2 and all three layer kinds (window-only, CSA, HCA); the first MLP is hash-routed.
#: Window 8, CSA rate 4, HCA rate 8, index_topk 2: a 24-token sequence runs past the window and
#: the HCA rate and gives the CSA indexer 6 entries to choose 2 from.
TINY_ALL_KINDS = dict(
    _COMMON, num_hidden_layers=3, hc_mult=2,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
)

#: 2 layers, hc_mult 4: CSA then HCA, hash-routed then top-k MoE.
TINY_HC4 = dict(
    _COMMON, num_hidden_layers=2, hc_mult=4,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe"],
)

#: Tokenizer words: ``w0 .. w{TOKENIZER_WORDS-1}`` are ids 0.., ``[UNK]`` is the next id.
TOKENIZER_WORDS = 127

#: transformers name -> release name, for every key but the merged experts (first match wins;
#: ``{n}`` is the layer index). The inverse of transformers' ``deepseek_v4`` conversion mapping.
_LAYER_RENAMES = (
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
)
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def release_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release-named state dict of a transformers ``DeepseekV4ForCausalLM`` state dict:
    renamed per the tables above, and each ``mlp.experts.gate_up_proj`` [E, 2I, H] split into
    per-expert ``w1`` (rows :I) and ``w3`` (rows I:), ``down_proj`` [E, H, I] into ``w2``
    (transformers merges them with ``MergeModulelist(dim=0)`` + ``Concatenate(dim=1)``). Values
    are the same tensors (contiguous copies where split)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key in _GLOBAL_RENAMES:
            out[_GLOBAL_RENAMES[key]] = value
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m is None:
            raise KeyError(f"no release name for {key!r}")
        layer, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = value[e, :half].contiguous()
                out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = value[e, half:].contiguous()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = value[e].contiguous()
            continue
        for hf, release in _LAYER_RENAMES:
            if rest.startswith(hf):
                out[f"layers.{layer}.{release}{rest[len(hf):]}"] = value
                break
        else:
            raise KeyError(f"no release name for {key!r}")
    return out


def tiny_config(preset: dict, **overrides):
    """A ``transformers.DeepseekV4Config`` from a preset (``TINY_ALL_KINDS``, ``TINY_HC4``)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**preset, **overrides})


def tiny_model(preset: dict, seed: int = 0, **overrides):
    """A random float32 ``DeepseekV4ForCausalLM`` (eval mode, eager attention) with the
    parameters transformers initialises to constants re-randomised: ``tid2eid`` (k distinct
    experts per token), ``sinks``, compressor/indexer ``position_bias``, hyper-connection
    ``base``/``scale`` and ``hc_head`` terms, the router bias and every norm weight."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(preset, **overrides)
    model = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(config.n_routed_experts, generator=g)[:config.num_experts_per_tok]
                        for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or re.search(
                    r"(hc\.base|hc_head\.hc_base)$", name):
                t.copy_(torch.randn(t.shape, generator=g))
            elif re.search(r"(hc\.scale|hc_head\.hc_scale)$", name) or (name.endswith("norm.weight")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
    return model


def write_tiny_deepseek_v4(directory: Path, preset: dict = TINY_ALL_KINDS, *, seed: int = 0,
                           dtype: torch.dtype = torch.float32, mtp: bool = True, **overrides):
    """Write a tiny DeepSeek V4 checkpoint in release naming to ``directory`` (created):
    ``model.safetensors``, ``config.json`` (transformers' ``to_dict``, ``architectures`` set),
    ``generation_config.json`` and a word tokenizer (``w{i}`` is token ``i``, BOS ``w1``, EOS
    ``w2``). Floating tensors are cast to ``dtype``. ``mtp`` adds a few ``mtp.0.*`` tensors
    (placeholder names under the release's MTP prefix, which serving must skip). Returns the
    float32 transformers model (the reference)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_model(preset, seed=seed, **overrides)
    state = release_state_dict(model.state_dict())
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    if mtp:
        g = torch.Generator().manual_seed(seed + 2)
        h = model.config.hidden_size
        for name, shape in (("mtp.0.e_proj.weight", (h, h)), ("mtp.0.h_proj.weight", (h, h)),
                            ("mtp.0.enorm.weight", (h,)), ("mtp.0.hnorm.weight", (h,)),
                            ("mtp.0.norm.weight", (h,))):
            state[name] = torch.randn(shape, generator=g).to(dtype)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}))
    write_word_tokenizer(directory, TOKENIZER_WORDS)
    return model
