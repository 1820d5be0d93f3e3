"""The Llama-family sidecar layout (SmolLM2, Llama 2/3, Mistral, Qwen2-style GQA with q/k/v bias;
tied or untied embeddings): the one statement of it (:func:`tensor_specs`) and the rule that
fills it from a checkpoint under HF names.

Float layout (``f32`` / ``bf16`` sidecars, every tensor in that dtype; L layers, H hidden,
nh/nkv heads, hd head_dim, I intermediate, V vocab); every matrix is ``[out, in]`` as
``torch.nn.functional.linear`` expects, rows in HF order:

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

Quantized layouts (``int4`` / ``int8`` sidecars): the four projection matrices
(:data:`PROJECTIONS`) are stored in the sidecar's format as parts named after the float tensor
(formats in :mod:`model_families.quant`); the token embedding and the head (:data:`TABLES`) in
bfloat16; norms and biases in float32. For ``int4``, with ``N``/``K`` the float matrix's
rows/columns:

==================================  ============  =====================  =========================
name                                dtype         shape                  meaning
==================================  ============  =====================  =========================
``layers.qkv_proj.qweight``         uint8         ``[L, N, K/2]``        two 4-bit codes a byte
``layers.qkv_proj.scales``          float32       ``[L, N, K/32]``       one per 32 columns
``layers.qkv_proj.zeros``           float32       ``[L, N, K/32]``       ``w = (q-8)*scale+zero``
(same three for ``o_proj``, ``gate_up_proj``, ``down_proj``)
``embed_tokens``                    bfloat16      ``[V, H]``             also the tied head
``lm_head``                         bfloat16      ``[V, H]``             untied only
``final_norm``, ``layers.*_norm``,  float32       as in the float layout
``layers.qkv_bias``
==================================  ============  =====================  =========================

``int8`` stores the projections as ``NAME.qweight`` int8 ``[L, N, K]`` + ``NAME.scales`` float32
``[L, N]``, the rest as for int4. Fused projections are quantized matrix by matrix and their
parts concatenated along the rows (rows are independent in both formats). int4 needs every
projection's ``K`` to be a multiple of 32 and ``N`` of 16 (``InvalidArgument`` otherwise).

Why the tables are bfloat16 and not int8: the embedding doubles as the tied head. PyTorch's int8
weight-only matmul takes one scale per row, so the GGUF's Q8_0 table (one scale per 32 values)
would be requantized; measured on the bundled SmolLM2 (float32 compute, int4 layers exact), an
int8 table moves the last-position logits by up to 0.79 and one of five greedy chats leaves the
dequantized model's text at token 18, while a bfloat16 table (relative rounding <= 2^-9) stays
within 0.08 with all five chats equal. bfloat16 is also what most float checkpoints store and
what bf16 compute reads zero-copy. The price: 57 MB instead of 28 MB for SmolLM2's 49152 x 576
table, and a head matmul of ~3.9 ms instead of ~1.7 ms per batch-1 step (bf16, this host).
"""

from __future__ import annotations

import torch

from model_families import quant
from model_families.family import FLOAT_WEIGHTS, Checkpoint, TensorSpec, float_specs, quantized_specs
from model_families.llama.config import LlamaConfig
from services.errors import InvalidArgument

#: Changes whenever the layout above changes (enters the sidecar fingerprint).
PACK_VERSION = "1"
#: The weights dtypes this layout has a form for.
WEIGHTS_DTYPES = ("f32", "bf16", "int8", "int4")
#: Matrices stored in the sidecar's quantized format, and tables stored bfloat16, in quantized layouts.
PROJECTIONS = ("layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj")
TABLES = ("embed_tokens", "lm_head")
#: The HF matrices fused into each projection, in row order (``{p}`` is the layer prefix).
_FUSED = {
    "layers.qkv_proj": ("{p}self_attn.q_proj.weight", "{p}self_attn.k_proj.weight", "{p}self_attn.v_proj.weight"),
    "layers.o_proj": ("{p}self_attn.o_proj.weight",),
    "layers.gate_up_proj": ("{p}mlp.gate_proj.weight", "{p}mlp.up_proj.weight"),
    "layers.down_proj": ("{p}mlp.down_proj.weight",),
}


def tensor_specs(c: LlamaConfig, weights_dtype: str) -> dict[str, TensorSpec]:
    """Sidecar tensor name -> shape and dtype for ``c`` in a ``weights_dtype`` sidecar (the
    tables in the module docstring). Raises ``InvalidArgument`` for an unknown dtype or a shape
    int4 cannot hold."""
    shapes = tensor_shapes(c)
    if weights_dtype in FLOAT_WEIGHTS:
        return float_specs(shapes, weights_dtype)
    if weights_dtype not in WEIGHTS_DTYPES:
        raise InvalidArgument(f"the llama layout has no {weights_dtype!r} form (it has {', '.join(WEIGHTS_DTYPES)})")
    specs: dict[str, TensorSpec] = {}
    for name, shape in shapes.items():
        if name in PROJECTIONS:
            specs.update(quantized_specs(name, shape, weights_dtype))
        elif name in TABLES:
            specs[name] = TensorSpec(shape, torch.bfloat16)
        else:
            specs[name] = TensorSpec(shape, torch.float32)
    return specs


def tensor_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The float layout: sidecar tensor name -> full shape for ``c`` (``lm_head`` only when
    untied, ``qkv_bias`` only with ``attention_bias``)."""
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


def _parts(name: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{name}.{part}": t for part, t in parts.items()}


def global_tensors(ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
    """``embed_tokens``, ``final_norm`` and (untied) ``lm_head`` from the checkpoint (the packer
    casts them to the layout's float dtypes)."""
    out = {
        "embed_tokens": ckpt.tensor("model.embed_tokens.weight"),
        "final_norm": ckpt.tensor("model.norm.weight"),
    }
    if not ckpt.config.tie_word_embeddings:
        out["lm_head"] = ckpt.tensor("lm_head.weight")
    return out


def layer_tensors(ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
    """Layer ``layer``'s slice of each stacked tensor, fused as the table says (quantized
    projections: each HF matrix quantized, then the parts concatenated). Raises
    ``InvalidArgument`` for a tensor the layout has no place for (an ``o_proj`` or MLP bias)."""
    p = f"model.layers.{layer}."
    for unsupported in ("self_attn.o_proj.bias", "mlp.gate_proj.bias"):
        if ckpt.has(p + unsupported):
            raise InvalidArgument(f"the llama pack spec has no place for {p + unsupported}")
    out = {
        "layers.input_norm": ckpt.tensor(p + "input_layernorm.weight"),
        "layers.post_attn_norm": ckpt.tensor(p + "post_attention_layernorm.weight"),
    }
    for name, sources in _FUSED.items():
        hf_names = [s.format(p=p) for s in sources]
        if weights_dtype in FLOAT_WEIGHTS:
            tensors = [ckpt.tensor(n) for n in hf_names]
            out[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        else:
            out.update(_parts(name, quant.concat_parts([quant.checkpoint_parts(ckpt, n, weights_dtype)
                                                        for n in hf_names])))
    if ckpt.config.attention_bias:
        out["layers.qkv_bias"] = torch.cat([ckpt.tensor(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
    return out
