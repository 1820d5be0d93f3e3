"""The Llama-family forward pass, computed directly on the sidecar's stacked tensors.

Written gpt-fast style: plain PyTorch, state passed explicitly, no Python control flow on tensor
values, so :meth:`LlamaModel.forward` can be exported and compiled as is. Shapes per call:
``[B, S]`` tokens (``S`` = 1 for decode) and ``[B, nb]`` block tables.

Math follows transformers' ``modeling_llama.py`` (the reference in the tests):

- RMSNorm in float32 (:func:`model_families.norm_rope.rms_norm`);
- RoPE in the HF ``rotate_half`` convention, cos/sin computed in float32 from
  ``inv_freq = 1 / theta^(2i/hd)`` (optionally rescaled, see :func:`rope_inv_freq`) then cast to
  the compute dtype;
- GQA attention (``nh`` query heads share ``nkv`` K/V heads) with scale ``1/sqrt(hd)``;
- SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; gate rows come first in ``gate_up_proj``.

Paged attention: in ``forward`` (prefill) K/V of the step's tokens are written into the block
pools in place at ``slot_mapping``, then each sequence's blocks are read through its block-table
row (:func:`model_families.attention.paged_attention`). ``decode`` only reads the pools: each row's
own K/V stands in for its slot, and the rows are returned for the runner to write after the
step (one copy per pool for all layers, outside the compiled program).

Matrices are float tensors or weight-only quantized ones (int4 / int8 sidecars): every matmul is
:func:`model_families.linear.linear`, which dispatches on the weight's kind (Python-level, so the
traced graph holds the right kernel).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_families.attention import paged_attention
from model_families.custom_ops import tracing
from model_families.family import FamilyModel, FamilyWeights
from model_families.invariant import silu
from model_families.kv_write import write_kv
from model_families.linear import linear, opaque_quantized_kernels
from model_families.llama.config import LlamaConfig
from model_families.llama.pack import tensor_shapes, tensor_specs
from model_families.norm_rope import apply_rope, rms_norm
from model_families.quantized_weights import QuantizedWeight, quantized_weight
from services.errors import InvalidArgument

Weight = torch.Tensor | QuantizedWeight


@dataclass
class LlamaWeights(FamilyWeights):
    """The model's weights, stacked across layers (the sidecar layout of
    :mod:`model_families.llama.pack`, ``layers.`` prefix dropped). L layers, H hidden.

    ``embed_tokens`` [V, H]; ``lm_head`` [V, H] (the same object as ``embed_tokens`` when tied);
    ``final_norm`` [H]; ``input_norm`` / ``post_attn_norm`` [L, H]; ``qkv_proj``
    [L, (nh + 2 nkv) hd, H] (q rows, then k, then v); ``qkv_bias`` [L, (nh + 2 nkv) hd] or None;
    ``o_proj`` [L, H, nh hd]; ``gate_up_proj`` [L, 2 I, H] (gate then up); ``down_proj`` [L, H, I].
    Float tensors in the compute dtype on the compute device; from a quantized sidecar the
    matrices and tables are :class:`~model_families.quantized_weights.QuantizedWeight` s of those shapes.
    """

    embed_tokens: Weight
    lm_head: Weight
    final_norm: torch.Tensor
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    qkv_proj: Weight
    o_proj: Weight
    gate_up_proj: Weight
    down_proj: Weight
    qkv_bias: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], config: LlamaConfig, dtype: torch.dtype,
                     device: torch.device, weights_dtype: str = "f32") -> LlamaWeights:
        """Take the tensors of a ``weights_dtype`` sidecar: float ones zero-copy when dtype and
        device already match (otherwise one converted copy each), quantized matrices converted
        once for the kernels (:func:`model_families.quantized_weights.quantized_weight`). Raises
        ``InvalidArgument`` on a missing name or a wrong shape (or a wrong dtype for a quantized
        part)."""
        specs = tensor_specs(config, weights_dtype)
        for name, spec in specs.items():
            if name not in tensors:
                raise InvalidArgument(f"sidecar lacks tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != spec.shape:
                raise InvalidArgument(f"sidecar tensor {name!r} has shape {tuple(t.shape)}, expected {spec.shape}")
            if not spec.dtype.is_floating_point and t.dtype != spec.dtype:
                raise InvalidArgument(f"sidecar tensor {name!r} has dtype {t.dtype}, expected {spec.dtype}")
        out: dict[str, Weight] = {}
        for name in tensor_shapes(config):
            if name in specs:
                value: Weight = tensors[name].to(device=device, dtype=dtype)
            else:
                prefix = f"{name}."
                parts = {n.removeprefix(prefix): tensors[n] for n in specs if n.startswith(prefix)}
                value = quantized_weight(parts, dtype, device)
            out[name.removeprefix("layers.")] = value
        if "lm_head" not in out:
            out["lm_head"] = out["embed_tokens"]
        return cls(**out)


def rope_inv_freq(c: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [hd / 2], float32: ``1 / theta ** (arange(0, hd, 2) / hd)``, then the
    scaling of ``c.rope_scaling``: ``linear`` divides by ``factor``; ``llama3`` follows
    transformers' ``_compute_llama3_parameters`` (Llama 3.1: low frequencies divided by
    ``factor``, high kept, the band between smoothly interpolated)."""
    hd = c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    kind, sc = c.rope_type, c.rope_scaling or {}
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


