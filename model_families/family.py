"""The model-family contract: everything the packer, the runner, the compiled programs and the
program fingerprint need to know about one architecture family, and nothing else knows.

A family (``model_families/<name>/``) provides one :class:`ModelFamily` object:

============================  ==================================================================
part                          methods
============================  ==================================================================
config (one schema)           :attr:`~ModelFamily.config_class`, :meth:`~ModelFamily.config_from_hf`
                              (HF ``config.json`` semantics; the GGUF reader translates its
                              metadata to the same dict), :meth:`~ModelFamily.config_from_dict`
                              (the sidecar's stored ``config.json``)
pack spec (sidecar layout)    :meth:`~ModelFamily.tensor_specs` (the ONE statement of the
                              layout, per weights dtype), :meth:`~ModelFamily.global_tensors`,
                              :meth:`~ModelFamily.layer_tensors`, :attr:`~ModelFamily.pack_version`,
                              :attr:`~ModelFamily.weights_dtypes`; optional:
                              :meth:`~ModelFamily.stack_index` (stacks over a subset of the
                              layers), :meth:`~ModelFamily.layout_facts` (fingerprinted config
                              facts)
weights                       :meth:`~ModelFamily.load_weights` (checked against
                              :meth:`~ModelFamily.tensor_specs`), :meth:`~ModelFamily.random_weights`
KV-cache layout               :meth:`~ModelFamily.cache_specs`: the block pools a model owns;
                              :attr:`~ModelFamily.supports_prefix_caching` (may full blocks be
                              shared across requests by their token history)
forward                       :meth:`~ModelFamily.build_model` -> a :class:`FamilyModel` (prefill
                              and decode are one ``forward``; :meth:`FamilyModel.decode` may
                              return a decode step's cache rows instead of writing them)
decode program                :meth:`~ModelFamily.decode_module` (what AOTInductor compiles and
                              what eager decode calls: one function) and
                              :meth:`~ModelFamily.program_sources` (the code in its fingerprint)
============================  ==================================================================

The step contract every :class:`FamilyModel` implements (B rows, S tokens per row, nb blocks per
row; every integer tensor int64)::

    forward(caches, input_ids[B, S], positions[B, S], slot_mapping[B, S], block_tables[B, nb],
            seq_lens[B], last_index[B]) -> logits[B, V] float32

``caches`` is the tuple of block pools in :meth:`ModelFamily.cache_specs` order, each
``[layers, num_blocks, *block_shape]``, mutated in place. The decode step (one token per row)
is :meth:`FamilyModel.decode`::

    decode(caches, input_ids[B], positions[B], slot_mapping[B], block_tables[B, nb], seq_lens[B])
        -> (logits[B, V] float32, *rows)

where ``rows`` is empty (the step wrote its cache entries in place, the default) or holds one
``[layers, B, *row_shape]`` tensor per pool: the entries the step would write at
``slot_mapping`` (or, with :attr:`FamilyModel.decode_row_slots`, at the per-pool ``[B]`` slot
tensors returned after the rows), which the runner then writes for all layers at once
(:func:`model_families.kv_write.write_kv_rows`). A decode that returns its rows only reads the pools,
so its compiled program has no in-place writes (no custom-op call back into Python per layer).
Slot ``s`` of a pool is row
``s % block_size`` of block ``s // block_size``; block 0 is the runner's scratch block (padding
rows write there and padding block-table entries point at it).

Weights dtypes (:data:`model_families.dtypes.WEIGHTS_DTYPES`): the sidecar of a float dtype (``f32``, ``bf16``) holds
every tensor in it; a quantized one (``int8``, ``int4``) holds the matrices the family chooses as
weight-only quantized parts (``NAME.qweight``, ``NAME.scales``, ``NAME.zeros``: the formats of
:mod:`model_families.quant`) and the rest in the float dtypes its layout states (Llama:
bfloat16 token tables, float32 norms and biases). Which dtypes a family packs is
:attr:`ModelFamily.weights_dtypes`; a family that states only a float layout
(:meth:`ModelFamily.tensor_shapes`) packs ``f32`` and ``bf16``.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from types import ModuleType
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from model_families import quant
from model_families.block_layout import BlockLayout
from model_families.quantized_weights import QuantizedWeight
from services.errors import InvalidArgument

#: The float weights dtypes and their torch dtypes.
FLOAT_WEIGHTS: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class TensorSpec:
    """One sidecar tensor: full shape and dtype (float32, bfloat16, uint8 or int8)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def float_specs(shapes: Mapping[str, tuple[int, ...]], weights_dtype: str) -> dict[str, TensorSpec]:
    """Every tensor of a float layout in the float ``weights_dtype``."""
    dtype = FLOAT_WEIGHTS[weights_dtype]
    return {name: TensorSpec(tuple(shape), dtype) for name, shape in shapes.items()}


