"""The Llama-family forward pass, computed directly on the sidecar's stacked tensors.

Written gpt-fast style: plain PyTorch, state passed explicitly, no Python control flow on tensor
values, so :func:`forward` can be handed to ``torch.compile`` / AOTInductor as is. Static shapes
per call: ``[B, S]`` tokens (``S`` = 1 for decode) and ``[B, nb]`` block tables.

Math follows transformers' ``modeling_llama.py`` (the reference in the tests):

- RMSNorm in float32: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``;
- RoPE in the HF ``rotate_half`` convention (first half / second half of each head), cos/sin
  computed in float32 from ``inv_freq = 1 / theta^(2i/hd)`` (optionally rescaled, see
  :func:`rope_inv_freq`) then cast to the compute dtype;
- GQA attention (``nh`` query heads share ``nkv`` K/V heads) with scale ``1/sqrt(hd)``;
- SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; gate rows come first in ``gate_up_proj``.

Paged attention: K/V of the step's tokens are written into the block pool in place
(:func:`write_kv`) at ``slot_mapping`` (slot = block_id * block_size + offset), then each sequence's blocks are
gathered through its block-table row and attended with a causal/length mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from runner_service import kv_write as _kv_write  # noqa: F401  (registers torch.ops.warmserve.kv_write_)
from runner_service.config import ModelArgs
from services.errors import InvalidArgument


@dataclass
class LlamaWeights:
    """The model's tensors, stacked across layers (the sidecar layout). L layers, H hidden.

    ``embed_tokens`` [V, H]; ``lm_head`` [V, H] (the same tensor as ``embed_tokens`` when tied);
    ``final_norm`` [H]; ``input_norm`` / ``post_attn_norm`` [L, H]; ``qkv_proj``
    [L, (nh + 2 nkv) hd, H] (q rows, then k, then v); ``qkv_bias`` [L, (nh + 2 nkv) hd] or None;
    ``o_proj`` [L, H, nh hd]; ``gate_up_proj`` [L, 2 I, H] (gate then up); ``down_proj`` [L, H, I].
    All in the compute dtype, on the compute device.
    """

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    qkv_proj: torch.Tensor
    o_proj: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    qkv_bias: torch.Tensor | None = None

    @staticmethod
    def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
        """Sidecar tensor name -> shape for ``args`` (``lm_head`` only when untied, ``qkv_bias``
        only with ``attention_bias``)."""
        L, H, V, inter = args.num_layers, args.hidden_size, args.vocab_size, args.intermediate_size
        shapes = {
            "embed_tokens": (V, H),
            "final_norm": (H,),
            "layers.input_norm": (L, H),
            "layers.post_attn_norm": (L, H),
            "layers.qkv_proj": (L, args.qkv_size, H),
            "layers.o_proj": (L, H, args.num_heads * args.head_dim),
            "layers.gate_up_proj": (L, 2 * inter, H),
            "layers.down_proj": (L, H, inter),
        }
        if not args.tie_word_embeddings:
            shapes["lm_head"] = (V, H)
        if args.attention_bias:
            shapes["layers.qkv_bias"] = (L, args.qkv_size)
        return shapes

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], args: ModelArgs, dtype: torch.dtype,
                     device: torch.device) -> LlamaWeights:
        """Take the sidecar's tensors (zero-copy when dtype and device already match; otherwise
        one converted copy each). Raises ``InvalidArgument`` on a missing name or wrong shape."""
        out = {}
        for name, shape in cls.expected_shapes(args).items():
            if name not in tensors:
                raise InvalidArgument(f"sidecar lacks tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise InvalidArgument(f"sidecar tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            out[name.removeprefix("layers.")] = t.to(device=device, dtype=dtype)
        if "lm_head" not in out:
            out["lm_head"] = out["embed_tokens"]
        return cls(**out)

    @classmethod
    def random(cls, args: ModelArgs, dtype: torch.dtype = torch.float32, seed: int = 0,
               device: torch.device | str = "cpu") -> LlamaWeights:
        """Random weights (normal, std 0.02; norms near 1) for unit tests of the serving path."""
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape in cls.expected_shapes(args).items():
            if name.endswith("norm"):
                tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                tensors[name] = 0.02 * torch.randn(shape, generator=g)
        return cls.from_tensors(tensors, args, dtype, torch.device(device))

    def nbytes(self) -> int:
        """Bytes of distinct weight storage (a tied head counts once)."""
        seen, total = set(), 0
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [hd / 2], float32: ``1 / theta ** (arange(0, hd, 2) / hd)``, then the
    scaling of ``args.rope_scaling``: ``linear`` divides by ``factor``; ``llama3`` follows
    transformers' ``_compute_llama3_parameters`` (Llama 3.1: low frequencies divided by
    ``factor``, high kept, the band between smoothly interpolated)."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    kind, sc = args.rope_type, args.rope_scaling or {}
    if kind == "linear":
        return inv_freq / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(args: ModelArgs, max_len: int, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, hd], float32, rows indexed by position (HF layout: the
    ``hd/2`` frequencies repeated twice)."""
    inv_freq = rope_inv_freq(args)
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32 (as transformers' ``LlamaRMSNorm``)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, n, hd] by per-token ``cos``/``sin`` [B, S, hd] (rotate_half form)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
    """Attention of queries over each sequence's paged K/V.

    ``q`` [B, S, nh, hd]; ``k_pool``/``v_pool`` [num_blocks, block_size, nkv, hd] (one layer);
    ``block_tables`` [B, nb] int64 block ids (unused entries point at the scratch block);
    ``positions`` [B, S] int64 absolute position of each query token; ``seq_lens`` [B] int64
    tokens in the context including this step's. Key ``j`` (position in the gathered row) is
    visible to a query at position ``p`` iff ``j <= p`` and ``j < seq_len``. Returns
    [B, S, nh, hd].
    """
    B, nb = block_tables.shape
    bs, nkv, hd = k_pool.shape[1:]
    k = k_pool[block_tables].reshape(B, nb * bs, nkv, hd).transpose(1, 2)
    v = v_pool[block_tables].reshape(B, nb * bs, nkv, hd).transpose(1, 2)
    key_pos = torch.arange(nb * bs, device=q.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)
    return out.transpose(1, 2)


def write_kv(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[layer]`` slots ``slots`` [T] (int64) <- ``values`` [T, nkv, hd], in place.

    Eager: a plain ``index_copy_`` (~3 us). Under ``torch.compile`` / ``torch.export``: the
    ``warmserve::kv_write_`` custom op (:mod:`runner_service.kv_write`), which compilers keep as
    one in-place call instead of copying the whole pool (the op costs ~20 us per call eagerly,
    so it is used only when compiling).
    """
    if torch.compiler.is_compiling():
        torch.ops.warmserve.kv_write_(cache, layer, slots, values)
    else:
        nkv, hd = cache.shape[-2:]
        cache[layer].view(-1, nkv, hd).index_copy_(0, slots, values)


def forward(w: LlamaWeights, args: ModelArgs, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cos_table: torch.Tensor, sin_table: torch.Tensor, input_ids: torch.Tensor,
            positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """One model step over a padded batch; writes K/V in place and returns next-token logits.

    Args (B rows, S tokens per row, nb blocks per row; integer tensors int64):
        k_cache, v_cache: [L, num_blocks, block_size, nkv, hd] in the compute dtype (mutated).
        cos_table, sin_table: [max_len, hd] float32 (from :func:`rope_cos_sin`).
        input_ids: [B, S] token ids; positions: [B, S] absolute positions.
        slot_mapping: [B, S] KV slot of each token (padding tokens: a scratch-block slot).
        block_tables: [B, nb]; seq_lens: [B] context length after this step.
        last_index: [B] index in ``S`` of the token whose logits are wanted.
    Returns:
        logits [B, V] float32 for the token at ``last_index`` of each row.
    """
    B, S = input_ids.shape
    nh, nkv, hd, eps = args.num_heads, args.num_kv_heads, args.head_dim, args.rms_norm_eps
    dtype = w.embed_tokens.dtype
    slots = slot_mapping.reshape(-1)
    cos = cos_table[positions].to(dtype)
    sin = sin_table[positions].to(dtype)
    h = F.embedding(input_ids, w.embed_tokens)
    for i in range(args.num_layers):
        x = rms_norm(h, w.input_norm[i], eps)
        qkv = F.linear(x, w.qkv_proj[i], None if w.qkv_bias is None else w.qkv_bias[i])
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
        q = apply_rope(q.view(B, S, nh, hd), cos, sin)
        k = apply_rope(k.view(B, S, nkv, hd), cos, sin)
        write_kv(k_cache, i, slots, k.reshape(B * S, nkv, hd))
        write_kv(v_cache, i, slots, v.reshape(B * S, nkv, hd))
        attn = paged_attention(q, k_cache[i], v_cache[i], block_tables, positions, seq_lens)
        h = h + F.linear(attn.reshape(B, S, nh * hd), w.o_proj[i])
        x = rms_norm(h, w.post_attn_norm[i], eps)
        gate, up = F.linear(x, w.gate_up_proj[i]).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, w.down_proj[i])
    last = h[torch.arange(B, device=h.device), last_index]
    return F.linear(rms_norm(last, w.final_norm, eps), w.lm_head).float()
