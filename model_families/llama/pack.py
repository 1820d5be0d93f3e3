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
(:data:`PROJECTIONS`) are stored in the sidecar's format, the token embedding and the head
(:data:`TABLES`) in int8, both as parts named after the float tensor (formats in
:mod:`model_families.quant`); norms and biases stay float32. For ``int4``, with ``N``/``K`` the
float matrix's rows/columns:

==================================  ============  =====================  =========================
name                                dtype         shape                  meaning
==================================  ============  =====================  =========================
``layers.qkv_proj.qweight``         uint8         ``[L, N, K/2]``        two 4-bit codes a byte
``layers.qkv_proj.scales``          float32       ``[L, N, K/32]``       one per 32 columns
``layers.qkv_proj.zeros``           float32       ``[L, N, K/32]``       ``w = (q-8)*scale+zero``
(same three for ``o_proj``, ``gate_up_proj``, ``down_proj``)
``embed_tokens.qweight``            int8          ``[V, H]``             per-row int8 (also the
``embed_tokens.scales``             float32       ``[V]``                tied head)
``lm_head.qweight`` / ``.scales``   int8 / f32    ``[V, H]`` / ``[V]``   untied only
``final_norm``, ``layers.*_norm``,  float32       as in the float layout
``layers.qkv_bias``
==================================  ============  =====================  =========================

``int8`` stores the projections as ``NAME.qweight`` int8 ``[L, N, K]`` + ``NAME.scales`` float32
``[L, N]``, the rest as for int4. Fused projections are quantized matrix by matrix and their
parts concatenated along the rows (rows are independent in both formats). int4 needs every
projection's ``K`` to be a multiple of 32 and ``N`` of 16 (``InvalidArgument`` otherwise).

Why the head is int8, not int4 and not float: it is tied to the embedding, it is the largest
single matrix (V x H: a fifth of SmolLM2's weights) and it is read at every step, so a float
head would cost more memory traffic than all int4 layers together; int8 per row keeps its error
well below int4's and PyTorch has a weight-only int8 matmul for it. The GGUF embedding is Q8_0
(one scale per 32 values), so it is requantized to one scale per row.
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
#: Matrices stored in the sidecar's quantized format, and tables stored int8, in quantized layouts.
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
            specs.update(quantized_specs(name, shape, "int8"))
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
    """``embed_tokens``, ``final_norm`` and (untied) ``lm_head`` from the checkpoint; in a
    quantized layout the tables as int8 parts."""
    tables = {"embed_tokens": "model.embed_tokens.weight"}
    if not ckpt.config.tie_word_embeddings:
        tables["lm_head"] = "lm_head.weight"
    out = {"final_norm": ckpt.tensor("model.norm.weight")}
    for name, hf in tables.items():
        if weights_dtype in FLOAT_WEIGHTS:
            out[name] = ckpt.tensor(hf)
        else:
            out.update(_parts(name, quant.checkpoint_parts(ckpt, hf, "int8")))
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