def quantized_specs(name: str, shape: tuple[int, ...], fmt: str) -> dict[str, TensorSpec]:
    """The parts of the float matrix ``name`` ``[..., N, K]`` stored as ``fmt`` (``int4`` /
    ``int8``, :mod:`model_families.quant`); ``InvalidArgument`` when the shape does not fit."""
    return {n: TensorSpec(s, d) for n, (s, d) in quant.part_specs(name, tuple(shape), fmt).items()}


class Checkpoint(Protocol):
    """What a pack spec reads from: a checkpoint under Hugging Face tensor names in HF layout
    (``[out, in]`` matrices, q/k rows in HF rotary order), whatever its file format.

    ``tensor`` returns a float32 / bfloat16 / float16 CPU tensor and raises ``InvalidArgument``
    for a name the checkpoint lacks; ``has`` says whether it holds a name; ``config`` is the
    family config the reader built (:meth:`ModelFamily.config_from_hf`). A reader whose format
    stores int4 groups (GGUF Q4_0/Q4_1) may also offer ``int4_groups(name)`` ->
    :class:`model_families.quant.Int4Groups` or ``None``: the exact codes, scales and zeros,
    in HF layout (see :func:`model_families.quant.checkpoint_parts`).
    """

    config: FamilyConfig

    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class FamilyConfig:
    """Base of a family's architecture config: a frozen dataclass whose fields are the sidecar's
    ``config.json`` keys (Hugging Face names and semantics). Subclasses validate in
    ``__post_init__`` (raising ``InvalidArgument``) and must define ``vocab_size``,
    ``max_position_embeddings``, ``num_hidden_layers`` and ``architecture`` fields (the
    engine's generic needs); an ``eos_token_id`` field, if any, gives :attr:`eos_token_ids`."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict with exactly the dataclass fields."""
        return asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): stable across runs, fit for a fingerprint."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The kind of each layer where a family has several (a ``layer_types`` field, HF's
        name for it); empty when every layer is alike."""
        return tuple(getattr(self, "layer_types", ()) or ())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the ``eos_token_id`` field as a tuple (HF allows an
        int, a list of ints or ``None``); empty when the model has none."""
        eos = getattr(self, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (int(eos),)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FamilyConfig:
        """Build from a dict with this class's keys: fields without a default are required, extra
        keys are ignored. Raises ``InvalidArgument`` when a required key is missing or a value is
        invalid."""
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise InvalidArgument(f"model config lacks {', '.join(repr(n) for n in missing)}")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except InvalidArgument:
            raise
        except (TypeError, ValueError, KeyError) as e:
            raise InvalidArgument(f"model config has a bad value: {e}") from e



def check_positive_int(name: str, value: Any) -> None:
    """Raise ``InvalidArgument`` naming ``name`` unless ``value`` is a positive ``int`` (bools
    excluded)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"model config {name} must be a positive integer, got {value!r}")


def check_positive_ints(config: FamilyConfig, names: tuple[str, ...]) -> None:
    """:func:`check_positive_int` for every field of ``config`` in ``names``."""
    for name in names:
        check_positive_int(name, getattr(config, name))


@dataclass(frozen=True)
class CacheSpec:
    """One block pool of the KV cache: a tensor ``[layers, num_blocks, *block_shape]`` in the
    compute dtype, zero-initialised. ``block_shape`` includes the block's token dim (e.g. Llama's
    K pool: ``(block_size, num_key_value_heads, head_dim)``). A family with no per-token state
    declares no pools."""

    name: str
    layers: int
    block_shape: tuple[int, ...]

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """Bytes one block of this pool takes across its layers."""
        return self.layers * math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()


class FamilyWeights:
    """Mixin for a family's weights dataclass: tensor fields (``None`` allowed for optional
    ones) or weight-only quantized matrices (:class:`model_families.quantized_weights.QuantizedWeight`).
    Weights that are one object (a tied head) stay one object through :meth:`to`."""

    def entries(self) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Field name -> tensor or quantized weight, ``None`` fields left out."""
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}  # type: ignore[arg-type]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor, ``None`` fields left out, a quantized weight's tensors as
        ``field.buffer``, shared tensors listed under each name."""
        out = {}
        for name, w in self.entries().items():
            if isinstance(w, QuantizedWeight):
                out.update({f"{name}.{part}": t for part, t in w.tensors().items()})
            else:
                out[name] = w
        return out

    def to(self, dtype: torch.dtype, device: torch.device) -> FamilyWeights:
        """A copy with float tensors in ``dtype`` on ``device`` (``self`` when they already
        are); quantized weights keep their codes and convert their scales
        (:meth:`~model_families.quantized_weights.QuantizedWeight.converted`); weights that were one object
        stay one object."""
        items = self.entries()
        if self.dtype == dtype and all(t.device == device for t in self.tensors().values()):
            return self
        done: dict[int, torch.Tensor | QuantizedWeight] = {}
        out = {}
        for name, w in items.items():
            if id(w) not in done:
                done[id(w)] = (w.converted(dtype, device) if isinstance(w, QuantizedWeight)
                               else w.to(device=device, dtype=dtype))
            out[name] = done[id(w)]
        return type(self)(**out)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the float tensors (all share it; a quantized weight's
        scales included)."""
        return next(t.dtype for t in self.tensors().values() if t.is_floating_point())

    @property
    def quantization(self) -> str:
        """``"int4"`` when some weight is int4, else ``"int8"`` when some is int8, else ``""``."""
        formats = {w.format for w in self.entries().values() if isinstance(w, QuantizedWeight)}
        return next((f for f in ("int4", "int8") if f in formats), "")

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    def nbytes(self) -> int:
        """Bytes of distinct weight storage (a tied head counts once)."""
        seen, total = set(), 0
        for t in self.tensors().values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


