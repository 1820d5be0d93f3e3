"""The model runner: owns the family model, the KV cache, the persistent decode buffers and the
installed compiled programs, and runs one scheduled step (nano-vllm's ``ModelRunner``;
``docs/architecture.md`` §8-§9).

Every step goes through :meth:`ModelRunner.run`, which returns the logits of the rows that
sample (one definition for prefill and decode: :meth:`ScheduledBatch.sampling_rows`), in the
batch's order.

Decode steps run the family's decode module (:meth:`model_families.family.ModelFamily.decode_module`)
eagerly, or the program compiled from it (:mod:`runner_service.programs`, installed with
:meth:`ModelRunner.install_program`); both are called the same way (the compile contract)::

    program(caches, input_ids[B], positions[B], slot_mapping[B], block_tables[B, nb], seq_lens[B])
        -> (logits[B, V] float32, *rows)

All inputs int64, views of the persistent buffers (a compiled program gets a contiguous copy of
the block table). When the module returns cache rows rather than writing them
(:meth:`model_families.family.FamilyModel.decode`), :meth:`ModelRunner.decode` writes them, so a
decode step always leaves the KV cache written. ``B`` is a *batch bucket* (1, 2, 4, ...,
``max_num_seqs``); rows past the active ones are padding. ``nb`` is the largest active block
table's length (:meth:`ModelRunner.block_width`; at most ``max_blocks_per_seq``).

Sequences keep their decode row from step to step (a leaving sequence's row is taken by the
last active one), so the block-table cache in :class:`DecodeBuffers` rebuilds only rows whose
sequence changed or grew a block.

Prefill steps build their ``[B, S]`` tensors per step (their cost is amortised over the chunk).

A speculative verify step (:meth:`ModelRunner.run_verify`) runs the family's
:class:`~model_families.family.VerifyStep` eagerly or its compiled program, both called as
``(caches, input_ids[n, S], positions[n, S], slot_mapping[n, S], block_tables[n, nb],
seq_lens[n]) -> (logits[n, S, V] float32,)`` on the active rows of the persistent verify grids
(contiguous prefixes; the program gets a contiguous copy of the block table, as decode's); with
a drafter that reads the residual streams (:data:`~runner_service.options.STREAMS_METHODS`:
``mtp``) the step returns ``(logits, streams[n, S, ...])``, compiled alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_families import family_for_config, invariant, native
from model_families.family import FamilyConfig, FamilyWeights, ModelFamily, VerifyStep
from model_families.kv_write import write_kv_rows
from model_families.linear import linear
from model_families.prepack import PackedMatrices
from model_families.quantized_weights import Int4TileWeight, QuantizedWeight
from runner_service.config import EngineConfig
from runner_service.decode_buffers import DecodeBuffers
from runner_service.device import synchronize
from runner_service.kv_cache import SCRATCH_BLOCK, KVCache
from runner_service.options import STREAMS_METHODS
from runner_service.programs.spec import PROGRAM_KINDS, ProgramSpec
from runner_service.scheduler import ScheduledBatch
from runner_service.sequence import Sequence

#: A compiled program: ``program(caches, *inputs) -> (logits, *rows)`` (see the module docstring).
Program = Callable[..., tuple[torch.Tensor, ...]]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes compiled/padded to: powers of two below ``max_num_seqs``, then it."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


#: Multiply-adds one row count of the batch-invariant probe may cost per matrix shape (so the
#: vocabulary's matrix is probed at few rows, a layer's at many).
PROBE_MACS = 1 << 27

#: Tokens of the prefill step the warm-up runs through a compiled prefill: a chat prompt's length
#: (SmolLM2's chat template makes 30-60-token prompts of short questions).
WARMUP_PREFILL_TOKENS = 48


@dataclass(frozen=True)
class WarmupPlan:
    """The steps the start-up warm-up runs (:meth:`ModelRunner.warmup`), all on padding rows that
    touch only the scratch block: ``decode`` ``(batch bucket, block-table width)`` pairs,
    ``prefill`` and ``verify`` ``(rows, tokens)`` pairs."""

    decode: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int], ...] = ()
    verify: tuple[tuple[int, int], ...] = ()

    def describe(self) -> str:
        """``decode buckets [1] width 1; prefill 1 x 48 tokens`` (the ``warmup`` phase's detail)."""
        widths = sorted({w for _, w in self.decode})
        parts = [f"decode buckets {sorted({b for b, _ in self.decode})} width {'/'.join(map(str, widths))}"]
        parts += [f"prefill {rows} x {tokens} tokens" for rows, tokens in self.prefill]
        parts += [f"verify {rows} x {tokens} tokens" for rows, tokens in self.verify]
        return "; ".join(parts)


def _bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


class ModelRunner:
    """Runs prefill and decode steps of one model on one device.

    ``args``/``weights``: the family config and weights (the family is ``family``, or the one
    whose config class built ``args``); ``kv``: the cache allocated for the family's
    :meth:`~model_families.family.ModelFamily.cache_specs`; ``max_model_len``: context length in
    tokens (sizes the block tables and derived tables such as RoPE); ``prepack``: make the
    oneDNN-blocked copies of the matrices (:class:`PackedMatrices`; a build child, which only
    compiles, does without). With ``config.batch_invariant`` its eager steps run the
    batch-invariant kernels (:attr:`invariance`, probed here: ``FailedPrecondition`` when this
    host's matmuls cannot give row-count-independent bits).
    """

    def __init__(self, args: FamilyConfig, weights: FamilyWeights, kv: KVCache, config: EngineConfig,
                 max_model_len: int, device: torch.device, family: ModelFamily | None = None, *,
                 prepack: bool = True) -> None:
        self.args = args
        self.family = family or family_for_config(args)
        self.kv = kv
        self.config = config
        self.device = device
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        #: The family's block-table layout (slots of positions, blocks per sequence).
        # only a speculating runner passes draft_tokens (a family that lists no method need not take it)
        drafts = {"draft_tokens": config.num_draft_tokens} if config.num_draft_tokens else {}
        self.layout = self.family.block_layout(args, kv.block_size, max_model_len, **drafts)
        self.max_blocks_per_seq = self.layout.blocks_needed(max_model_len)
        self.dtype = weights.dtype
        self.model = self.family.build_model(args, weights, max_model_len, **drafts).eval()
        self.decode_module = self.family.decode_module(self.model).eval()
        # a quantized sidecar's head also gets an int8 copy for steps of a few rows (its source, a
        # quantized checkpoint, holds it in int8 or less); not in batch-invariant mode, where a
        # row's head must not depend on how many rows the step has
        quantized = any(isinstance(m, QuantizedWeight) for m in self.model.modules())
        head = getattr(self.model, "lm_head", None) if quantized and not config.batch_invariant else None
        #: Whether the int4 tile matrices and the int8 head copy are multiplied by int8 activations
        #: (``--quantized-activations int8`` where the CPU runs it; in the programs' key).
        self.int8_activations = (quantized and config.quantized_activations == "int8"
                                 and self.dtype == torch.bfloat16 and native.int8_activations_enabled())
        for m in self.model.modules():
            if isinstance(m, Int4TileWeight):
                m.int8_activations = self.int8_activations
        self.packed = PackedMatrices(self.model.linear_matrices() if prepack else [], batch_hint=config.max_num_seqs,
                                     head=head if prepack and isinstance(head, torch.Tensor) else None,
                                     int8_activations=self.int8_activations)
        self.buckets = batch_buckets(config.max_num_seqs)
        #: The batch-invariant row policy (:func:`model_families.invariant.probe_rows`), or ``None``.
        self.invariance = self._probe_invariance() if config.batch_invariant else None
        self.buffers = DecodeBuffers(config.max_num_seqs, self.max_blocks_per_seq, kv.block_size,
                                     kv.num_blocks, device, self.layout, max_draft_tokens=config.num_draft_tokens)
        #: Held by every step (:meth:`run`, :meth:`warmup`) and by ``torch.export`` while it traces
        #: this runner's modules (:func:`runner_service.programs.aoti.compile_aoti`): a background
        #: build runs in a child process (:mod:`runner_service.programs.build_child`), so while
        #: serving nothing but the steps takes it.
        self.forward_lock = threading.Lock()
        #: The thread count :meth:`program_spec` reports while the stepping thread steps on fewer
        #: (a background build ceded one, :mod:`runner_service.program_installer`); ``None``: the
        #: calling thread's.
        self.serving_threads: int | None = None
        #: The compiled decode (the compile contract), or None: eager.
        self.decode_program: Program | None = None
        #: The compiled prefill (``program(caches, *forward inputs) -> (logits,)``), or None: eager.
        self.prefill_program: Program | None = None
        #: The verify step (speculative decoding; ``None`` when off) and its compiled program.
        self.verify_module = (VerifyStep(self.model, with_streams=config.speculative in STREAMS_METHODS).eval()
                              if config.num_draft_tokens else None)
        self.verify_program: Program | None = None
        #: Programs installed (or removed) so far: changes with every :meth:`install_program`.
        self.installs = 0
        self._computed_by = {"decode": "eager", "prefill": "eager"}
        if config.num_draft_tokens:
            self._computed_by["verify"] = "eager"
        self._rows: list[Sequence] = []

    # -- the compile contract ----------------------------------------------------------------

    def program_spec(self, layers: str = "unrolled") -> ProgramSpec:
        """What this runner's programs are built for and from (:class:`ProgramSpec`), now: the
        thread count is :attr:`serving_threads` or the calling thread's, the family config as it
        is; ``layers`` the programs' form (:data:`~runner_service.programs.spec.PROGRAM_LAYERS`)."""
        return ProgramSpec(
            family=self.family, config=self.args.to_dict(), mode=self.config.compile, block_size=self.block_size,
            max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            max_prefill_tokens=min(self.config.resolved_max_num_batched_tokens(self.max_model_len),
                                   self.max_model_len),
            block_layout=self.layout.describe(), pool_specs=tuple(self.kv.specs), dtype=self.dtype,
            device=self.device, threads=self.serving_threads or torch.get_num_threads(), decode_module=self.decode_module,
            model=self.model, pools=tuple(self.kv.tensors), forward_lock=self.forward_lock,
            decode_views=self.decode_views, buckets=tuple(self.buckets), runner_id=self.config.runner_id,
            build_lease_s=self.config.build_lease_s, layers=layers, speculative=self.config.speculative,
            num_draft_tokens=self.config.num_draft_tokens, verify_module=self.verify_module,
            int8_activations=self.int8_activations)

    def install_program(self, kind: str, program: Program | None) -> None:
        """Run ``kind`` steps (:data:`~runner_service.programs.spec.PROGRAM_KINDS`) through
        ``program``: decode (the compile contract, every batch bucket) or prefill (called like
        the family model's ``forward``, returning ``(logits,)``; at least 2 tokens per row, see
        :meth:`run_prefill`) or verify (called like :attr:`verify_module`, at least 2 tokens per
        row); ``None`` goes back to eager. Raises ``ValueError`` for another kind, or verify when
        not speculating."""
        if kind not in PROGRAM_KINDS:
            raise ValueError(f"program kind must be one of {PROGRAM_KINDS}, got {kind!r}")
        if kind == "verify" and self.verify_module is None:
            raise ValueError("no verify program: this runner does not speculate")
        setattr(self, f"{kind}_program", program)
        self.installs += 1
        self._computed_by[kind] = "eager" if program is None else f"{self.config.compile}#{self.installs}"

    def computed_by(self) -> str:
        """Names the code the steps run now, for the prefix cache
        (:attr:`runner_service.block_manager.BlockManager.computed_by`): which decode and which
        prefill (eager, or the ``n``-th program installed), the verify step's when speculating,
        and batch-invariant or not; ``""`` for eager stock kernels. Changes with every :meth:`install_program`."""
        if set(self._computed_by.values()) == {"eager"} and self.invariance is None:
            return ""
        return (";".join(f"{kind}={by}" for kind, by in self._computed_by.items())
                + (";batch-invariant" if self.invariance is not None else ""))

    def _probe_invariance(self) -> invariant.RowPolicy:
        """Probe the model's float matrices, one per distinct shape (:func:`invariant.probe_rows`),
        each up to the rows a step gives it and at most :data:`PROBE_MACS` multiply-adds a call."""
        max_rows = min(self.config.resolved_max_num_batched_tokens(self.max_model_len), self.max_model_len)
        seen: dict[tuple, tuple] = {}
        for w in self.model.linear_matrices():
            key = (tuple(w.shape), w.dtype)
            if key not in seen:
                n, k = w.shape
                rows = max(invariant.MIN_ROWS, min(max_rows, PROBE_MACS // (n * k)))
                seen[key] = (f"a [{n}, {k}] matrix", lambda x, w=w: linear(x, w), k, rows, w.dtype)
        return invariant.probe_rows(seen.values())

    def _kernels(self) -> contextlib.AbstractContextManager:
        """The batch-invariant kernels for an eager step (:attr:`invariance`), else nothing."""
        return contextlib.nullcontext() if self.invariance is None else invariant.batch_invariant(self.invariance)

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Eager decode over ``B`` rows (see the module docstring); returns logits [B, V] f32."""
        with self._kernels():
            out = self.decode_module(self.kv.tensors, input_ids, positions, slot_mapping, block_tables, seq_lens)
        return self._write_rows(out, slot_mapping)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One decode step over ``B`` rows through the installed program, else :meth:`decode_step`;
        returns logits [B, V] f32, the KV cache written.

        ``block_tables`` is a ``[:B, :nb]`` view of the persistent ``[max_num_seqs,
        max_blocks_per_seq]`` buffer (row stride ``max_blocks_per_seq``); a compiled program was
        built for contiguous inputs (AOTI does not check strides and would read the wrong entries;
        Dynamo would recompile), so it gets a copy (B * nb int64), made on every call so a compiled
        graph always sees the same kind of tensor (``[1, nb]`` views count as contiguous yet keep
        their row stride; a copy made under ``inference_mode`` is an inference tensor; Dynamo
        guards on both). The 1-D inputs are ``[:B]`` prefixes, contiguous already."""
        if self.decode_program is None:
            return self.decode_step(input_ids, positions, slot_mapping, block_tables, seq_lens)
        tables = block_tables.clone(memory_format=torch.contiguous_format)
        out = self.decode_program(self.kv.tensors, input_ids, positions, slot_mapping, tables, seq_lens)
        return self._write_rows(out, slot_mapping)

    def _write_rows(self, out: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor) -> torch.Tensor:
        """Write the cache rows of a decode module's (or program's) output ``(logits, *rows)``
        at ``slot_mapping`` [B] (or ``(logits, *rows, *slots)``, each pool at its own slots, for a
        model with :attr:`~model_families.family.FamilyModel.decode_row_slots`; one
        :func:`~model_families.kv_write.write_kv_rows` per pool; none when the module wrote in place)
        and return the logits [B, V]."""
        logits, *rows = out
        if rows:
            if self.model.decode_row_slots:  # (logits, *rows, *slots): each pool at its own slots
                n = len(rows) // 2
                slots = rows[n:]
                rows = rows[:n]
            else:
                slots = [slot_mapping] * len(rows)
            for pool, r, s in zip(self.kv.tensors, rows, slots, strict=True):
                write_kv_rows(pool, s, r)
        return logits

    def block_width(self, num_blocks: int) -> int:
        """Block-table width for a decode step whose largest table has ``num_blocks`` blocks:
        that count itself, within ``[1, max_blocks_per_seq]``. Every decode callable takes any
        width (eager; the AOTI program's width is a dynamic dim; ``inductor`` compiled its graphs
        for widths 1 and >= 2), and decode attention's work grows with the width, so padding it
        (to a power of two, as it once was) would only add masked keys."""
        return max(1, min(num_blocks, self.max_blocks_per_seq))

    def batch_bucket(self, n: int) -> int:
        """The batch bucket a decode step of ``n`` rows runs at (:func:`batch_buckets`)."""
        return _bucket(n, self.buckets)

    def decode_views(self, batch: int, num_blocks: int = 1) -> tuple[torch.Tensor, ...]:
        """The decode inputs of batch bucket ``batch`` over a block table ``num_blocks`` wide
        (:meth:`block_width`): views of the persistent buffers."""
        return self.buffers.views(batch, self.block_width(num_blocks))

    def warmup_plan(self) -> WarmupPlan:
        """What :meth:`warmup` runs so that the first requests run at steady speed: whatever
        costs more on its first call than later, for each program those requests use.

        - Decode: one step of bucket 1 pages every weight in and starts the thread pool, which is
          all eager mode and the single dynamic-shape AOTI program need (its first call at each
          other bucket and width costs what later calls do: measured, ``docs/benchmarks.md``).
          ``inductor`` specialises graphs per batch bucket and on a block-table width of 1 vs
          >= 2, so it runs every bucket at widths 1 and 2 (otherwise the first requests compile).
        - Prefill, when a compiled prefill is installed: one row of :data:`WARMUP_PREFILL_TOKENS`
          tokens (capped by the step's token budget and the context), over as many blocks as such
          a prompt holds: the program's first call initialises what later calls reuse (one
          dynamic-shape program: no per-length cost after it). Eager prefill has no first-call
          cost beyond decode's.
        - Verify, when a compiled verify is installed: one row of 2 tokens, for the same reason."""
        buckets = self.buckets
        if self.config.compile == "inductor":
            widths = sorted({1, min(2, self.max_blocks_per_seq)})
            decode = tuple((b, w) for b in buckets for w in widths)
        else:
            decode = ((buckets[0], 1),)
        prefill: tuple[tuple[int, int], ...] = ()
        if self.prefill_program is not None:
            budget = min(self.config.resolved_max_num_batched_tokens(self.max_model_len), self.max_model_len - 1)
            prefill = ((1, max(2, min(WARMUP_PREFILL_TOKENS, budget))),)
        verify = ((1, 2),) if self.verify_program is not None else ()
        return WarmupPlan(decode, prefill, verify)

    @torch.inference_mode()
    def warmup(self, plan: WarmupPlan) -> None:
        """Run ``plan``'s decode and prefill steps on padding rows: every slot they write is in
        the scratch block and every table entry is it, so no sequence's blocks are touched and
        no block is allocated; their logits are dropped."""
        with self.forward_lock:
            for batch, width in plan.decode:
                self.decode(*self.decode_views(batch, width))
            for rows, tokens in plan.prefill:
                self.prefill(*self._prefill_padding(rows, tokens, self.block_width(self.layout.blocks_needed(tokens))))
            for rows, tokens in plan.verify:
                self.verify(*self._prefill_padding(rows, tokens, 1)[:-1])
            synchronize(self.device)

    # -- steps -------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch, with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run ``batch``; returns the logits [n, V] float32 of its
        :meth:`ScheduledBatch.sampling_rows`, in that order ([n, S, V] for a speculative batch:
        :meth:`run_verify`). ``with_streams`` (the ``mtp`` drafter's need): a prefill eagerly
        through the model's ``forward_streams``, a decode batch as a verify step (drafts or not,
        :meth:`run_verify`), returning ``(logits, streams [B, S, ...])`` with the streams of
        every row of the batch, in its order."""
        with self.forward_lock:
            if batch.is_prefill:
                if with_streams:
                    logits, streams = self.run_prefill(batch, with_streams=True)
                    return logits[batch.sampling_rows()], streams
                return self.run_prefill(batch)[batch.sampling_rows()]
            if batch.is_speculative or with_streams:
                return self.run_verify(batch.seqs, with_streams=with_streams)
            return self.run_decode(batch.seqs)

    def _assign_rows(self, seqs: list[Sequence]) -> list[Sequence]:
        """Keep each sequence in its previous row; fill holes with the last rows (swap-remove)."""
        wanted = {id(s) for s in seqs}
        rows = list(self._rows)
        i = 0
        while i < len(rows):
            if id(rows[i]) in wanted:
                i += 1
            else:
                rows[i] = rows[-1]
                rows.pop()
        present = {id(s) for s in rows}
        rows.extend(s for s in seqs if id(s) not in present)
        self._rows = rows
        return rows

    @staticmethod
    def _row_order(rows: list[Sequence], seqs: list[Sequence]) -> list[int] | None:
        """The buffer row of each of ``seqs`` (``rows``: :meth:`_assign_rows`' order), or
        ``None`` when they are in row order (the common case: no gather needed)."""
        row_of = {id(s): i for i, s in enumerate(rows)}
        order = [row_of[id(s)] for s in seqs]
        return None if order == list(range(len(rows))) else order

    @torch.inference_mode()
    def run_decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Decode one token for each of ``seqs`` (each has a block for position
        ``num_tokens - 1``). Returns their logits [n, V] f32, in the order of ``seqs``."""
        rows = self._assign_rows(seqs)
        n = self.buffers.fill([s.last_token for s in rows], [s.num_tokens - 1 for s in rows],
                              [s.block_table for s in rows])
        order = self._row_order(rows, seqs)
        in_row_order = order is None
        if not in_row_order:
            self.buffers.order_logits(order)
        batch = _bucket(n, self.buckets)
        logits = self.decode(*self.decode_views(batch, self.buffers.max_active_blocks()))
        if in_row_order:  # the common case: no gathered copy of [n, V] float32
            return logits[:n]
        return logits.index_select(0, self.buffers.logits_indices[:n])

    @torch.inference_mode()
    def run_verify(self, seqs: list[Sequence], with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Verify each of ``seqs``' draft tokens (``seq.draft_token_ids``, ``k_i`` of them; it
        has blocks for position ``num_tokens - 1 + k_i``): one step of its last token and its
        drafts through the family model's ``verify`` step (:attr:`~model_families.family.ModelFamily.speculative_methods`),
        the inputs in the persistent buffers (:meth:`DecodeBuffers.fill_verify`, the rows kept
        as in decode). Returns logits [n, S, V] f32 in the order of ``seqs``, ``S = 1 +
        max(k_i)``; position ``j`` of row ``i`` predicts the token after its ``j``-th draft.
        ``with_streams`` (a verify module built with them, ``--speculative mtp``): ``(logits,
        streams [n, S, ...])``. ``ValueError`` when ``with_streams`` disagrees with the module."""
        if with_streams != self.verify_module.with_streams:
            raise ValueError(f"this runner's verify step {'returns' if with_streams else 'does not return'} "
                             "the residual streams; with_streams must match it")
        rows = self._assign_rows(seqs)
        self.buffers.fill_verify([s.last_token for s in rows], [s.num_tokens - 1 for s in rows],
                                 [s.block_table for s in rows], [s.draft_token_ids for s in rows])
        out = self.verify_outputs(*self.buffers.verify_views())
        order = self._row_order(rows, seqs)
        out = out if order is None else tuple(t[order] for t in out)
        return out if with_streams else out[0]

    def verify(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One verify step (:class:`~model_families.family.VerifyStep`'s inputs, ``S`` tokens a
        row) through the installed program where ``S >= 2``, else eagerly; returns logits
        [B, S, V] f32, the KV cache written at every position."""
        return self.verify_outputs(input_ids, positions, slot_mapping, block_tables, seq_lens)[0]

    def verify_outputs(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`verify` returning every output of the verify step: ``(logits,)``, or
        ``(logits, streams)`` for a module built with the streams."""
        if self.verify_program is None or input_ids.shape[1] < 2:
            with self._kernels():
                return self.verify_module(self.kv.tensors, input_ids, positions, slot_mapping, block_tables, seq_lens)
        tables = block_tables.clone(memory_format=torch.contiguous_format)  # as decode: see :meth:`decode`
        return tuple(self.verify_program(self.kv.tensors, input_ids, positions, slot_mapping, tables, seq_lens))

    @torch.inference_mode()
    def run_prefill(self, batch: ScheduledBatch, with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Compute each sequence's chunk ``[start, start + n)``; returns logits [len(batch), V]
        f32 at each chunk's last token (meaningful for the :meth:`ScheduledBatch.sampling_rows`).
        Rows are padded to the longest chunk (padding tokens write the scratch block); for the
        compiled prefill to at least 2 tokens (its token dim is dynamic from 2: export
        specialises a size of 1). ``with_streams``: eagerly through the model's
        ``forward_streams``, returning ``(logits, streams [len(batch), S, ...])``."""
        B, S = len(batch), max(batch.num_tokens)
        nb = max(len(s.block_table) for s in batch.seqs)
        ids, pos, slots, tables, lens, last = self._prefill_padding(B, S, nb)
        for i, (seq, st, n) in enumerate(zip(batch.seqs, batch.starts, batch.num_tokens, strict=True)):
            ids[i, :n] = torch.tensor(seq.token_ids[st:st + n])
            p = torch.arange(st, st + n)
            pos[i, :n] = p
            bt = torch.tensor(seq.block_table, dtype=torch.int64)
            tables[i, : len(seq.block_table)] = bt
            slots[i, :n] = self.layout.slots(bt, p)
            lens[i], last[i] = st + n, n - 1
        if with_streams:
            with self._kernels():
                return self.model.forward_streams(self.kv.tensors, *(t.to(self.device) for t in
                                                                   (ids, pos, slots, tables, lens, last)))
        return self.prefill(ids, pos, slots, tables, lens, last)

    def _prefill_padding(self, rows: int, tokens: int, blocks: int) -> list[torch.Tensor]:
        """Host prefill inputs ``[ids, pos, slots [rows, S], tables [rows, blocks], lens, last
        [rows]]`` of padding rows: every token id and position 0, every slot in the scratch
        block, every table entry the scratch block, ``lens`` 1, ``last`` 0. ``S`` is ``tokens``,
        at least 2 when the prefill is compiled (see :meth:`run_prefill`)."""
        S = max(tokens, 2) if self.prefill_program is not None else tokens
        grid = torch.zeros((rows, S), dtype=torch.int64)
        return [grid, grid.clone(), torch.full((rows, S), SCRATCH_BLOCK * self.block_size, dtype=torch.int64),
                torch.full((rows, blocks), SCRATCH_BLOCK, dtype=torch.int64), torch.ones(rows, dtype=torch.int64),
                torch.zeros(rows, dtype=torch.int64)]

    def prefill(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One prefill step over host ``inputs`` (the family ``forward``'s, without the caches),
        through the installed program or eagerly; returns logits [B, V] f32 at ``last``."""
        dev = self.device
        inputs = tuple(t.to(dev) for t in inputs)
        if self.prefill_program is not None:
            return self.prefill_program(self.kv.tensors, *inputs)[0]
        with self._kernels():
            return self.model(self.kv.tensors, *inputs)

    def close(self) -> None:
        """Drop the decode buffers, their block-table cache, the installed programs and the
        prepacked matrices together."""
        self._rows = []
        self.buffers.close()
        self.decode_program = self.prefill_program = self.verify_program = None
        self.packed.close()
