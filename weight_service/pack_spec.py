"""Pack specs: how a model family's checkpoint becomes the runner's tensor layout.

A :class:`PackSpec` names every tensor of the sidecar and its shape (from the config alone, so
the name set and the file header are known before any weight is read), and produces the values:
the global tensors once, and each per-layer tensor layer by layer (stacked on disk as
``[num_layers, ...]``). The registry maps family names and HF architectures to specs; DeepSeek V4
is added by writing ``specs/deepseek_v4.py`` and listing it in :func:`_specs`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch

from services.errors import InvalidArgument
from weight_service.checkpoint import Checkpoint
from weight_service.model_config import ModelConfig


class PackSpec(ABC):
    """One family's sidecar layout.

    ``name`` is the family (``"llama"``); ``version`` changes whenever the layout changes, which
    makes every sidecar of the older layout stale (it enters the fingerprint).
    """

    name: str
    version: str
    architectures: frozenset[str]

    @abstractmethod
    def tensor_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every packed tensor name to its full shape (stacked ones lead with ``num_hidden_layers``)."""

    @abstractmethod
    def stacked_names(self, config: ModelConfig) -> list[str]:
        """The names whose first dim is the layer index."""

    @abstractmethod
    def global_tensors(self, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
        """The tensors that are not per layer, at their full shapes."""

    @abstractmethod
    def layer_tensors(self, ckpt: Checkpoint, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s slice of each stacked tensor (its shape without the leading dim)."""


@functools.cache
def _specs() -> dict[str, PackSpec]:
    # Built on first use, not at import: ``specs/llama.py`` imports this module.
    from weight_service.specs.llama import LlamaPackSpec

    return {spec.name: spec for spec in (LlamaPackSpec(),)}


def get_spec(family: str) -> PackSpec:
    """The spec named ``family``; ``InvalidArgument`` when unknown."""
    try:
        return _specs()[family]
    except KeyError:
        raise InvalidArgument(f"unknown pack-spec family {family!r} (known: {', '.join(sorted(_specs()))})") from None


def spec_for_architecture(architecture: str) -> PackSpec:
    """The spec that packs HF ``architecture`` (``LlamaForCausalLM``); ``InvalidArgument`` when none."""
    for spec in _specs().values():
        if architecture in spec.architectures:
            return spec
    raise InvalidArgument(f"no pack spec for architecture {architecture!r}")