class FamilyModel(nn.Module, ABC):
    """A family's model, built by :meth:`ModelFamily.build_model`: weights and derived tables
    (RoPE, ...) are registered as non-persistent buffers (the runner's tensors, not copies), so
    an exported program receives them as constants. ``forward`` follows the step contract in the
    module docstring."""

    config: FamilyConfig
    #: Whether :meth:`decode`'s rows come with their own slots: ``(logits, *rows, *slots)``,
    #: one ``[B]`` int64 slot tensor per pool after the rows (a family whose pools are written at
    #: different slots, e.g. a ring and compressed entries); else rows go at ``slot_mapping``.
    decode_row_slots: ClassVar[bool] = False

    @abstractmethod
    def forward(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                last_index: torch.Tensor) -> torch.Tensor:
        """One step over a padded batch (the step contract in the module docstring): writes the
        step's K/V (or whatever the pools hold) in place and returns logits [B, V] float32."""

    def decode(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
        """One decode step (the decode contract in the module docstring): ``(logits,)`` after
        writing in place, or ``(logits, *rows)`` with one ``[layers, B, *row_shape]`` tensor
        per pool for the caller to write. Default: :meth:`forward` on ``S = 1``, in place."""
        logits = self(caches, input_ids[:, None], positions[:, None], slot_mapping[:, None], block_tables,
                      seq_lens, torch.zeros_like(input_ids))
        return (logits,)

    def can_loop_layers(self) -> bool:
        """Whether an exported step can run the layers as one loop (:meth:`loop_layers`): a
        program that compiles in a fraction of the unrolled one's time. Default: no."""
        return False

    def loop_layers(self, on: bool) -> None:
        """Export the layers as one loop (``on``) or unrolled from now on; eager steps never
        loop. Raises ``ValueError`` for ``on`` when :meth:`can_loop_layers` is false."""
        if on:
            raise ValueError(f"{type(self).__name__} cannot export its layers as a loop")

    def linear_matrices(self) -> list[torch.Tensor]:
        """The float ``[N, K]`` matrices its matmuls pass to :func:`model_families.linear.linear`
        (layer views of stacked tensors included), for the runner to prepack once at load
        (:class:`model_families.prepack.PackedMatrices`). Default: none (plain matmuls)."""
        return []


class DecodeStep(nn.Module):
    """One decode step (one token per row) of a :class:`FamilyModel`
    (:meth:`FamilyModel.decode`): the function eager decode calls and the module AOTInductor
    compiles, so the two cannot drift::

        forward(caches, input_ids[B], positions[B], slot_mapping[B], block_tables[B, nb],
                seq_lens[B]) -> (logits[B, V] float32, *rows)
    """

    def __init__(self, model: FamilyModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        return self.model.decode(caches, input_ids, positions, slot_mapping, block_tables, seq_lens)


class VerifyStep(DecodeStep):
    """The verify step of speculative decoding (``1 + k`` tokens per row, the last token then
    the drafts) of a :class:`FamilyModel` whose family lists a
    :attr:`ModelFamily.speculative_methods`: the function eager verify calls and the module
    AOTInductor compiles::

        forward(caches, input_ids[B, S], positions[B, S], slot_mapping[B, S], block_tables[B, nb],
                seq_lens[B]) -> (logits[B, S, V] float32,)

    With ``with_streams`` (a drafter that reads the main model's residual streams: MTP) it is
    the model's ``streams`` step instead, ``-> (logits[B, S, V] float32, streams[B, S, ...])``
    (the family's shape and the model's dtype). The caches are written in place (every position,
    drafts included). A :class:`DecodeStep` over the same model, for its other step.
    """

    def __init__(self, model: FamilyModel, with_streams: bool = False) -> None:
        super().__init__(model)
        self.with_streams = with_streams

    def forward(self, caches: tuple[torch.Tensor, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        if self.with_streams:
            return tuple(self.model.streams(caches, input_ids, positions, slot_mapping, block_tables, seq_lens))
        return (self.model.verify(caches, input_ids, positions, slot_mapping, block_tables, seq_lens),)


class ModelFamily(ABC):
    """One architecture family (see the module docstring for the parts).

    Class attributes: ``name`` (the sidecar's ``warmserve.family``, e.g. ``"llama"``),
    ``architectures`` (HF architecture names it serves), ``pack_version`` (changes whenever the
    sidecar layout changes: it enters the sidecar fingerprint, so older sidecars become stale),
    ``config_class`` (a :class:`FamilyConfig` subclass), ``weights_dtypes`` (the sidecar weights
    dtypes it packs, a subset of :data:`~model_families.dtypes.WEIGHTS_DTYPES`; float-only by default),
    ``stacked_prefixes`` (names whose first dim is a stack index; ``("layers.",)`` by default).

    ``supports_prefix_caching`` (default ``True``): the runner may reuse a full KV block across
    requests whose token histories agree up to the block's end (automatic prefix caching,
    :mod:`runner_service.block_manager`). True when a block's content in every pool depends only
    on the tokens up to the block's end and their positions (Llama: K/V of each token). A family
    whose blocks hold state that depends on anything else (rolling or compressed state updated
    by later tokens, per-request inputs) sets it ``False``; the engine then never shares blocks.
    """

    name: ClassVar[str]
    architectures: ClassVar[frozenset[str]]
    pack_version: ClassVar[str]
    config_class: ClassVar[type[FamilyConfig]]
    weights_dtypes: ClassVar[tuple[str, ...]] = ("f32", "bf16")
    supports_prefix_caching: ClassVar[bool] = True
    #: Whether the runner's batch-invariant mode (:mod:`model_families.invariant`) covers every
    #: kernel of this family's steps (its matmuls through :func:`~model_families.linear.linear`,
    #: attention through :func:`~model_families.attention.paged_attention`, activations through
    #: the invariant ones); the engine refuses the mode for a family that does not declare it.
    supports_batch_invariance: ClassVar[bool] = False
    #: Whether ``aoti`` mode also compiles the prefill step (the model's ``forward`` over a
    #: dynamic token count); ``False`` keeps prefill eager and compiles decode only.
    compiled_prefill: ClassVar[bool] = True
    #: Whether ``aoti`` mode compiles the speculative verify step while speculating (at most
    #: ``1 + K`` tokens a row, so it exports where a long prefill chunk may not).
    compiled_verify: ClassVar[bool] = True
    #: The ``--speculative`` methods (:data:`runner_service.options.SPECULATIVE_METHODS`, not
    #: ``off``) the runner may use with this family. A family that lists one gives its model a
    #: ``verify(caches, input_ids [B, S], positions, slot_mapping [B, S], block_tables, seq_lens)
    #: -> logits [B, S, V] float32`` step (``forward``'s inputs without ``last_index``, the cache
    #: written in place, every position's logits; e.g. ``LlamaModel.verify``) after which
    #: rejected drafts leave nothing read in its caches. ``mtp`` also needs ``streams`` (as
    #: ``verify``, returning ``(logits, residual streams [B, S, ...])``), ``forward_streams``
    #: (``forward``'s inputs, returning ``(logits [B, V], streams)``) and ``mtp`` (the block step,
    #: :mod:`runner_service.mtp`), and its pools in :meth:`draft_cache_specs`. Default: none.
    speculative_methods: ClassVar[tuple[str, ...]] = ()
    #: Prefixes of the stacked tensor names (first dim a stack index, see :meth:`stack_index`).
    stacked_prefixes: ClassVar[tuple[str, ...]] = ("layers.",)

    # -- config ----------------------------------------------------------------------------

    @abstractmethod
    def config_from_hf(self, hf: Mapping[str, Any], has_tensor: Callable[[str], bool] = lambda _n: False
                       ) -> FamilyConfig:
        """The config from an HF ``config.json`` dict (``architectures`` list or our
        ``architecture`` key); ``has_tensor`` answers whether the checkpoint holds a tensor name
        (for facts a config may leave out, such as biases). Raises ``InvalidArgument``."""

    def config_from_dict(self, data: Mapping[str, Any]) -> FamilyConfig:
        """The config from the sidecar's own ``config.json`` (this family's schema)."""
        return self.config_class.from_dict(data)

    # -- pack spec -------------------------------------------------------------------------

    @abstractmethod
    def tensor_shapes(self, config: FamilyConfig) -> dict[str, tuple[int, ...]]:
        """The float layout: every sidecar tensor name to its full shape; stacked ones lead with
        the layer count and are named ``layers.*``."""

    def tensor_specs(self, config: FamilyConfig, weights_dtype: str) -> dict[str, TensorSpec]:
        """Every sidecar tensor name to its shape and dtype in a ``weights_dtype`` sidecar. The
        one statement of the layout: the packer writes it, the sidecar validator checks it and
        :meth:`load_weights` reads it. Default (a float-only family): :meth:`tensor_shapes` in
        the float dtype. Raises ``InvalidArgument`` for a dtype the family does not pack (or a
        config it cannot pack in it)."""
        self.check_weights_dtype(weights_dtype)
        return float_specs(self.tensor_shapes(config), weights_dtype)

    def check_weights_dtype(self, weights_dtype: str) -> str:
        """``weights_dtype`` if this family packs it, else ``InvalidArgument``."""
        if weights_dtype not in self.weights_dtypes:
            raise InvalidArgument(f"the {self.name} family packs weights dtypes {', '.join(self.weights_dtypes)}, "
                                  f"not {weights_dtype!r}")
        return weights_dtype

    def stacked_names(self, config: FamilyConfig, weights_dtype: str = "f32") -> list[str]:
        """The names whose first dim is a stack index (names starting with one of
        :attr:`stacked_prefixes`; which slice a layer fills is :meth:`stack_index`)."""
        return [n for n in self.tensor_specs(config, weights_dtype) if n.startswith(self.stacked_prefixes)]

    def stack_index(self, config: FamilyConfig, name: str, layer: int) -> int:
        """The slice of the stacked tensor ``name`` (:meth:`stacked_names`) that
        :meth:`layer_tensors` ``(ckpt, layer)`` fills: the packer writes that layer's value at
        ``[stack_index(config, name, layer)]``. Default: ``layer`` (every stacked tensor has one
        slice per layer). A family that stacks some tensors over a subset of the layers (say, the
        layers of one kind) returns the layer's rank in that subset."""
        return layer

    def layout_facts(self, config: FamilyConfig) -> dict[str, Any]:
        """Config facts the sidecar layout depends on beyond its tensor names and shapes (which
        layer fills which slice, window sizes, ...), as a JSON-able dict. When non-empty, its
        canonical JSON enters the sidecar fingerprint and the metadata
        (``warmserve.layout_facts``), and validation reports a sidecar stale when the stored facts
        differ from what its config implies. Default: none (``{}``, fingerprint unchanged)."""
        return {}

    @abstractmethod
    def global_tensors(self, ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        """The tensors that are not per layer, at their full shapes, for a ``weights_dtype``
        sidecar (float tensors in any float dtype: the packer casts them; quantized parts in
        their stored dtype)."""

    @abstractmethod
    def layer_tensors(self, ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        """Layer ``layer``'s slice of each stacked tensor (its shape without the leading dim),
        as :meth:`global_tensors`."""

    # -- runner ----------------------------------------------------------------------------

    @abstractmethod
    def load_weights(self, config: FamilyConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, weights_dtype: str = "f32") -> FamilyWeights:
        """The runner's weights, computing in ``dtype``, from the tensors of a ``weights_dtype``
        sidecar (float tensors zero-copy when dtype and device match; quantized matrices built
        once for the kernels, :func:`model_families.quantized_weights.quantized_weight`). Raises
        ``InvalidArgument`` for a missing name or a shape that differs from
        :meth:`tensor_specs`."""

    def random_weights(self, config: FamilyConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                       device: torch.device | str = "cpu", weights_dtype: str = "f32") -> FamilyWeights:
        """Random weights (normal, std 0.02; ``*norm`` tensors near 1) in the sidecar layout of
        ``weights_dtype`` (quantized ones by the rules of :mod:`model_families.quant`), for
        tests of the serving path."""
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape in self.tensor_shapes(config).items():
            t = torch.randn(shape, generator=g)
            tensors[name] = 1.0 + 0.1 * t if name.endswith("norm") else 0.02 * t
        specs = self.tensor_specs(config, weights_dtype)
        for name in [n for n in tensors if n not in specs]:  # stored quantized: NAME.qweight, ...
            fmt = "int4" if f"{name}.zeros" in specs else "int8"
            tensors.update({f"{name}.{part}": t for part, t in quant.quantize_parts(tensors.pop(name), fmt).items()})
        return self.load_weights(config, tensors, dtype, torch.device(device), weights_dtype)

    @abstractmethod
    def cache_specs(self, config: FamilyConfig, block_size: int) -> tuple[CacheSpec, ...]:
        """The KV-cache block pools this family's model reads and writes (possibly none)."""

    def draft_cache_specs(self, config: FamilyConfig, block_size: int, method: str) -> tuple[CacheSpec, ...]:
        """The block pools speculative method ``method`` keeps beside :meth:`cache_specs` (the
        same block ids and table; e.g. an MTP block's window ring). Default: none."""
        return ()

    def block_layout(self, config: FamilyConfig, block_size: int, max_model_len: int,
                     draft_tokens: int = 0) -> BlockLayout:
        """Where a sequence's tokens live in its block table (how many blocks ``n`` tokens
        hold, the slot of a position): the block manager, the decode buffers and the prefill
        batcher all ask it. ``draft_tokens``: the most speculative draft tokens a verify step
        writes past a sequence's length (a layout that reuses slots keeps room for them; the same
        value :meth:`build_model` gets; passed only by a speculating runner, so a family that
        lists no :attr:`speculative_methods` need not take it). Default: the paged layout, one block per ``block_size``
        tokens (:class:`model_families.block_layout.BlockLayout`)."""
        return BlockLayout(block_size)

    @abstractmethod
    def build_model(self, config: FamilyConfig, weights: FamilyWeights, max_model_len: int,
                    draft_tokens: int = 0) -> FamilyModel:
        """The model over ``weights`` (no copies) for contexts up to ``max_model_len`` tokens;
        ``draft_tokens`` as in :meth:`block_layout`."""

    def decode_module(self, model: FamilyModel) -> nn.Module:
        """The decode step module (eager and compiled). Default: :class:`DecodeStep`."""
        return DecodeStep(model)

    @abstractmethod
    def program_sources(self) -> list[ModuleType]:
        """Modules whose code is traced into the decode program; their canonical AST enters the
        program fingerprint, so an edit to any of them invalidates cached programs."""
