"""Tiny random Llama-family checkpoints written with ``safetensors`` directly (test helper).

The returned state dict is the reference: the sidecar must hold exactly these values in the
documented layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers


def tiny_state_dict(*, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=96,
                    tied=True, bias=False, seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random weights under HF Llama names (``[out, in]`` matrices)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": rnd(hidden)}
    if not tied:
        sd["lm_head.weight"] = rnd(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rnd(hidden)
        sd[p + "post_attention_layernorm.weight"] = rnd(hidden)
        sd[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        if bias:
            sd[p + "self_attn.q_proj.bias"] = rnd(heads * head_dim)
            sd[p + "self_attn.k_proj.bias"] = rnd(kv_heads * head_dim)
            sd[p + "self_attn.v_proj.bias"] = rnd(kv_heads * head_dim)
        sd[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        sd[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden)
        sd[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden)
        sd[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate)
    return sd


def write_tiny_checkpoint(directory: Path, *, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8,
                          intermediate=48, vocab=96, tied=True, bias=False, shards=1, seed=0,
                          architecture="LlamaForCausalLM", tokenizer=False, extra_config=None,
                          dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Write ``config.json`` and ``model.safetensors`` (or ``shards`` files plus
    ``model.safetensors.index.json``) into ``directory``; returns the state dict written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sd = tiny_state_dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         intermediate=intermediate, vocab=vocab, tied=tied, bias=bias, seed=seed, dtype=dtype)
    config = {
        "architectures": [architecture], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"},
        "max_position_embeddings": 256, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": [2, 3],
        **(extra_config or {}),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(sd)
    if shards == 1:
        save_file(sd, str(directory / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: sd[n] for n in part}, str(directory / fname))
            weight_map.update({n: fname for n in part})
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        write_word_tokenizer(directory, vocab)
    return sd


def write_word_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level ``tokenizer.json`` (token ``i`` is the word ``w{i}``, whitespace-split) and a
    ``tokenizer_config.json`` with a trivial chat template, in ``directory``."""
    vocab_map = {f"w{i}": i for i in range(vocab)}
    vocab_map["[UNK]"] = vocab
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(directory) / "tokenizer.json"))
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "w1"}, "eos_token": "w2", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))


def _llamacpp_permute(w, n_head: int):
    """llama.cpp's ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` (HF -> GGUF q/k row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, *, matrix_type: str = "Q4_1", embed_type: str = "Q8_0", layers=2, hidden=64,
                    heads=4, kv_heads=2, intermediate=96, vocab=64, seed=0, metadata=None) -> dict[str, torch.Tensor]:
    """A tiny Llama GGUF as llama.cpp writes one: the layer matrices in ``matrix_type``, the
    token embedding in ``embed_type`` (tied head), norms in F32, q/k rows permuted, a byte-level
    vocabulary of single characters, BOS 1 and EOS 2. ``metadata``, when given, is called with
    the ``gguf.GGUFWriter`` to add more keys. Returns the HF-layout float state dict it was
    quantized from."""
    import gguf
    import numpy as np

    sd = tiny_state_dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
                         intermediate=intermediate, vocab=vocab, tied=True, seed=seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("!") + i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if metadata is not None:
        metadata(w)

    def put(name: str, t: torch.Tensor, kind: str) -> None:
        arr = t.float().numpy()
        qtype = gguf.GGMLQuantizationType[kind]
        data = arr if kind == "F32" else gguf.quants.quantize(arr, qtype)
        w.add_tensor(name, data, raw_dtype=None if kind == "F32" else qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], embed_type)
    put("output_norm.weight", sd["model.norm.weight"], "F32")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for i in range(layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], "F32")
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], "F32")
        for g, h in names.items():
            m = sd[p + h + ".weight"]
            if g in ("attn_q", "attn_k"):
                m = torch.from_numpy(np.ascontiguousarray(_llamacpp_permute(m.numpy(), heads if g == "attn_q" else kv_heads)))
            put(f"blk.{i}.{g}.weight", m, matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd
