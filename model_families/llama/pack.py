"""The Llama-family sidecar layout (SmolLM2, Llama 2/3, Mistral, Qwen2-style GQA with q/k/v bias;
tied or untied embeddings): the one statement of it (:func:`tensor_shapes`) and the rule that
fills it from a checkpoint under HF names.

Layout (L layers, H hidden, nh/nkv heads, hd head_dim, I intermediate, V vocab); every matrix is
``[out, in]`` as ``torch.nn.functional.linear`` expects, rows in HF order:

==========================  ==========================  =========================================
name                        shape                       from (HF names, layer ``i``)
==========================  ==========================  =========================================
``embed_tokens``            ``[V, H]``                  ``model.embed_tokens.weight``
``lm_head``                 ``[V, H]``                  ``lm_head.weight`` (untied only)
``final_norm``              ``[H]``                     ``model.norm.weight``
``layers.input_norm``       ``[L, H]``                  ``input_layernorm.weight``
``layers.post_attn_norm``   ``[L, H]``                  ``post_attention_layernorm.weight``
``layers.qkv_proj``         ``[L, (nh+2nkv)*hd, H]``    ``q_proj`` rows, then ``k_proj``, ``v_proj``
``layers.qkv_bias``         ``[L, (nh+2nkv)*hd]``       q/k/v biases (``attention_bias`` only)
``layers.o_proj``           ``[L, H, nh*hd]``           ``o_proj.weight``
``layers.gate_up_proj``     ``[L, 2I, H]``              ``gate_proj`` rows, then ``up_proj``
``layers.down_proj``        ``[L, H, I]``               ``down_proj.weight``
==========================  ==========================  =========================================
"""

from __future__ import annotations

import torch

from model_families.family import Checkpoint
from model_families.llama.config import LlamaConfig
from services.errors import InvalidArgument

#: Changes whenever the layout above changes (enters the sidecar fingerprint).
PACK_VERSION = "1"


def tensor_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Sidecar tensor name -> full shape for ``c`` (``lm_head`` only when untied, ``qkv_bias``
    only with ``attention_bias``)."""
    L, H, V, inter = c.num_hidden_layers, c.hidden_size, c.vocab_size, c.intermediate_size
    shapes = {
        "embed_tokens": (V, H),
        "final_norm": (H,),
        "layers.input_norm": (L, H),
        "layers.post_attn_norm": (L, H),
        "layers.qkv_proj": (L, c.qkv_size, H),
        "layers.o_proj": (L, H, c.num_attention_heads * c.head_dim),
        "layers.gate_up_proj": (L, 2 * inter, H),
        "layers.down_proj": (L, H, inter),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    if c.attention_bias:
        shapes["layers.qkv_bias"] = (L, c.qkv_size)
    return shapes


def global_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """``embed_tokens``, ``final_norm`` and (untied) ``lm_head`` from the checkpoint."""
    out = {
        "embed_tokens": ckpt.tensor("model.embed_tokens.weight"),
        "final_norm": ckpt.tensor("model.norm.weight"),
    }
    if not ckpt.config.tie_word_embeddings:
        out["lm_head"] = ckpt.tensor("lm_head.weight")
    return out


def layer_tensors(ckpt: Checkpoint, layer: int) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s slice of each stacked tensor, fused as the table says. Raises
    ``InvalidArgument`` for a tensor the layout has no place for (an ``o_proj`` or MLP bias)."""
    p = f"model.layers.{layer}."
    for unsupported in ("self_attn.o_proj.bias", "mlp.gate_proj.bias"):
        if ckpt.has(p + unsupported):
            raise InvalidArgument(f"the llama pack spec has no place for {p + unsupported}")
    out = {
        "layers.input_norm": ckpt.tensor(p + "input_layernorm.weight"),
        "layers.post_attn_norm": ckpt.tensor(p + "post_attention_layernorm.weight"),
        "layers.qkv_proj": torch.cat([ckpt.tensor(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
        "layers.o_proj": ckpt.tensor(p + "self_attn.o_proj.weight"),
        "layers.gate_up_proj": torch.cat([ckpt.tensor(p + "mlp.gate_proj.weight"),
                                          ckpt.tensor(p + "mlp.up_proj.weight")]),
        "layers.down_proj": ckpt.tensor(p + "mlp.down_proj.weight"),
    }
    if ckpt.config.attention_bias:
        out["layers.qkv_bias"] = torch.cat([ckpt.tensor(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
    return out
