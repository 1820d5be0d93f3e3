"""Opening a checkpoint for packing, whatever its file format.

Both readers (:mod:`weight_service.safetensors_reader`, :mod:`weight_service.gguf_reader`)
present the checkpoint the same way (:class:`CheckpointReader`): the model family's config
(built by :meth:`model_families.family.ModelFamily.config_from_hf` from the checkpoint's HF
config, or from the GGUF metadata translated to HF keys), tensors under HF names
(``model.layers.3.self_attn.q_proj.weight``) in HF layout (``[out, in]`` as ``F.linear``
expects, q/k in HF rotary order), the tokenizer files to place next to the sidecar, and the
generation defaults (an HF ``generation_config.json`` dict). A family's pack spec never sees a
file format.
"""

from __future__ import annotations

from typing import Protocol

from model_families.family import Checkpoint
from weight_service.sources import ResolvedSource


class CheckpointReader(Checkpoint, Protocol):
    """A :class:`model_families.family.Checkpoint` that the packer also asks for tokenizer files
    and closes."""

    def tokenizer_files(self) -> dict[str, bytes]:
        """File name (``tokenizer.json``, ``tokenizer_config.json``) to bytes; may be empty."""
        ...

    def generation_config(self) -> dict | None:
        """The checkpoint's ``generation_config.json`` as a dict (EOS ids, sampling defaults,
        HF keys), or ``None`` when it has none; ``InvalidArgument`` when it is malformed."""
        ...

    def close(self) -> None: ...


def open_checkpoint(source: ResolvedSource) -> CheckpointReader:
    """Open ``source`` with the reader for its kind (raises ``InvalidArgument`` when unreadable)."""
    if source.kind == "gguf":
        from weight_service.gguf_reader import GGUFCheckpoint

        return GGUFCheckpoint(source.path)
    from weight_service.safetensors_reader import SafetensorsCheckpoint

    return SafetensorsCheckpoint(source.path)


def source_architecture(source: ResolvedSource) -> str:
    """The HF architecture name (``LlamaForCausalLM``) without reading weights: ``config.json``'s
    ``architectures[0]``, or the GGUF ``general.architecture`` key (read from the file's first
    metadata entries). Raises ``InvalidArgument`` when it cannot be found."""
    if source.kind == "gguf":
        from weight_service.gguf_reader import gguf_architecture, hf_architecture

        return hf_architecture(gguf_architecture(source.path))
    from weight_service.safetensors_reader import read_hf_config

    return read_hf_config(source.path)["_architecture"]


def native_weights_dtype(source: ResolvedSource) -> str:
    """The weights dtype ``auto`` resolves to: the one that keeps the checkpoint's own storage
    (GGUF: :func:`weight_service.gguf_reader.gguf_weights_dtype`, int4 for Q4_0/Q4_1 files;
    safetensors: :func:`weight_service.safetensors_reader.safetensors_weights_dtype`), read from
    headers only. Raises ``InvalidArgument`` when they cannot be read."""
    if source.kind == "gguf":
        from weight_service.gguf_reader import gguf_weights_dtype

        return gguf_weights_dtype(source.path)
    from weight_service.safetensors_reader import safetensors_weights_dtype

    return safetensors_weights_dtype(source.path)
