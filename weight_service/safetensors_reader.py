"""Hugging Face safetensors checkpoint directories (one file, or shards listed by
``model.safetensors.index.json``), with ``config.json`` for the architecture.

Tensors are already under HF names and in HF layout. ``config.json`` is translated to
:class:`~weight_service.model_config.ModelConfig` with HF defaults: ``head_dim`` =
``hidden_size // num_attention_heads``, ``num_key_value_heads`` = ``num_attention_heads``,
``tie_word_embeddings`` false; ``rope_theta``/``rope_scaling`` read either from the classic keys or
from transformers 5's ``rope_parameters``; ``attention_bias`` true when the config says so or the
checkpoint has q/k/v biases (Qwen2 configs do not say so). ``tokenizer.json`` is copied and
``tokenizer_config.json`` reduced to the keys a runner needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.errors import InvalidArgument
from weight_service.model_config import ModelConfig
from weight_service.sources import safetensors_shards

_DEFAULT_ROPE_THETA = 10000.0


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


def _rope(data: dict) -> tuple[float, dict | None]:
    params = data.get("rope_parameters")
    theta = data.get("rope_theta")
    scaling = data.get("rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") == "default":
            scaling = None
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA), scaling


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
        self.config = self._config()

    def _config(self) -> ModelConfig:
        d = self._hf
        n_head = d.get("num_attention_heads")
        hidden = d.get("hidden_size")
        if not isinstance(n_head, int) or not isinstance(hidden, int):
            raise InvalidArgument(f"{self.path}/config.json lacks hidden_size or num_attention_heads")
        theta, scaling = _rope(d)
        bias = bool(d.get("attention_bias", False)) or self.has("model.layers.0.self_attn.q_proj.bias")
        return ModelConfig(
            vocab_size=d.get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size"),
            num_hidden_layers=d.get("num_hidden_layers"),
            num_attention_heads=n_head,
            num_key_value_heads=d.get("num_key_value_heads") or n_head,
            head_dim=d.get("head_dim") or hidden // n_head,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            architecture=d["_architecture"],
        )

    def has(self, name: str) -> bool:
        """Whether some shard holds ``name``."""
        return name in self._where

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

    def close(self) -> None:
        """Release the shard handles."""
        self._files.clear()
        self._where.clear()
