"""DeepSeek V4's attention over the window ring and the compressed pools: sliding-window
attention with per-head sinks, and the CSA / HCA compressors with CSA's lightning indexer
(transformers' ``DeepseekV4Attention``, ``DeepseekV4CSACompressor``, ``DeepseekV4HCACompressor``,
``DeepseekV4Indexer``). ``model`` below is the :class:`~model_families.deepseek_v4.model.DeepseekV4Model`
whose weight buffers and layer ranks the functions read. See ``docs/deepseek_v4.md``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_families.custom_ops import index_topk
from model_families.deepseek_v4.cache_layout import Step
from model_families.deepseek_v4.norm_rope import rms_norm_f32_scale, rope_interleaved_partial
from model_families.family import FamilyModel
from model_families.linear import float_linear


def attention(model: FamilyModel, step: Step, caches: tuple[torch.Tensor, ...], i: int, x: torch.Tensor
              ) -> torch.Tensor:
    """Layer ``i``'s attention (M: ``DeepseekV4Attention.forward``) for ``x`` [B, S, H];
    returns [B, S, H]; this layer's cache rows are written (or collected, decode)."""
    c = model.config
    B, S, _ = x.shape
    nh, hd, eps = c.num_attention_heads, c.head_dim, c.rms_norm_eps
    label = c.rope_label(i)
    cos, sin = step.cos[label], step.sin[label]
    q_res = rms_norm_f32_scale(float_linear(x, model.wq_a[i]), model.q_norm[i], eps)
    q = rms_norm_f32_scale(float_linear(q_res, model.wq_b[i]).view(B, S, nh, hd), None, eps)
    q = rope_interleaved_partial(q, cos.unsqueeze(2), sin.unsqueeze(2))
    kv = rope_interleaved_partial(rms_norm_f32_scale(float_linear(x, model.wkv[i]), model.kv_norm[i], eps), cos, sin)
    win = model.pool(caches, "win")
    keys = torch.cat([win[i].view(-1, hd)[step.ctx_slots[model.window - 1]], kv], dim=1)   # [B, W-1+S, hd]
    mask = step.win_mask
    if i in model.csa_rank:
        comp, comp_mask = csa(model, step, caches, model.csa_rank[i], x, q_res)
        keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, comp_mask], dim=2)
    elif i in model.hca_rank:
        comp, comp_mask = hca(model, step, caches, model.hca_rank[i], x)
        keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, comp_mask], dim=2)
    step.write(win, "win", i, step.ring_slots, kv)
    # Eager attention with a per-head sink logit (M: ``eager_attention_forward``).
    logits = torch.einsum("bshd,bkd->bhsk", q, keys) * hd ** -0.5
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sinks = model.attn_sink[i].to(logits.dtype).view(1, nh, 1, 1).expand(B, nh, S, 1)
    logits = torch.cat([logits, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    out = torch.einsum("bhsk,bkd->bshd", probs, keys)
    out = rope_interleaved_partial(out, cos.unsqueeze(2), -sin.unsqueeze(2))
    g = c.o_groups
    grouped = out.reshape(B, S, g, -1)
    wo_a = model.wo_a[i].view(g, -1, grouped.shape[-1])                     # [g, r, nh*hd/g]
    grouped = torch.einsum("bsgk,grk->bsgr", grouped, wo_a).flatten(2)
    return float_linear(grouped, model.wo_b[i])


def _compress(model: FamilyModel, ext: torch.Tensor, span: int, ape: torch.Tensor, norm: torch.Tensor,
              width: int, overlap: bool, pos: torch.Tensor, rate: int) -> torch.Tensor:
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
    entry = rms_norm_f32_scale(entry, norm, model.config.rms_norm_eps)
    start = (pos + 1 - rate).clamp(min=0)
    return rope_interleaved_partial(entry, model.compress_cos[start], model.compress_sin[start])


def csa(model: FamilyModel, step: Step, caches: tuple[torch.Tensor, ...], j: int, x: torch.Tensor,
        q_res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA layer rank ``j``: this step's entries and indexer keys, then the entries of the
    table [B, E, hd] and which each query sees [B, S, E] bool (the indexer's top ``index_topk``
    among the entries closed by its position, float32 scores over a row of exactly those
    entries, ties broken as transformers' cached decode breaks them:
    :func:`~model_families.custom_ops.index_topk`; M: ``DeepseekV4Indexer``)."""
    c = model.config
    B, S, _ = x.shape
    hd, idim, m = c.head_dim, c.index_head_dim, c.csa_compress_rate
    raw_pool, kv_pool, ik_pool = (model.pool(caches, n) for n in ("csa_raw", "csa_kv", "csa_ik"))
    raw = torch.cat([float_linear(x, model.csa_wkv_gate[j]), float_linear(x, model.csa_idx_wkv_gate[j])], dim=-1)
    if step.may_close(m):
        ext = torch.cat([raw_pool[j].view(-1, raw.shape[-1])[step.ctx_slots[2 * m - 1]], raw], dim=1)
        main, idx = ext[..., :4 * hd], ext[..., 4 * hd:]
        entry = _compress(model, main, 2 * m, model.csa_ape[j], model.csa_norm[j], hd, True, step.pos, m)
        ikey = _compress(model, idx, 2 * m, model.csa_idx_ape[j], model.csa_idx_norm[j], idim, True, step.pos, m)
    else:  # no row closes a window: nothing is written or read from these
        entry, ikey = raw.new_zeros(B, S, hd), raw.new_zeros(B, S, idim)
    slots = step.entry_slots(m)
    step.write(kv_pool, "csa_kv", j, slots, entry)
    step.write(ik_pool, "csa_ik", j, slots, ikey)
    step.write(raw_pool, "csa_raw", j, step.ring_slots, raw)
    comp = step.entries(kv_pool, j, m, entry)                                 # [B, E, hd]
    keys = step.entries(ik_pool, j, m, ikey)                                  # [B, E, id]
    ih = c.index_n_heads
    qi = float_linear(q_res, model.csa_idx_wq_b[j]).view(B, S, ih, idim)
    qi = rope_interleaved_partial(qi, step.cos["compress"].unsqueeze(2), step.sin["compress"].unsqueeze(2))
    scores = F.relu(torch.einsum("bshd,bed->bshe", qi.float(), keys.float())) * idim ** -0.5
    weights = float_linear(x, model.csa_idx_weights[j]).float() * ih ** -0.5    # [B, S, ih]
    scores = (scores * weights.unsqueeze(-1)).sum(dim=2)                     # [B, S, E]
    lengths, closed = step.index_rows(m)
    return comp, index_topk(scores, lengths, closed, c.index_topk)


def hca(model: FamilyModel, step: Step, caches: tuple[torch.Tensor, ...], j: int, x: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """HCA layer rank ``j``: this step's entry, then the table's entries [B, E, hd] and
    which each query sees [B, S, E] (all entries its position has closed)."""
    c = model.config
    hd, m = c.head_dim, c.hca_compress_rate
    raw_pool, kv_pool = model.pool(caches, "hca_raw"), model.pool(caches, "hca_kv")
    raw = float_linear(x, model.hca_wkv_gate[j])
    if step.may_close(m):
        ext = torch.cat([raw_pool[j].view(-1, raw.shape[-1])[step.ctx_slots[m - 1]], raw], dim=1)
        entry = _compress(model, ext, m, model.hca_ape[j], model.hca_norm[j], hd, False, step.pos, m)
    else:  # no row closes a window: nothing is written or read from it
        entry = raw.new_zeros(*x.shape[:2], hd)
    step.write(kv_pool, "hca_kv", j, step.entry_slots(m), entry)
    step.write(raw_pool, "hca_raw", j, step.ring_slots, raw)
    return step.entries(kv_pool, j, m, entry), step.closed(m)
