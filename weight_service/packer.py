"""Pack a checkpoint into a sidecar directory: stream every tensor into a temp file, check the
checkpoint did not change meanwhile, then publish atomically.

The header (names, shapes, offsets, fingerprints) depends only on the config, so it is written
first; tensor data then goes straight to its offset with ``pwrite`` (global
tensors, then layer by layer into each stacked tensor's slice
``[family.stack_index(config, name, layer)]``), so memory holds one layer at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from model_families.family import ModelFamily, TensorSpec
from services.errors import FailedPrecondition, InvalidArgument
from weight_service.checkpoint import open_checkpoint
from weight_service.progress import ProgressEvent
from weight_service.sidecar import (
    CONFIG_FILE,
    FORMAT_VERSION,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    build_header,
    canonical_facts,
    finish_temp_file,
    names_fingerprint,
    new_temp_file,
    publish,
    sidecar_fingerprint,
    write_temp_file,
)
from weight_service.sources import ResolvedSource, source_fingerprint

Progress = Callable[[ProgressEvent], None]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> memoryview:
    """The bytes of ``t`` as the layout stores it: float tensors cast to the spec's float dtype;
    integer parts (quantized codes) must already be in the spec's dtype (a cast would be a
    silent float detour)."""
    if tuple(t.shape) != tuple(shape):  # the checkpoint disagrees with its own config: bad input
        raise InvalidArgument(f"checkpoint tensor for {name} has shape {list(t.shape)}, "
                              f"the family's layout expects {list(shape)} (does config.json match the weights?)")
    if not dtype.is_floating_point and t.dtype != dtype:
        raise FailedPrecondition(f"the family packed {name} as {t.dtype}, its layout stores {dtype}")
    t = t.to(dtype).contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _current_fingerprint(source: ResolvedSource) -> str | None:
    try:
        return source_fingerprint(source)
    except InvalidArgument:  # a file vanished: changed
        return None


def pack_sidecar(source: ResolvedSource, family: ModelFamily, dtype: str, directory: Path,
                 progress: Progress | None = None) -> None:
    """Pack ``source`` with ``family``'s pack spec in the weights dtype ``dtype`` (``"f32"``,
    ``"bf16"``, ``"int8"``, ``"int4"``; its layout is
    :meth:`~model_families.family.ModelFamily.tensor_specs`) into ``directory``.

    Publishes ``config.json``, ``generation_config.json`` (when the checkpoint has generation
    defaults: :meth:`~weight_service.checkpoint.CheckpointReader.generation_config`), the
    tokenizer files and ``model.safetensors`` (last) with mkstemp + fsync + chmod +
    ``os.replace``. Raises ``FailedPrecondition`` when the checkpoint's fingerprint changed
    between the start and the end of packing (nothing is published then), ``InvalidArgument``
    for an unreadable or unsupported checkpoint (a malformed ``generation_config.json``
    included: it is read before anything is written). Callers hold the sidecar lock.
    """
    emit = progress or (lambda _e: None)
    source_fp = source_fingerprint(source)
    emit(ProgressEvent("read", message=f"reading {source.path.name}"))
    ckpt = open_checkpoint(source)
    temps: dict[str, Path] = {}
    created = False
    try:
        config = ckpt.config
        generation = ckpt.generation_config()
        layers = config.num_hidden_layers
        specs: dict[str, TensorSpec] = family.tensor_specs(config, dtype)
        names_fp = names_fingerprint(specs)
        facts = canonical_facts(family.layout_facts(config))
        metadata = {
            "warmserve.format_version": FORMAT_VERSION,
            "warmserve.family": family.name,
            "warmserve.dtype": dtype,
            "warmserve.config": config.to_json(),
            "warmserve.fingerprint": sidecar_fingerprint(family.name, family.pack_version, dtype, source_fp, names_fp,
                                                         facts),
            "warmserve.source_fingerprint": source_fp,
            "warmserve.names_fingerprint": names_fp,
            "warmserve.source": str(source.path),
        }
        if facts:
            metadata["warmserve.layout_facts"] = facts
        prefix, entries, total = build_header(specs, metadata)
        created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in ckpt.tokenizer_files().items():
            temps[name] = write_temp_file(directory, name, data)
        temps[CONFIG_FILE] = write_temp_file(
            directory, CONFIG_FILE, json.dumps(config.to_dict(), indent=2).encode())
        if generation is not None:
            temps[GENERATION_CONFIG_FILE] = write_temp_file(
                directory, GENERATION_CONFIG_FILE, json.dumps(generation, indent=2, ensure_ascii=False).encode())

        fd, tmp = new_temp_file(directory, WEIGHTS_FILE)
        temps[WEIGHTS_FILE] = tmp
        try:
            os.ftruncate(fd, total)
            _pwrite_all(fd, memoryview(prefix), 0)
            base, written = len(prefix), 0
            for name, t in family.global_tensors(ckpt, dtype).items():
                data = _tensor_bytes(t, specs[name].dtype, specs[name].shape, name)
                _pwrite_all(fd, data, base + entries[name].begin)
                written += len(data)
            emit(ProgressEvent("pack", 0, layers, written, "global tensors"))
            for layer in range(layers):
                for name, t in family.layer_tensors(ckpt, layer, dtype).items():
                    index = family.stack_index(config, name, layer)
                    if not 0 <= index < specs[name].shape[0]:
                        raise FailedPrecondition(f"the family placed layer {layer} of {name} at slice {index}, "
                                                 f"outside its {specs[name].shape[0]} slices")
                    data = _tensor_bytes(t, specs[name].dtype, specs[name].shape[1:], f"{name}[{index}]")
                    _pwrite_all(fd, data, base + entries[name].begin + index * len(data))
                    written += len(data)
                emit(ProgressEvent("pack", layer + 1, layers, written))
        except BaseException:
            os.close(fd)
            raise
        emit(ProgressEvent("write", layers, layers, written, "fsync"))
        finish_temp_file(fd, tmp)

        if _current_fingerprint(source) != source_fp:
            raise FailedPrecondition(f"checkpoint {source.path} changed while it was packed; "
                                     "nothing was published, try again")
        publish(directory, temps)
        temps.clear()
    finally:
        ckpt.close()
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        if created and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # a failed first pack leaves no empty sidecar directory behind
