"""The DeepSeek V4 forward pass on paged caches, computed on the sidecar's stacked tensors
(:mod:`model_families.deepseek_v4.pack`).

Math follows transformers' ``models/deepseek_v4/modeling_deepseek_v4.py`` (the reference in the
tests; "M:" below names its classes): sliding-window attention with per-head sinks over one
shared K=V head, low-rank queries with a weightless per-head RMSNorm, interleaved RoPE on the
trailing ``qk_rope_head_dim`` channels (undone on the output), a grouped output projection; CSA
layers add compressed entries picked by the lightning indexer, HCA layers all compressed entries;
MoE with a shared expert in every layer (hash-routed or top-k); ``hc_mult`` residual streams
mixed by hyper-connections.

Caches (:meth:`DeepseekV4Family.cache_specs`; every pool ``[layers of its kind, num_blocks,
block_size, width]``, one row per slot; the block table is laid out by
:class:`model_families.block_layout.RingLayout`):

=============  ===========  ===============================  ======================================
pool           layers       row width                        row ``s``
=============  ===========  ===============================  ======================================
``win``        all L        hd                               K=V of the token at ring slot ``s``
                                                             (after ``kv_norm`` and RoPE)
``csa_raw``    CSA layers   4·hd + 4·id                      that token's raw compressor inputs:
                                                             ``wkv·x`` (2hd), ``wgate·x`` (2hd),
                                                             indexer ``wkv·x`` (2id), ``wgate·x`` (2id)
``hca_raw``    HCA layers   2·hd                             ``wkv·x`` (hd), ``wgate·x`` (hd)
``csa_kv``     CSA layers   hd                               compressed entry ``e`` (entry slot)
``csa_ik``     CSA layers   id                               indexer key of entry ``e``
``hca_kv``     HCA layers   hd                               compressed entry ``e``
=============  ===========  ===============================  ======================================

Ring pools hold the last ``ring_tokens`` tokens (at least the window and one compressor span:
``max(W, 2m, m')``), so the rolling compressor state (the open window's raw rows and, for CSA,
the previous window's half it overlaps) is simply the ring's raw rows: a window's entry is made
at the step that closes it, from the ring rows of that window (and the one before), exactly as
M: ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` make it. Compressed entry ``e``
of a pool lives at slot ``block_table[e // bs] * bs + e % bs``.

One step (:meth:`DeepseekV4Model.forward`; decode is the same code with one token per row) for
each row takes its chunk ``[start, start + n)`` and the ``ctx`` tokens before it from the ring:
window attention sees keys ``p - W + 1 .. p``; compressed entries that close inside the chunk
are computed and written before attention reads the pools; the chunk's rows are written to the
ring after. A chunk boundary anywhere gives the same caches as one whole prefill, since every
quantity is a function of (token, position) rows the ring still holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from model_families.block_layout import RingLayout
from model_families.custom_ops import grouped_experts, tracing
from model_families.deepseek_v4.config import CSA, HASH_MOE, HCA, DeepseekV4Config
from model_families.deepseek_v4.pack import FLOAT32_SUFFIXES, tensor_specs
from model_families.family import CacheSpec, FamilyModel, FamilyWeights
from model_families.kv_write import write_kv
from model_families.linear import float_linear
from services.errors import InvalidArgument


def field_name(sidecar_name: str) -> str:
    """The :class:`DeepseekV4Weights` field of a sidecar tensor: ``layers.`` and ``hash.``
    dropped, other dots to underscores (``csa.wkv_gate`` -> ``csa_wkv_gate``)."""
    return sidecar_name.removeprefix("layers.").removeprefix("hash.").replace(".", "_")


@dataclass
class DeepseekV4Weights(FamilyWeights):
    """The model's weights in the sidecar layout of :mod:`model_families.deepseek_v4.pack`
    (field = :func:`field_name` of the sidecar name; shapes in that module's table). Float
    tensors in the compute dtype except the :data:`FLOAT32_SUFFIXES` ones (float32);
    ``tid2eid`` int64. Group fields are ``None`` when the model has no layer of that kind."""

    embed: torch.Tensor
    head: torch.Tensor
    final_norm: torch.Tensor
    hc_head_fn: torch.Tensor
    hc_head_base: torch.Tensor
    hc_head_scale: torch.Tensor
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn_fn: torch.Tensor
    hc_attn_base: torch.Tensor
    hc_attn_scale: torch.Tensor
    hc_ffn_fn: torch.Tensor
    hc_ffn_base: torch.Tensor
    hc_ffn_scale: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: torch.Tensor
    attn_sink: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor
    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor
    tid2eid: torch.Tensor | None = None
    csa_wkv_gate: torch.Tensor | None = None
    csa_ape: torch.Tensor | None = None
    csa_norm: torch.Tensor | None = None
    csa_idx_wkv_gate: torch.Tensor | None = None
    csa_idx_ape: torch.Tensor | None = None
    csa_idx_norm: torch.Tensor | None = None
    csa_idx_wq_b: torch.Tensor | None = None
    csa_idx_weights: torch.Tensor | None = None
    hca_wkv_gate: torch.Tensor | None = None
    hca_ape: torch.Tensor | None = None
    hca_norm: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], config: DeepseekV4Config, dtype: torch.dtype,
                     device: torch.device, weights_dtype: str = "f32") -> DeepseekV4Weights:
        """Take the tensors of a sidecar (names and shapes of
        :func:`~model_families.deepseek_v4.pack.tensor_specs`; other names, e.g. ``mtp.*``, are
        ignored): float ones zero-copy when dtype and device already match. Raises
        ``InvalidArgument`` on a missing name or a wrong shape."""
        out = {}
        for name, spec in tensor_specs(config, weights_dtype).items():
            if name not in tensors:
                raise InvalidArgument(f"sidecar lacks tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != spec.shape:
                raise InvalidArgument(f"sidecar tensor {name!r} has shape {tuple(t.shape)}, expected {spec.shape}")
            out[field_name(name)] = t
        return cls(**out).to(dtype, torch.device(device))

    def to(self, dtype: torch.dtype, device: torch.device) -> DeepseekV4Weights:
        """A copy in compute dtype ``dtype`` on ``device`` (:data:`FLOAT32_SUFFIXES` tensors
        float32, ``tid2eid`` int64); tensors already right are kept, not copied."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                continue
            want = (torch.int64 if not t.is_floating_point() else
                    torch.float32 if f.name.endswith(FLOAT32_SUFFIXES) else dtype)
            out[f.name] = t.to(device=device, dtype=want)
        return type(self)(**out)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the token embedding)."""
        return self.embed.dtype


def ring_span(c: DeepseekV4Config) -> int:
    """Tokens a step must still find in the ring: the window ``W``, and one compressor span
    (``2m`` for CSA, whose entries overlap the previous window; ``m'`` for HCA)."""
    spans = [c.sliding_window]
    if c.layers_of(CSA):
        spans.append(2 * c.csa_compress_rate)
    if c.layers_of(HCA):
        spans.append(c.hca_compress_rate)
    return max(spans)


def ring_tokens(c: DeepseekV4Config, block_size: int) -> int:
    """The ring's length in token slots: :func:`ring_span` rounded up to whole blocks."""
    return -(-ring_span(c) // block_size) * block_size


def cache_specs(c: DeepseekV4Config, block_size: int) -> tuple[CacheSpec, ...]:
    """The pools of the module docstring, in order, those of absent layer kinds left out."""
    hd, idim = c.head_dim, c.index_head_dim
    n_csa, n_hca = len(c.layers_of(CSA)), len(c.layers_of(HCA))
    specs = [CacheSpec("win", c.num_hidden_layers, (block_size, hd))]
    if n_csa:
        specs += [CacheSpec("csa_raw", n_csa, (block_size, 4 * hd + 4 * idim)),
                  CacheSpec("csa_kv", n_csa, (block_size, hd)), CacheSpec("csa_ik", n_csa, (block_size, idim))]
    if n_hca:
        specs += [CacheSpec("hca_raw", n_hca, (block_size, 2 * hd)), CacheSpec("hca_kv", n_hca, (block_size, hd))]
    return tuple(specs)


def block_layout(c: DeepseekV4Config, block_size: int, max_model_len: int) -> RingLayout:
    """The block-table layout: a ring of :func:`ring_tokens` slots, and the compressed pools'
    entries (one per CSA / HCA rate tokens) through the same table."""
    rates = [c.csa_compress_rate] if c.layers_of(CSA) else []
    rates += [c.hca_compress_rate] if c.layers_of(HCA) else []
    return RingLayout(block_size, ring_tokens(c, block_size) // block_size, rates, max_model_len)


def rope_inv_freq(c: DeepseekV4Config, label: str) -> torch.Tensor:
    """Inverse frequencies [rd / 2] float32 of rope ``label`` (``main`` / ``compress``):
    ``1 / theta^(2i / rd)``, or YaRN's blend of interpolated and extrapolated frequencies
    (transformers' ``_compute_yarn_parameters``: ramp between the correction dims of
    ``beta_fast`` / ``beta_slow`` rotations at ``original_max_position_embeddings``)."""
    rope = c.rope_parameters[label]
    base, dim = float(rope["rope_theta"]), c.qk_rope_head_dim
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    if rope["rope_type"] != "yarn":
        return 1.0 / pos_freqs
    factor = rope["factor"]
    original = rope.get("original_max_position_embeddings") or c.max_position_embeddings
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(c: DeepseekV4Config, label: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, rd / 2] float32 of rope ``label`` (one entry per interleaved pair,
    times the label's attention factor), rows indexed by position."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(c, label)[None, :]
    scale = c.rope_attention_factor(label)
    return freqs.cos() * scale, freqs.sin() * scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (M: ``DeepseekV4RMSNorm``: the float32 weight
    multiplies before the cast back); ``weight`` None: weightless (M:
    ``DeepseekV4UnweightedRMSNorm``)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x`` [..., D]
    (M: ``apply_rotary_pos_emb``); ``cos``/``sin`` [..., rd / 2] broadcast against ``x``'s
    leading dims (float32 math, cast back)."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


def hyper_connection(c: DeepseekV4Config, h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M: ``DeepseekV4HyperConnection.forward``: streams ``h`` [T, n, H] -> ``post`` [T, n],
    ``comb`` [T, n, n] (Sinkhorn-normalised, float32) and the collapsed block input [T, H]."""
    n = c.hc_mult
    flat = rms_norm(h.flatten(1).float(), None, c.rms_norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + c.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + c.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + c.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
    return post, comb, collapsed


def _mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``post ⊗ out + combᵀ @ h`` (M: ``DeepseekV4DecoderLayer.forward``), streams [T, n, H]."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def _ring_slots(block_tables: torch.Tensor, p: torch.Tensor, bs: int, ring_blocks: int) -> torch.Tensor:
    """Ring slots [B, K] of positions ``p`` [B, K] (>= 0):
    ``table[(p // bs) % ring_blocks] * bs + p % bs`` (:class:`~model_families.block_layout.RingLayout`)."""
    blocks = torch.gather(block_tables, 1, torch.div(p, bs, rounding_mode="floor") % ring_blocks)
    return blocks * bs + p % bs


def _entry_write_slots(block_tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, rate: int,
                       bs: int) -> torch.Tensor:
    """[B*S] pool slot of the compressed entry each chunk token closes (entry ``e = (p + 1) /
    rate - 1`` at ``table[e // bs] * bs + e % bs``), 0 (the scratch block) where it closes none."""
    closing = valid & ((pos + 1) % rate == 0)
    e = torch.where(closing, torch.div(pos + 1, rate, rounding_mode="floor") - 1, 0)
    blocks = torch.gather(block_tables, 1, torch.div(e, bs, rounding_mode="floor"))
    return torch.where(closing, blocks * bs + e % bs, 0).reshape(-1)


def _swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU (M: ``DeepseekV4Experts._apply_gate``): gate rows first, gate clamped
    above at ``limit``, up to ``[-limit, limit]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class _Step:
    """The geometry of one step, computed once and shared by the layers: positions ``pos`` /
    ``valid`` [B, S], ring slots to write, the ring slots of the ``P`` tokens before the chunk
    for each read-back length ``P`` a pool needs (the window ``W - 1``, CSA ``2m - 1``, HCA
    ``m' - 1``), the window mask, compressed-entry slots, rope rows. ``collect``: a decode step
    (S = 1) whose writes are collected as rows (:meth:`DeepseekV4Model.decode`) and whose
    entry reads see the step's own entry in place of its slot."""

    def __init__(self, model: DeepseekV4Model, caches: tuple[torch.Tensor, ...], positions: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, *, collect: bool) -> None:
        c = model.config
        B, S = positions.shape
        dev = positions.device
        # The block size is the pools' (a static shape): the ring's geometry follows from it.
        self.bs = bs = caches[0].shape[2]
        ring = ring_tokens(c, bs)
        self.block_tables, self.collect = block_tables, collect
        start = positions[:, :1]
        self.pos = pos = start + torch.arange(S, device=dev)                      # [B, S]
        self.valid = valid = pos < seq_lens[:, None]
        # A token's ring row is written unless padding or overwritten later in the same chunk.
        keep = valid & (pos >= seq_lens[:, None] - ring)
        slots = _ring_slots(block_tables, torch.where(valid, pos, 0), bs, ring // bs)
        self.ring_slots = torch.where(keep, slots, 0).reshape(-1)
        spans = {model.window - 1}
        if model.csa_layers:
            spans.add(2 * c.csa_compress_rate - 1)
        if model.hca_layers:
            spans.add(c.hca_compress_rate - 1)
        self.ctx_slots = {}
        for span in sorted(spans):
            ctx_pos = start + torch.arange(-span, 0, device=dev)
            self.ctx_slots[span] = _ring_slots(block_tables, ctx_pos.clamp(min=0), bs, ring // bs)
            if span == model.window - 1:
                ext_pos = torch.cat([ctx_pos, pos], dim=1)                        # [B, W - 1 + S]
                ext_ok = torch.cat([ctx_pos >= 0, valid], dim=1)
                delta = pos[:, :, None] - ext_pos[:, None, :]
                self.win_mask = (delta >= 0) & (delta < model.window) & ext_ok[:, None, :]
        # Every entry slot the table can hold, [B, nb * bs].
        self.entry_table = (block_tables[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(B, -1)
        self.entry_ids = torch.arange(self.entry_table.shape[1], device=dev)
        self.cos = {label: getattr(model, f"{label}_cos")[pos] for label in ("main", "compress")}
        self.sin = {label: getattr(model, f"{label}_sin")[pos] for label in ("main", "compress")}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.row_slots: dict[str, torch.Tensor] = {}
        self._closes: dict[int, bool] = {}

    def entry_slots(self, rate: int) -> torch.Tensor:
        """[B*S] pool slot of the entry each token closes, 0 (scratch) where it closes none."""
        return _entry_write_slots(self.block_tables, self.pos, self.valid, rate, self.bs)

    def may_close(self, rate: int) -> bool:
        """Whether some token of the step may close a window of ``rate``: always when tracing
        (one graph for every step); eagerly, only when one does (most decode steps close none,
        and then the window's compression is skipped)."""
        if tracing(self.pos):
            return True
        if rate not in self._closes:
            self._closes[rate] = bool((self.valid & ((self.pos + 1) % rate == 0)).any())
        return self._closes[rate]

    def closed(self, rate: int) -> torch.Tensor:
        """[B, S, E]: entry ``e`` is closed by query position ``p`` (``e < (p + 1) // rate``)."""
        return self.entry_ids[None, None, :] < torch.div(self.pos + 1, rate, rounding_mode="floor")[:, :, None]

    def write(self, pool: torch.Tensor, name: str, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Pool ``name``'s layer-``layer`` rows [B, S, width] at ``slots`` [B*S]: written in place,
        or (``collect``) kept for :meth:`DeepseekV4Model.decode` to return."""
        rows = rows.reshape(slots.shape[0], -1)
        if self.collect:
            self.rows.setdefault(name, []).append(rows)
            self.row_slots[name] = slots
        else:
            write_kv(pool, layer, slots, rows)

    def entries(self, pool: torch.Tensor, layer: int, rate: int, fresh: torch.Tensor) -> torch.Tensor:
        """The entries [B, E, width] of the rows' tables in pool layer ``layer``; in a decode step
        the entry the token closes comes from ``fresh`` [B, 1, width] (not yet written)."""
        width = pool.shape[-1]
        got = pool[layer].view(-1, width)[self.entry_table]
        if not self.collect:
            return got
        closing = self.valid & ((self.pos + 1) % rate == 0)                         # [B, 1]
        new = (self.entry_ids[None, :] == torch.div(self.pos + 1, rate, rounding_mode="floor") - 1) & closing
        return torch.where(new[:, :, None], fresh.to(got.dtype), got)


class DeepseekV4Model(FamilyModel):
    """The DeepSeek V4 forward over :class:`DeepseekV4Weights` (registered as buffers, no
    copies) and rope tables ``{main,compress}_{cos,sin}`` [max_model_len, rd / 2] float32.
    Caches: the pools of :func:`cache_specs`, in that order; the block size is read from their
    shape, the ring's length from it (:func:`ring_tokens`)."""

    #: :meth:`decode` returns each pool's slots after its rows.
    decode_row_slots = True

    def __init__(self, config: DeepseekV4Config, weights: DeepseekV4Weights, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        self.pool_index = {spec.name: i for i, spec in enumerate(cache_specs(config, 1))}
        c = config
        self.window = c.sliding_window
        self.csa_layers = c.layers_of(CSA)
        self.hca_layers = c.layers_of(HCA)
        self.csa_rank = {layer: i for i, layer in enumerate(self.csa_layers)}
        self.hca_rank = {layer: i for i, layer in enumerate(self.hca_layers)}
        self.hash_rank = {layer: i for i, layer in enumerate(c.hash_layers)}
        for f in fields(weights):
            t = getattr(weights, f.name)
            if t is not None:
                self.register_buffer(f.name, t, persistent=False)
        for label in ("main", "compress"):
            cos, sin = rope_tables(c, label, max_model_len)
            self.register_buffer(f"{label}_cos", cos.to(weights.embed.device), persistent=False)
            self.register_buffer(f"{label}_sin", sin.to(weights.embed.device), persistent=False)

    def linear_matrices(self) -> list[torch.Tensor]:
        """The per-layer float ``[N, K]`` matrices passed to :func:`~model_families.linear.float_linear`
        (views of the stacked tensors) and the head."""
        names = ["wq_a", "wq_b", "wkv", "wo_b", "shared_gate_up", "shared_down", "gate"]
        out = [getattr(self, n)[i] for n in names for i in range(self.config.num_hidden_layers)]
        for n, layers in (("csa_wkv_gate", self.csa_layers), ("csa_idx_wkv_gate", self.csa_layers),
                          ("csa_idx_wq_b", self.csa_layers), ("csa_idx_weights", self.csa_layers),
                          ("hca_wkv_gate", self.hca_layers)):
            out += [getattr(self, n)[i] for i in range(len(layers))]
        return [*out, self.head]

    # -- the step ---------------------------------------------------------------------------

    def forward(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                last_index: torch.Tensor) -> torch.Tensor:
        """One step over a padded batch (the family step contract), writing the caches in place.

        Args (B rows, S tokens per row, nb blocks per row; integer tensors int64):
            caches: the pools of :func:`cache_specs` (mutated).
            input_ids: [B, S]; positions: [B, S] (row ``b``'s chunk starts at ``positions[b, 0]``
                and runs contiguously; padding tokens past ``seq_lens`` are ignored).
            slot_mapping: [B, S] ring slots (unused: the step derives every slot from the block
                table, masking padding and tokens the same chunk overwrites in the ring).
            block_tables: [B, nb] (:class:`~model_families.block_layout.RingLayout`);
            seq_lens: [B] tokens of the row after this step; last_index: [B] token in ``S``
                whose logits are returned.
        Returns:
            logits [B, V] float32.
        """
        step = _Step(self, caches, positions, block_tables, seq_lens, collect=False)
        return self._run(step, caches, input_ids, last_index)

    def decode(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
        """One decode token per row (``input_ids`` / ``positions`` / ``seq_lens`` [B],
        ``block_tables`` [B, nb]) that only *reads* the caches: returns ``(logits [B, V] float32,
        *rows, *slots)``, for each pool of :func:`cache_specs` in order its rows ``[layers, B,
        width]`` and then, in the same order, the slots [B] to write them at (ring slots for the
        ring pools; for the compressed pools the closed entry's slot, or 0, the scratch block,
        where the token closes no window). Attention uses the step's own rows in place of their
        slots, so the compiled program has no in-place writes (a written pool that is read again
        would be copied whole by the compiler)."""
        step = _Step(self, caches, positions[:, None], block_tables, seq_lens, collect=True)
        logits = self._run(step, caches, input_ids[:, None], torch.zeros_like(input_ids))
        names = [name for name in self.pool_index]
        rows = [torch.stack(step.rows[name]) for name in names]
        return (logits, *rows, *[step.row_slots[name] for name in names])

    def _run(self, step: _Step, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor,
             last_index: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, S = input_ids.shape
        h = F.embedding(input_ids, self.embed).reshape(B * S, -1)
        h = h.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()     # [T, n, H]
        for i in range(c.num_hidden_layers):
            post, comb, x = hyper_connection(c, h, self.hc_attn_fn[i], self.hc_attn_base[i], self.hc_attn_scale[i])
            x = rms_norm(x, self.attn_norm[i], c.rms_norm_eps).view(B, S, -1)
            h = _mix(post, comb, self._attention(step, caches, i, x).reshape(B * S, -1), h)
            post, comb, x = hyper_connection(c, h, self.hc_ffn_fn[i], self.hc_ffn_base[i], self.hc_ffn_scale[i])
            x = rms_norm(x, self.ffn_norm[i], c.rms_norm_eps)
            h = _mix(post, comb, self._moe(i, x, input_ids.reshape(-1)), h)
        last = h.view(B, S, c.hc_mult, -1)[torch.arange(B, device=h.device), last_index]   # [B, n, H]
        flat = rms_norm(last.flatten(1).float(), None, c.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_head_fn.float()) * self.hc_head_scale.float()
                            + self.hc_head_base.float()) + c.hc_eps
        x = (pre.unsqueeze(-1) * last).sum(dim=1).to(last.dtype)
        return float_linear(rms_norm(x, self.final_norm, c.rms_norm_eps), self.head).float()

    def _pool(self, caches: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
        return caches[self.pool_index[name]]

    def _attention(self, step: _Step, caches: tuple[torch.Tensor, ...], i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention (M: ``DeepseekV4Attention.forward``) for ``x`` [B, S, H];
        returns [B, S, H]; this layer's cache rows are written (or collected, decode)."""
        c = self.config
        B, S, _ = x.shape
        nh, hd, eps = c.num_attention_heads, c.head_dim, c.rms_norm_eps
        label = c.rope_label(i)
        cos, sin = step.cos[label], step.sin[label]
        q_res = rms_norm(float_linear(x, self.wq_a[i]), self.q_norm[i], eps)
        q = rms_norm(float_linear(q_res, self.wq_b[i]).view(B, S, nh, hd), None, eps)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv = apply_rope(rms_norm(float_linear(x, self.wkv[i]), self.kv_norm[i], eps), cos, sin)
        win = self._pool(caches, "win")
        keys = torch.cat([win[i].view(-1, hd)[step.ctx_slots[self.window - 1]], kv], dim=1)   # [B, W-1+S, hd]
        mask = step.win_mask
        if i in self.csa_rank:
            comp, comp_mask = self._csa(step, caches, self.csa_rank[i], x, q_res)
            keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, comp_mask], dim=2)
        elif i in self.hca_rank:
            comp, comp_mask = self._hca(step, caches, self.hca_rank[i], x)
            keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, comp_mask], dim=2)
        step.write(win, "win", i, step.ring_slots, kv)
        # Eager attention with a per-head sink logit (M: ``eager_attention_forward``).
        logits = torch.einsum("bshd,bkd->bhsk", q, keys) * hd ** -0.5
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        sinks = self.attn_sink[i].to(logits.dtype).view(1, nh, 1, 1).expand(B, nh, S, 1)
        logits = torch.cat([logits, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
        out = torch.einsum("bhsk,bkd->bshd", probs, keys)
        out = apply_rope(out, cos.unsqueeze(2), -sin.unsqueeze(2))
        g = c.o_groups
        grouped = out.reshape(B, S, g, -1)
        wo_a = self.wo_a[i].view(g, -1, grouped.shape[-1])                     # [g, r, nh*hd/g]
        grouped = torch.einsum("bsgk,grk->bsgr", grouped, wo_a).flatten(2)
        return float_linear(grouped, self.wo_b[i])

    def _compress(self, ext: torch.Tensor, span: int, ape: torch.Tensor, norm: torch.Tensor, width: int,
                  overlap: bool, pos: torch.Tensor, rate: int) -> torch.Tensor:
        """The compressed entry each chunk token would close, [B, S, width] (meaningful where
        ``(pos + 1) % rate == 0``). ``ext`` [B, P + S, 2·C] holds raw ``kv | gate`` rows (C =
        2·width with ``overlap``, else width) of the ``P >= span - 1`` ring tokens before the
        chunk and of the chunk. Without overlap (HCA; M: ``DeepseekV4HCACompressor``): softmax
        over the window's ``rate`` rows of ``gate + ape``, weighted sum of ``kv``. With overlap
        (CSA and its indexer; M: ``DeepseekV4CSACompressor``): ``2·rate`` slots, the previous
        window's first halves (``Ca``) then this window's second halves (``Cb``); window 0 has no
        previous one. Then ``norm`` and the ``compress`` rope at the window's first position."""
        B, S = pos.shape
        P = ext.shape[1] - S
        cw = ext.shape[-1] // 2
        win = ext.unfold(1, span, 1)[:, P - span + 1:P - span + 1 + S]        # [B, S, 2C, span]
        win = win.transpose(-1, -2)                                            # [B, S, span, 2C]
        kv, gate = win[..., :cw], win[..., cw:]
        if overlap:
            gate = gate + ape.repeat(2, 1).to(gate.dtype)
            first = torch.arange(span, device=ext.device) < rate                  # previous window's slots
            kv = torch.where(first[:, None], kv[..., :width], kv[..., width:])
            gate = torch.where(first[:, None], gate[..., :width], gate[..., width:])
            no_prev = (pos + 1 < 2 * rate)[:, :, None, None] & first[:, None]
            kv = kv.masked_fill(no_prev, 0.0)
            gate = gate.masked_fill(no_prev, float("-inf"))
        else:
            gate = gate + ape.to(gate.dtype)
        entry = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        entry = rms_norm(entry, norm, self.config.rms_norm_eps)
        start = (pos + 1 - rate).clamp(min=0)
        return apply_rope(entry, self.compress_cos[start], self.compress_sin[start])

    def _csa(self, step: _Step, caches: tuple[torch.Tensor, ...], j: int, x: torch.Tensor, q_res: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA layer rank ``j``: this step's entries and indexer keys, then the entries of the
        table [B, E, hd] and which each query sees [B, S, E] (the indexer's top ``index_topk``
        among the entries closed by its position; M: ``DeepseekV4Indexer``)."""
        c = self.config
        B, S, _ = x.shape
        hd, idim, m = c.head_dim, c.index_head_dim, c.csa_compress_rate
        raw_pool, kv_pool, ik_pool = (self._pool(caches, n) for n in ("csa_raw", "csa_kv", "csa_ik"))
        raw = torch.cat([float_linear(x, self.csa_wkv_gate[j]), float_linear(x, self.csa_idx_wkv_gate[j])], dim=-1)
        if step.may_close(m):
            ext = torch.cat([raw_pool[j].view(-1, raw.shape[-1])[step.ctx_slots[2 * m - 1]], raw], dim=1)
            main, idx = ext[..., :4 * hd], ext[..., 4 * hd:]
            entry = self._compress(main, 2 * m, self.csa_ape[j], self.csa_norm[j], hd, True, step.pos, m)
            ikey = self._compress(idx, 2 * m, self.csa_idx_ape[j], self.csa_idx_norm[j], idim, True, step.pos, m)
        else:  # no row closes a window: nothing is written or read from these
            entry, ikey = raw.new_zeros(B, S, hd), raw.new_zeros(B, S, idim)
        slots = step.entry_slots(m)
        step.write(kv_pool, "csa_kv", j, slots, entry)
        step.write(ik_pool, "csa_ik", j, slots, ikey)
        step.write(raw_pool, "csa_raw", j, step.ring_slots, raw)
        comp = step.entries(kv_pool, j, m, entry)                                 # [B, E, hd]
        keys = step.entries(ik_pool, j, m, ikey)                                  # [B, E, id]
        ih = c.index_n_heads
        qi = float_linear(q_res, self.csa_idx_wq_b[j]).view(B, S, ih, idim)
        qi = apply_rope(qi, step.cos["compress"].unsqueeze(2), step.sin["compress"].unsqueeze(2))
        scores = F.relu(torch.einsum("bshd,bed->bshe", qi.float(), keys.float())) * idim ** -0.5
        weights = float_linear(x, self.csa_idx_weights[j]).float() * ih ** -0.5    # [B, S, ih]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)                     # [B, S, E]
        ready = step.closed(m)
        scores = scores.masked_fill(~ready, float("-inf"))
        top = scores.topk(min(c.index_topk, scores.shape[-1]), dim=-1).indices
        picked = torch.zeros_like(ready).scatter(-1, top, True) & ready
        return comp, picked

    def _hca(self, step: _Step, caches: tuple[torch.Tensor, ...], j: int, x: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """HCA layer rank ``j``: this step's entry, then the table's entries [B, E, hd] and
        which each query sees [B, S, E] (all entries its position has closed)."""
        c = self.config
        hd, m = c.head_dim, c.hca_compress_rate
        raw_pool, kv_pool = self._pool(caches, "hca_raw"), self._pool(caches, "hca_kv")
        raw = float_linear(x, self.hca_wkv_gate[j])
        if step.may_close(m):
            ext = torch.cat([raw_pool[j].view(-1, raw.shape[-1])[step.ctx_slots[m - 1]], raw], dim=1)
            entry = self._compress(ext, m, self.hca_ape[j], self.hca_norm[j], hd, False, step.pos, m)
        else:  # no row closes a window: nothing is written or read from it
            entry = raw.new_zeros(*x.shape[:2], hd)
        step.write(kv_pool, "hca_kv", j, step.entry_slots(m), entry)
        step.write(raw_pool, "hca_raw", j, step.ring_slots, raw)
        return step.entries(kv_pool, j, m, entry), step.closed(m)

    def _moe(self, i: int, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MoE on ``x`` [T, H] (M: ``DeepseekV4SparseMoeBlock``): router scores,
        top-k by ``scores + gate_bias`` (or ``tid2eid[token]`` in a hash layer), weights from
        the unbiased scores normalised and scaled; each picked expert runs once on the tokens
        that picked it (:func:`~model_families.custom_ops.grouped_experts`, a custom op in a compiled
        program), plus the shared expert."""
        c = self.config
        limit = c.swiglu_limit
        logits = float_linear(x, self.gate[i])
        if c.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif c.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        if c.mlp_layer_types[i] == HASH_MOE:
            idx = self.tid2eid[self.hash_rank[i]][token_ids]
        else:
            idx = torch.topk(scores + self.gate_bias[i], c.num_experts_per_tok, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        shared = float_linear(_swiglu(float_linear(x, self.shared_gate_up[i]), limit), self.shared_down[i])
        return grouped_experts(x, idx, w, self.experts_gate_up[i], self.experts_down[i], limit) + shared
