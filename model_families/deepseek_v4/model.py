"""The DeepSeek V4 forward pass on paged caches, computed on the sidecar's stacked tensors
(:mod:`model_families.deepseek_v4.pack`), composing the family's parts: weights
(:mod:`.weights`), caches and step geometry (:mod:`.cache_layout`), norm and RoPE
(:mod:`.norm_rope`), hyper-connections (:mod:`.hyper_connections`), attention and compressors
(:mod:`.attention`), MoE (:mod:`.moe`).

Math follows transformers' ``models/deepseek_v4/modeling_deepseek_v4.py`` (the reference in the
tests; "M:" below names its classes): sliding-window attention with per-head sinks over one
shared K=V head, low-rank queries with a weightless per-head RMSNorm, interleaved RoPE on the
trailing ``qk_rope_head_dim`` channels (undone on the output), a grouped output projection; CSA
layers add compressed entries picked by the lightning indexer, HCA layers all compressed entries;
MoE with a shared expert in every layer (hash-routed or top-k); ``hc_mult`` residual streams
mixed by hyper-connections.

One step (:meth:`DeepseekV4Model.forward`; decode is the same code with one token per row) for
each row takes its chunk ``[start, start + n)`` and the ``ctx`` tokens before it from the ring
(the pools: :mod:`.cache_layout`): window attention sees keys ``p - W + 1 .. p``; compressed
entries that close inside the chunk are computed and written before attention reads the pools;
the chunk's rows are written to the ring after. A chunk boundary anywhere gives the same caches
as one whole prefill, since every quantity is a function of (token, position) rows the ring
still holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import torch
import torch.nn.functional as F

from model_families.deepseek_v4.attention import attention
from model_families.deepseek_v4.cache_layout import Step, cache_specs
from model_families.deepseek_v4.config import CSA, HCA, WINDOW, DeepseekV4Config
from model_families.deepseek_v4.hyper_connections import hyper_connection, hyper_head, mix
from model_families.deepseek_v4.moe import moe
from model_families.deepseek_v4.norm_rope import rms_norm_f32_scale, rope_tables
from model_families.deepseek_v4.weights import DeepseekV4Weights
from model_families.family import FamilyModel
from model_families.linear import float_linear


class DeepseekV4Model(FamilyModel):
    """The DeepSeek V4 forward over :class:`DeepseekV4Weights` (registered as buffers, no
    copies) and rope tables ``{main,compress}_{cos,sin}`` [max_model_len, rd / 2] float32.
    Caches: the pools of :func:`cache_specs`, in that order; the block size is read from their
    shape, the ring's length from it and ``draft_tokens`` (:func:`~.cache_layout.ring_tokens`)."""

    #: :meth:`decode` returns each pool's slots after its rows.
    decode_row_slots = True

    def __init__(self, config: DeepseekV4Config, weights: DeepseekV4Weights, max_model_len: int,
                 draft_tokens: int = 0) -> None:
        super().__init__()
        self.config = config
        self.draft_tokens = draft_tokens
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
        #: The MTP blocks as the layers of a model :func:`attention` and :func:`moe` can run
        #: (:class:`_MtpBlocks`), ``None`` for a checkpoint without them.
        self.mtp_blocks = _MtpBlocks(self) if weights.mtp_e_proj is not None else None

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
        step = self._step(caches, positions, block_tables, seq_lens, collect=False)
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
        step = self._step(caches, positions[:, None], block_tables, seq_lens, collect=True)
        logits = self._run(step, caches, input_ids[:, None], torch.zeros_like(input_ids))
        names = [name for name in self.pool_index]
        rows = [torch.stack(step.rows[name]) for name in names]
        return (logits, *rows, *[step.row_slots[name] for name in names])

    def verify(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` returning the logits of every position, [B, S, V] float32 (the verify
        step of speculative decoding: each row's last token, then its drafts; padding past
        ``seq_lens`` ignored). Rejected drafts need no undo: their ring rows land in the ring's
        spare slots (:func:`~.cache_layout.ring_tokens`), never in a row a later step reads back
        (the rolling compressor state); an entry a rejected draft closed lies past the row's
        closed entries until the token at its position closes it again, and that step writes
        it before attention reads it."""
        step = self._step(caches, positions, block_tables, seq_lens, collect=False)
        return self._run(step, caches, input_ids, None)

    def _step(self, caches: tuple[torch.Tensor, ...], positions: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, *, collect: bool) -> Step:
        labels = ("main", "compress")
        cos = {label: getattr(self, f"{label}_cos") for label in labels}
        sin = {label: getattr(self, f"{label}_sin") for label in labels}
        return Step(self.config, caches, positions, block_tables, seq_lens, cos, sin, collect=collect,
                    draft_tokens=self.draft_tokens)

    def mtp(self, pool: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, block: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of MTP block ``block`` (the release's ``inference/model.py`` ``MTPBlock.forward``)
        over a padded batch: position ``p`` of a row pairs ``hidden`` at ``p`` (the main model's
        residual streams before its ``hc_head``, :meth:`streams`, or this block's own output
        for a further draft) with ``input_ids`` at ``p`` (the token *after* ``p``), and predicts
        the token two after ``p``. Position 0 pairs the first token's streams with the second
        token, nothing masked (vLLM's ``deepseek_mtp`` zeroes the embedding at position 0 of its
        shifted inputs instead).

        Args (B rows, S positions; int64): ``pool`` the block's window ring
        [N_mtp, num_blocks, block_size, hd] (its rows at the main ring's slots, written in place);
        ``hidden`` [B, S, n, H]; ``input_ids``, ``positions`` [B, S] (contiguous from
        ``positions[:, 0]``); ``block_tables`` [B, nb] (the sequence's, as the main step's);
        ``seq_lens`` [B] (positions the block has seen after this step). Returns
        ``(logits [B, S, V] float32, streams [B, S, n, H])``."""
        c, mtp, j = self.config, self.mtp_blocks, block
        eps = c.rms_norm_eps
        B, S = input_ids.shape
        step = self._step((pool,), positions, block_tables, seq_lens, collect=False)
        e = rms_norm_f32_scale(F.embedding(input_ids, self.embed), mtp.enorm[j], eps)
        x = float_linear(e, mtp.e_proj[j]).unsqueeze(2) + float_linear(
            rms_norm_f32_scale(hidden, mtp.hnorm[j], eps), mtp.h_proj[j])
        h = self._block(mtp, j, step, (pool,), x.reshape(B * S, c.hc_mult, -1), input_ids)
        out = hyper_head(c, h, mtp.hc_head_fn[j], mtp.hc_head_base[j], mtp.hc_head_scale[j])
        logits = float_linear(rms_norm_f32_scale(out, mtp.norm[j], eps), self.head).float()
        return logits.view(B, S, -1), h.view(B, S, c.hc_mult, -1)

    def _block(self, model, i: int, step: Step, caches: tuple[torch.Tensor, ...], h: torch.Tensor,
               input_ids: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` of ``model`` (this model, or :class:`_MtpBlocks`) on the streams ``h``
        [T, n, H] of ``input_ids`` [B, S]: attention, then MoE, each between hyper-connections."""
        c = self.config
        B, S = input_ids.shape
        post, comb, x = hyper_connection(c, h, model.hc_attn_fn[i], model.hc_attn_base[i], model.hc_attn_scale[i])
        x = rms_norm_f32_scale(x, model.attn_norm[i], c.rms_norm_eps).view(B, S, -1)
        h = mix(post, comb, attention(model, step, caches, i, x).reshape(B * S, -1), h)
        post, comb, x = hyper_connection(c, h, model.hc_ffn_fn[i], model.hc_ffn_base[i], model.hc_ffn_scale[i])
        x = rms_norm_f32_scale(x, model.ffn_norm[i], c.rms_norm_eps)
        return mix(post, comb, moe(model, i, x, input_ids.reshape(-1)), h)

    def forward_streams(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        last_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, also returning the residual streams before ``hc_head`` of every
        position, [B, S, n, H]: ``(logits [B, V] float32, streams)``."""
        step = self._step(caches, positions, block_tables, seq_lens, collect=False)
        return self._run(step, caches, input_ids, last_index, with_streams=True)

    def streams(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`verify`, also returning the residual streams before ``hc_head`` [B, S, n, H]
        (what :meth:`mtp` takes): ``(logits [B, S, V] float32, streams)``."""
        step = self._step(caches, positions, block_tables, seq_lens, collect=False)
        return self._run(step, caches, input_ids, None, with_streams=True)

    def _run(self, step: Step, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor,
             last_index: torch.Tensor | None, with_streams: bool = False) -> torch.Tensor:
        """The layers and the head: logits [B, V] at ``last_index`` [B], or [B, S, V] at every
        position when it is ``None``; ``with_streams``: ``(logits, streams [B, S, n, H])``."""
        c = self.config
        B, S = input_ids.shape
        h = F.embedding(input_ids, self.embed).reshape(B * S, -1)
        h = h.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()     # [T, n, H]
        for i in range(c.num_hidden_layers):
            h = self._block(self, i, step, caches, h, input_ids)
        if last_index is None:
            last = h                                                                         # [B*S, n, H]
        else:
            last = h.view(B, S, c.hc_mult, -1)[torch.arange(B, device=h.device), last_index]  # [B, n, H]
        x = hyper_head(c, last, self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        logits = float_linear(rms_norm_f32_scale(x, self.final_norm, c.rms_norm_eps), self.head).float()
        logits = logits if last_index is not None else logits.view(B, S, -1)
        return (logits, h.view(B, S, c.hc_mult, -1)) if with_streams else logits

    def pool(self, caches: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
        """The pool ``name`` of :func:`~.cache_layout.cache_specs` among ``caches``."""
        return caches[self.pool_index[name]]


class _MtpBlocks:
    """The MTP blocks seen as the layers of a model by :func:`attention` and :func:`moe`: their
    weights (the ``mtp_*`` buffers of ``model``, block ``j`` at index ``j``), a config of
    ``N_mtp`` window-only, top-k routed layers, and the block's window ring as its one pool."""

    def __init__(self, model: DeepseekV4Model) -> None:
        c = model.config
        n = model.mtp_e_proj.shape[0]
        self.config = dataclasses.replace(c, num_hidden_layers=n, layer_types=(WINDOW,) * n,
                                          mlp_layer_types=("moe",) * n)
        self.window, self.csa_rank, self.hca_rank = model.window, {}, {}
        self._model = model

    def __getattr__(self, name: str) -> torch.Tensor:
        return getattr(self._model, f"mtp_{name}")

    def pool(self, caches: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
        """The blocks' window ring (``caches`` is ``(pool,)``)."""
        return caches[0]