def rope_cos_sin(c: LlamaConfig, max_len: int, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, hd], float32, rows indexed by position (HF layout: the
    ``hd/2`` frequencies repeated twice)."""
    inv_freq = rope_inv_freq(c)
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


class LlamaModel(FamilyModel):
    """The Llama forward over :class:`LlamaWeights` (registered as buffers, no copies) and RoPE
    tables ``cos_table`` / ``sin_table`` [max_model_len, hd] float32. Caches: ``(k, v)``, each
    [L, num_blocks, block_size, nkv, hd] in the compute dtype."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        self._has_bias = weights.qkv_bias is not None
        for name, weight in weights.entries().items():
            if isinstance(weight, QuantizedWeight):
                self.add_module(name, weight)  # its tensors are its own non-persistent buffers
            else:
                self.register_buffer(name, weight, persistent=False)
        cos, sin = rope_cos_sin(config, max_model_len, weights.device)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def forward(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                last_index: torch.Tensor) -> torch.Tensor:
        """One model step over a padded batch; writes K/V in place and returns next-token logits.

        Args (B rows, S tokens per row, nb blocks per row; integer tensors int64):
            caches: ``(k_cache, v_cache)``, each [L, num_blocks, block_size, nkv, hd] (mutated).
            input_ids: [B, S] token ids; positions: [B, S] absolute positions.
            slot_mapping: [B, S] KV slot of each token (padding tokens: a scratch-block slot).
            block_tables: [B, nb]; seq_lens: [B] context length after this step.
            last_index: [B] index in ``S`` of the token whose logits are wanted.
        Returns:
            logits [B, V] float32 for the token at ``last_index`` of each row.
        """
        return self._step(caches, input_ids, positions, slot_mapping.reshape(-1), block_tables, seq_lens,
                          last_index)[0]

    def decode(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode token per row (``input_ids``/``positions``/``slot_mapping``/``seq_lens``
        [B], ``block_tables`` [B, nb]) that only reads the caches: returns ``(logits [B, V]
        float32, k_rows, v_rows)``, the rows [L, B, nkv, hd] to write at ``slot_mapping``
        (:func:`model_families.kv_write.write_kv_rows`). Attention sees each row's own K/V in place
        of that slot (:func:`model_families.attention.decode_attention`)."""
        return self._step(caches, input_ids[:, None], positions[:, None], None, block_tables, seq_lens,
                          torch.zeros_like(input_ids))

    def verify(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` returning the logits of every position, [B, S, V] float32 (the
        verify step of speculative decoding). K/V of rejected drafts stay in their slots, past
        the sequence's length: attention never reads them (``seq_lens``, causal positions) and
        the next steps overwrite them."""
        return self._step(caches, input_ids, positions, slot_mapping.reshape(-1), block_tables, seq_lens, None)[0]

    def can_loop_layers(self) -> bool:
        """Every weight is stacked per layer (float or quantized parts): always."""
        return True

    def loop_layers(self, on: bool) -> None:
        """:attr:`scan_layers` 1 (``on``) or 0 for the steps exported from now on."""
        self.scan_layers = 1 if on else 0

    def linear_matrices(self) -> list[torch.Tensor]:
        """Each layer's ``qkv_proj`` / ``o_proj`` / ``gate_up_proj`` / ``down_proj`` view and
        ``lm_head``, where they are float tensors (a quantized sidecar's are not)."""
        layers = [getattr(self, n) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        out = [w[i] for w in layers if isinstance(w, torch.Tensor) for i in range(self.config.num_hidden_layers)]
        return [*out, self.lm_head] if isinstance(self.lm_head, torch.Tensor) else out

    def _step(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              last_index: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The layers: ``slots`` [B*S] writes K/V in place and returns ``(logits,)`` (at
        ``last_index`` [B], or [B, S, V] at every position when it is ``None``); ``None``
        (decode) returns ``(logits, k_rows, v_rows)`` instead of writing. With :attr:`scan_layers`,
        an exported step runs the layers as one loop (:meth:`_scan_layers`) that
        only reads the pools; a prefill writes the rows it returns after the loop."""
        k_cache, v_cache = caches
        c = self.config
        B = input_ids.shape[0]
        dtype = self.final_norm.dtype
        cos = self.cos_table[positions].to(dtype)
        sin = self.sin_table[positions].to(dtype)
        h = F.embedding(input_ids, self.embed_tokens)
        if self.scan_layers and self._exporting(h):
            h, k_rows, v_rows = self._scan_layers(h, k_cache, v_cache, cos, sin, block_tables, positions, seq_lens)
            if slots is not None:  # prefill: the loop returned the rows [L, B, S, nkv, hd]; write them here
                for i in range(c.num_hidden_layers):
                    write_kv(k_cache, i, slots, k_rows[i].flatten(0, 1))
                    write_kv(v_cache, i, slots, v_rows[i].flatten(0, 1))
        else:
            k_list, v_list = [], []
            for i in range(c.num_hidden_layers):
                layer = self._layer_weights(i)
                if slots is None:
                    h, k, v = self._decode_layer(h, *layer, k_cache[i], v_cache[i], cos, sin, block_tables,
                                                 positions, seq_lens)
                    k_list.append(k)
                    v_list.append(v)
                else:
                    def attend(q, k, v, i=i):
                        S = q.shape[1]
                        write_kv(k_cache, i, slots, k.reshape(B * S, *k.shape[2:]))
                        write_kv(v_cache, i, slots, v.reshape(B * S, *v.shape[2:]))
                        return paged_attention(q, k_cache[i], v_cache[i], block_tables, positions, seq_lens)

                    h = self._layer(h, *layer, cos, sin, attend)[0]
            if slots is None:
                k_rows, v_rows = torch.stack(k_list), torch.stack(v_list)
        last = h if last_index is None else h[torch.arange(B, device=h.device), last_index]
        logits = linear(rms_norm(last, self.final_norm, c.rms_norm_eps), self.lm_head).float()
        if slots is None:
            return logits, k_rows, v_rows
        return (logits,)

    #: Layers per iteration when an exported step runs its layers as one
    #: loop (:meth:`_scan_layers`); 0: unrolled (the default). The runner's ``loop`` programs set
    #: it (:meth:`loop_layers`): they compile in a fraction of the time, their step is a few
    #: per cent slower (``docs/benchmarks.md``, "Compile time of the decode program").
    scan_layers: int = 0

    @staticmethod
    def _exporting(h: torch.Tensor) -> bool:
        """Whether ``h`` flows through ``torch.export`` (the AOTI programs), not Dynamo
        (``--compile inductor`` traces the unrolled layers) nor eager execution."""
        return tracing(h) and not torch.compiler.is_dynamo_compiling()

    def _layer_weights(self, i: int) -> tuple:
        """Layer ``i``'s ``(input_norm, qkv_proj, qkv_bias or None, o_proj, post_attn_norm,
        gate_up_proj, down_proj)``."""
        return (self.input_norm[i], self.qkv_proj[i], self.qkv_bias[i] if self._has_bias else None, self.o_proj[i],
                self.post_attn_norm[i], self.gate_up_proj[i], self.down_proj[i])

    def _layer(self, h: torch.Tensor, input_norm: torch.Tensor, qkv_proj: Weight, qkv_bias: torch.Tensor | None,
               o_proj: Weight, post_attn_norm: torch.Tensor, gate_up_proj: Weight, down_proj: Weight,
               cos: torch.Tensor, sin: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer on ``h`` [B, S, H] (cos/sin [B, S, hd]); ``attend(q [B, S, nh, hd], k, v
        [B, S, nkv, hd])`` -> [B, S, nh, hd] is the attention. Returns ``(h, k, v)``."""
        c = self.config
        B, S = h.shape[0], h.shape[1]
        nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        x = rms_norm(h, input_norm, eps)
        qkv = linear(x, qkv_proj, qkv_bias)
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
        q = apply_rope(q.view(B, S, nh, hd), cos, sin)
        k = apply_rope(k.view(B, S, nkv, hd), cos, sin)
        v = v.view(B, S, nkv, hd)
        attn = attend(q, k, v)
        h = h + linear(attn.reshape(B, S, nh * hd), o_proj)
        x = rms_norm(h, post_attn_norm, eps)
        gate, up = linear(x, gate_up_proj).chunk(2, dim=-1)
        return h + linear(silu(gate) * up, down_proj), k, v

    def _decode_layer(self, h: torch.Tensor, input_norm: torch.Tensor, qkv_proj: Weight,
                      qkv_bias: torch.Tensor | None, o_proj: Weight, post_attn_norm: torch.Tensor,
                      gate_up_proj: Weight, down_proj: Weight, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                      seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer that only reads its pools [num_blocks, block_size, nkv, hd] (``h`` [B, S, H]):
        returns ``(h, k_rows, v_rows)``, the rows this step's tokens have, [B, nkv, hd] when ``S``
        is 1 (decode), else [B, S, nkv, hd] (attention sees them in place of their slots,
        :func:`~model_families.attention.paged_attention`)."""
        def attend(q, k, v):
            return paged_attention(q, k_pool, v_pool, block_tables, positions, seq_lens, k, v)

        h, k, v = self._layer(h, input_norm, qkv_proj, qkv_bias, o_proj, post_attn_norm, gate_up_proj, down_proj,
                              cos, sin, attend)
        if h.shape[1] != 1:
            return h, k, v
        return h, k.reshape(k.shape[0], *k.shape[2:]), v.reshape(v.shape[0], *v.shape[2:])

    def _scan_layers(self, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                            seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layers (:meth:`_decode_layer`, the pools read only) as one ``scan`` over the stacked
        weights and pools, :attr:`scan_layers` layers per iteration (the ``L % G`` last ones
        unrolled after it): the traced program holds the body once (Inductor lowers it to a
        ``while_loop``), so its C++ and compile time grow with ``G``, not with the layer count.
        Returns ``(h [B, S, H], k_rows, v_rows)``, the rows [L, B, nkv, hd] (decode, ``S`` = 1) or
        [L, B, S, nkv, hd] (prefill).

        ``scan_op`` is called directly, not ``torch.scan``: that wrapper traces the body with
        Dynamo, which cannot close over the export's symbolic batch size; and Inductor's
        scan -> while_loop lowering allocates the stacked rows from the SymInts among the operands,
        so the dynamic batch size and token count are passed as such (the body reads its sizes
        from ``h``)."""
        from torch._higher_order_ops.scan import scan_op

        L, G = self.config.num_hidden_layers, max(1, int(self.scan_layers))
        n = L // G * G
        bias = (self.qkv_bias,) if self._has_bias else ()

        # each weight as its stacked tensors: a float matrix is one, a quantized one its parts
        # (rebuilt per layer as the NamedTuple its ``w[i]`` gives, which ``linear`` runs)
        weights = [self.input_norm, self.qkv_proj, *bias, self.o_proj, self.post_attn_norm, self.gate_up_proj,
                   self.down_proj]
        parts = [list(w.tensors().values()) if isinstance(w, QuantizedWeight) else [w] for w in weights]
        kinds = [w.layer_matrix if isinstance(w, QuantizedWeight) else None for w in weights]

        def group(h, *stacked_and_rest):
            stacked, (cos, sin, tables, pos, lens) = stacked_and_rest[:n_stacked], stacked_and_rest[n_stacked:][:5]
            ks, vs = [], []
            for j in range(G):
                flat, w, at = [x[j] for x in stacked], [], 0
                for kind, ts in zip(kinds, parts, strict=True):
                    w.append(flat[at] if kind is None else kind(*flat[at:at + len(ts)]))
                    at += len(ts)
                w += flat[at:]  # the two pools
                qkv_bias, w = (w[2], w[:2] + w[3:]) if bias else (None, w)
                input_norm, qkv_proj, o_proj, post_attn_norm, gate_up_proj, down_proj, k_pool, v_pool = w
                h, k, v = self._decode_layer(h, input_norm, qkv_proj, qkv_bias, o_proj, post_attn_norm,
                                             gate_up_proj, down_proj, k_pool, v_pool, cos, sin, tables, pos, lens)
                ks.append(k)
                vs.append(v)
            return [h, torch.stack(ks), torch.stack(vs)]  # stacked: the outputs may not alias (v views qkv)

        stacked = [t for ts in parts for t in ts] + [k_cache, v_cache]
        xs = [x[:n].unflatten(0, (n // G, G)) for x in stacked]
        n_stacked = len(xs)
        sizes = tuple(d for d in h.shape[:2] if isinstance(d, torch.SymInt))  # the dynamic batch / token dims
        with opaque_quantized_kernels():  # the body is traced here
            h, k_rows, v_rows = scan_op(group, [h], xs, (cos, sin, block_tables, positions, seq_lens, *sizes))
        k_rows, v_rows = k_rows.flatten(0, 1), v_rows.flatten(0, 1)
        if n == L:
            return h, k_rows, v_rows
        k_list, v_list = [k_rows], [v_rows]
        for i in range(n, L):
            h, k, v = self._decode_layer(h, *self._layer_weights(i), k_cache[i], v_cache[i], cos, sin, block_tables,
                                         positions, seq_lens)
            k_list.append(k[None])
            v_list.append(v[None])
        return h, torch.cat(k_list), torch.cat(v_list)
