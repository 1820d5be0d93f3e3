"""What one runner's compiled programs are built for and from: :class:`ProgramSpec`
(``docs/architecture.md`` §9)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_families.family import CacheSpec, ModelFamily
from runner_service.options import COMPILE_MODES

#: The compiling modes of :data:`runner_service.options.COMPILE_MODES` (all but ``off``).
MODES = tuple(m for m in COMPILE_MODES if m != "off")
#: The programs a runner can install: ``decode`` (every mode), ``prefill`` (AOTI only, for a
#: family with :attr:`~model_families.family.ModelFamily.compiled_prefill`) and ``verify`` (the
#: speculative verify step: AOTI only, for a family with ``compiled_verify``, while speculating;
#: with a method of :data:`~runner_service.options.STREAMS_METHODS` it returns the streams too).
PROGRAM_KINDS = ("decode", "prefill", "verify")
#: How a program holds the model's layers: ``loop`` (the layer body once, looped over the stacked
#: weights: compiles in a fraction of the time, for a family that can,
#: :meth:`~model_families.family.FamilyModel.can_loop_layers`) or ``unrolled`` (the faster step).
#: A cold runner installs the loop programs first, then the unrolled ones (``docs/architecture.md`` §9).
PROGRAM_LAYERS = ("loop", "unrolled")
#: The fewest layers for which a runner builds the loop form first: the unrolled compile grows
#: with the layer count, the loop's does not, and below this the loop saves less than it costs.
LOOP_MIN_LAYERS = 8


@dataclass(frozen=True)
class ProgramSpec:
    """One runner's programs, as :meth:`runner_service.model_runner.ModelRunner.program_spec`
    builds it (at the moment of the call: ``threads`` is the calling thread's torch thread count).

    Key facts: ``family`` and its ``config`` (JSON-able), ``mode`` (``--compile``), the layout
    (``block_size``, ``max_model_len`` in tokens, ``max_num_seqs``, ``max_blocks_per_seq``,
    ``max_prefill_tokens`` per row, ``block_layout`` from
    :meth:`~model_families.block_layout.BlockLayout.describe`, the KV ``pool_specs``), ``dtype``,
    ``device``, ``threads``; the weights' dtypes come from the modules' buffers (:meth:`constants`).
    What they are compiled from: ``decode_module`` and ``model`` (the family model, for prefill),
    the KV ``pools`` (tensors ``[layers, NB, *block_shape]``, program inputs), ``forward_lock``
    (held while tracing), ``decode_views(batch, width)`` (the runner's persistent decode inputs)
    and the batch ``buckets``. Who builds: ``runner_id``, holding a ``build_lease_s``-second lease.
    ``layers``: the form of the programs (:data:`PROGRAM_LAYERS`, in the key); ``ValueError`` for
    another, or for ``loop`` where the model cannot loop. Speculative decoding: ``speculative``
    (the ``--speculative`` method), ``num_draft_tokens`` (``K``: a verify step takes up to
    ``1 + K`` tokens a row; 0 when off) and ``verify_module``
    (:class:`~model_families.family.VerifyStep`, ``None`` when off). ``int8_activations``: the
    quantized matrices are multiplied by int8 activations (``--quantized-activations``, in the key).
    """

    family: ModelFamily
    config: dict[str, Any]
    mode: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_blocks_per_seq: int
    max_prefill_tokens: int
    block_layout: dict[str, Any]
    pool_specs: tuple[CacheSpec, ...]
    dtype: torch.dtype
    device: torch.device
    threads: int
    decode_module: nn.Module
    model: nn.Module
    pools: tuple[torch.Tensor, ...]
    forward_lock: threading.Lock
    decode_views: Callable[[int, int], tuple[torch.Tensor, ...]]
    buckets: tuple[int, ...]
    runner_id: str = "runner-0"
    build_lease_s: float = 30.0
    layers: str = "unrolled"
    speculative: str = "off"
    num_draft_tokens: int = 0
    verify_module: nn.Module | None = None
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.layers not in PROGRAM_LAYERS:
            raise ValueError(f"program layers must be one of {PROGRAM_LAYERS}, got {self.layers!r}")
        if self.layers == "loop" and not self.model.can_loop_layers():
            raise ValueError(f"the {self.family.name} model cannot export its layers as a loop")

    def forms(self) -> tuple[str, ...]:
        """The :data:`PROGRAM_LAYERS` forms a runner of this spec installs, in order: ``loop``
        then ``unrolled`` in ``aoti`` mode where the model can loop and has at least
        :data:`LOOP_MIN_LAYERS` layers, else ``unrolled`` only."""
        layers = max((s.layers for s in self.pool_specs), default=0)
        tiered = self.mode == "aoti" and layers >= LOOP_MIN_LAYERS and self.model.can_loop_layers()
        return PROGRAM_LAYERS if tiered else ("unrolled",)

    def kinds(self) -> tuple[str, ...]:
        """The :data:`PROGRAM_KINDS` a runner of this spec installs, in order: ``decode``; in
        ``aoti`` mode ``prefill`` where the family compiles it, and ``verify`` where it compiles
        that, while speculating (for a method of ``STREAMS_METHODS`` the verify program returns
        the residual streams too). The other steps run eager."""
        if self.mode != "aoti":
            return ("decode",)
        kinds = ["decode"]
        if self.family.compiled_prefill:
            kinds.append("prefill")
        if self.verify_module is not None and self.family.compiled_verify:
            kinds.append("verify")
        return tuple(kinds)

    def module(self, kind: str) -> nn.Module:
        """The module compiled for ``kind`` (:data:`PROGRAM_KINDS`): the decode module, the
        family model (prefill) or the verify module. Raises ``ValueError`` for ``verify`` when
        not speculating."""
        if kind == "verify":
            if self.verify_module is None:
                raise ValueError("no verify program: this runner does not speculate")
            return self.verify_module
        return self.decode_module if kind == "decode" else self.model

    def constants(self, kind: str) -> dict[str, torch.Tensor]:
        """:func:`module_constants` of the ``kind`` module."""
        return module_constants(self.module(kind))


def module_constants(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffer name -> tensor of ``module``, duplicates (a tied head) included: what AOTInductor
    asks for. The buffers *are* the runner's tensors (no copy)."""
    return dict(module.named_buffers(remove_duplicate=False))
