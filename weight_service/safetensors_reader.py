"""Hugging Face safetensors checkpoint directories (one file, or shards listed by
``model.safetensors.index.json``), with ``config.json`` for the architecture.

Tensors are already under HF names and in HF layout. ``config.json`` goes to the family of its
``architectures[0]`` (:meth:`model_families.family.ModelFamily.config_from_hf`, which applies
the HF defaults). ``tokenizer.json`` is copied and ``tokenizer_config.json`` reduced to the keys
a runner needs; ``generation_config.json``, when present, must be a JSON object and is kept whole.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from model_families import family_for_architecture
from services.errors import InvalidArgument
from weight_service.sources import GENERATION_CONFIG, safetensors_shards


def read_hf_config(directory: Path) -> dict:
    """``config.json`` as a dict, with ``_architecture`` set to ``architectures[0]``.
    Raises ``InvalidArgument`` when it is missing, not JSON, or names no architecture."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"cannot read {path}: {e}") from e
    archs = data.get("architectures") or []
    if not archs:
        raise InvalidArgument(f"{path} names no architecture (architectures is empty)")
    data["_architecture"] = archs[0]
    return data


def safetensors_weights_dtype(directory: Path) -> str:
    """``bf16`` when every matrix (2-D tensor) of the checkpoint is stored in bfloat16, else
    ``f32`` (float32, float16: kept exactly), read from the shards' headers alone. Raises
    ``InvalidArgument`` for an unreadable shard."""
    kinds = set()
    for shard in safetensors_shards(Path(directory)):
        try:
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise InvalidArgument(f"cannot read the header of {shard}: {e}") from e
        kinds |= {v.get("dtype") for k, v in header.items()
                  if k != "__metadata__" and isinstance(v, dict) and len(v.get("shape", ())) == 2}
    return "bf16" if kinds == {"BF16"} else "f32"


class SafetensorsCheckpoint:
    """A safetensors directory as a :class:`weight_service.checkpoint.Checkpoint`. Raises
    ``InvalidArgument`` for a missing shard, an unreadable file or a missing tensor."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.path = Path(directory)
        self._hf = read_hf_config(self.path)
        self._files = {}
        self._where: dict[str, object] = {}
        for shard in safetensors_shards(self.path):
            try:
                handle = safe_open(str(shard), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise InvalidArgument(f"cannot read {shard}: {e}") from e
            self._files[shard.name] = handle
            for name in handle.keys():
                self._where[name] = handle
        self.config = family_for_architecture(self._hf["_architecture"]).config_from_hf(self._hf, self.has)

    def has(self, name: str) -> bool:
        """Whether some shard holds ``name``."""
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor name the shards hold, sorted."""
        return sorted(self._where)

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor (its own dtype) in HF layout."""
        handle = self._where.get(name)
        if handle is None:
            raise InvalidArgument(f"{self.path} has no tensor {name}")
        return handle.get_tensor(name)

    def tokenizer_files(self) -> dict[str, bytes]:
        """``tokenizer.json`` copied, and ``tokenizer_config.json`` with ``chat_template``,
        ``bos_token``, ``eos_token``, ``add_bos_token`` when a tokenizer is present; else empty."""
        tok = self.path / "tokenizer.json"
        if not tok.is_file():
            return {}
        cfg_path = self.path / "tokenizer_config.json"
        src = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = src.get("chat_template")
        jinja = self.path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()

        def token(value):
            return value.get("content") if isinstance(value, dict) else value

        config = {
            "chat_template": template,
            "bos_token": token(src.get("bos_token")),
            "eos_token": token(src.get("eos_token")),
            "add_bos_token": bool(src.get("add_bos_token", False)),
        }
        return {"tokenizer.json": tok.read_bytes(),
                "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode()}

    def generation_config(self) -> dict | None:
        """``generation_config.json`` as a dict (every key kept: the runner reads the EOS ids
        and sampling defaults it knows), ``None`` when the directory has none. Raises
        ``InvalidArgument`` when it is not JSON or not a JSON object."""
        path = self.path / GENERATION_CONFIG
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_bytes())
        except OSError as e:
            raise InvalidArgument(f"cannot read {path}: {e.strerror}") from e
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InvalidArgument(f"{path} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
            raise InvalidArgument(f"{path} must hold a JSON object, not {kind}")
        return data

    def close(self) -> None:
        """Release the shard handles."""
        self._files.clear()
        self._where.clear()
