"""The Llama-family pack spec (SmolLM2, Llama 2/3, Mistral, Qwen2-style GQA with q/k/v bias;
tied or untied embeddings).

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

from services.errors import InvalidArgument
from weight_service.checkpoint import Checkpoint
from weight_service.model_config import ModelConfig
from weight_service.pack_spec import PackSpec


class LlamaPackSpec(PackSpec):
    """Fused, layer-stacked Llama layout (see the module docstring)."""

    name = "llama"
    version = "1"
    architectures = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

    def tensor_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        c = config
        L, H, hd, V, I = c.num_hidden_layers, c.hidden_size, c.head_dim, c.vocab_size, c.intermediate_size  # noqa: E741
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
        shapes = {
            "embed_tokens": (V, H),
            "final_norm": (H,),
            "layers.input_norm": (L, H),
            "layers.post_attn_norm": (L, H),
            "layers.qkv_proj": (L, qkv, H),
            "layers.o_proj": (L, H, c.num_attention_heads * hd),
            "layers.gate_up_proj": (L, 2 * I, H),
            "layers.down_proj": (L, H, I),
        }
        if not c.tie_word_embeddings:
            shapes["lm_head"] = (V, H)
        if c.attention_bias:
            shapes["layers.qkv_bias"] = (L, qkv)
        return shapes

    def stacked_names(self, config: ModelConfig) -> list[str]:
        return [n for n in self.tensor_shapes(config) if n.startswith("layers.")]

    def global_tensors(self, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
        out = {
            "embed_tokens": ckpt.tensor("model.embed_tokens.weight"),
            "final_norm": ckpt.tensor("model.norm.weight"),
        }
        if not ckpt.config.tie_word_embeddings:
            out["lm_head"] = ckpt.tensor("lm_head.weight")
        return out

    def layer_tensors(self, ckpt: Checkpoint, layer: int) -> dict[str, torch.Tensor]:
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
