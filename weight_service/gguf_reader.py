"""GGUF checkpoints through the ``gguf`` package, presented under Hugging Face names and layout.

- Metadata keys (``llama.block_count``, ``llama.attention.head_count`` ...) are translated to
  HF ``config.json`` keys (as transformers' GGUF loader does) and handed to the model family
  (:meth:`model_families.family.ModelFamily.config_from_hf`).
- Tensors are dequantized with ``gguf.quants.dequantize`` to float32 numpy arrays; GGUF lists
  dims innermost first, so a ``[in, out]`` GGUF shape is the ``[out, in]`` HF matrix.
- Q4_0/Q4_1 matrices are also offered as they are stored (:meth:`GGUFCheckpoint.int4_groups`):
  each 32-value block (Q4_0: f16 ``d`` + 16 bytes; Q4_1: f16 ``d``, f16 ``m`` + 16 bytes; value
  ``j`` in the low nibble of byte ``j``, value ``j + 16`` in its high nibble, as
  ``gguf.quants``) becomes one int4 group of :mod:`model_families.quant` with integer operations
  only: ``q`` unchanged, ``scale = d``, ``zero = 0`` (Q4_0) or ``m + 8 d`` (Q4_1).
- llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows
  of ``attn_q``/``attn_k`` of Llama-architecture files from HF's rotate-half rotary layout to the
  interleaved-pairs layout: ``w.reshape(n_head, 2, d // 2, in).swapaxes(1, 2)`` with
  ``d = rows // n_head``. :func:`unpermute_rotary` applies the inverse (``n_head`` is the
  attention head count for q and the KV head count for k). Qwen2 files are not permuted. The
  permutation moves whole rows, so quantized rows (codes, scales, zeros) move as units.
- The tokenizer comes from the ``tokenizer.*`` metadata (:mod:`weight_service.tokenizer_export`).
- The generation defaults (:meth:`GGUFCheckpoint.generation_config`) come from the ids that end
  a turn (:data:`EOS_KEYS`: ``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id``)
  and llama.cpp's recommended sampling (:data:`SAMPLING_KEYS`: ``general.sampling.temp``,
  ``top_k``, ``top_p``), as an HF ``generation_config.json`` dict.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from model_families import family_for_architecture
from model_families.quant import INT4_GROUP, Int4Groups
from services.errors import InvalidArgument

#: GGUF ``general.architecture`` to the HF architecture, and whether q/k rows are permuted.
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

#: Per-layer GGUF tensor stems to HF names (``{i}`` is the layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

#: Metadata keys of the token ids that end generation: end of sequence, of turn, of message.
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
#: llama.cpp's recommended-sampling metadata keys -> HF ``generation_config.json`` keys.
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p"}

# GGUF metadata value types (gguf spec): sizes of the fixed-width ones, in bytes.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# ggml tensor types (gguf.GGMLQuantizationType) the reader and `auto` care about.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor name, or ``None`` for tensors without one (``rope_freqs``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. ``w``: ``[n_head * d, ...]`` (a matrix, a bias, or
    per-row codes / scales / zeros of a quantized matrix), any dtype; returns the same shape with
    the rows in HF rotate-half order."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise InvalidArgument(f"cannot unpermute {rows} rows over {n_head} heads")
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_architecture(gguf_arch: str) -> str:
    """``general.architecture`` to the HF class name; ``InvalidArgument`` when unsupported."""
    if gguf_arch not in _ARCHITECTURES:
        raise InvalidArgument(f"GGUF architecture {gguf_arch!r} is not supported "
                              f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    return _ARCHITECTURES[gguf_arch][0]


def _scan_header(path: Path, *, tensors: bool) -> tuple[str | None, dict[str, int]]:
    """``(general.architecture, {tensor name: ggml type})`` from the header alone (a full
    ``GGUFReader`` parses every token string first); tensor infos are read only when
    ``tensors``. Raises ``InvalidArgument`` for a file that is not GGUF v2/v3."""
    arch, types = None, {}
    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
            if magic != b"GGUF" or version not in (2, 3):
                raise InvalidArgument(f"{path} is not a GGUF v2/v3 file")
            n_tensors, kv_count = struct.unpack("<QQ", f.read(16))
            for _ in range(kv_count):
                key = _read_str(f)
                vtype = struct.unpack("<I", f.read(4))[0]
                if key == "general.architecture" and vtype == _STRING:
                    arch = _read_str(f)
                    if not tensors:
                        return arch, types
                else:
                    _skip_value(f, vtype)
            for _ in range(n_tensors if tensors else 0):
                name = _read_str(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                f.seek(8 * n_dims, 1)
                ttype, _offset = struct.unpack("<IQ", f.read(12))
                types[name] = ttype
    except (OSError, struct.error, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read GGUF header of {path}: {e}") from e
    return arch, types


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` read from the metadata header alone. Raises ``InvalidArgument``
    for a file that is not GGUF v2/v3 or lacks the key."""
    arch, _ = _scan_header(path, tensors=False)
    if arch is None:
        raise InvalidArgument(f"{path} has no general.architecture")
    return arch


def gguf_weights_dtype(path: Path) -> str:
    """The sidecar weights dtype that keeps what the file stores in its layer matrices (the 2-D
    ``blk.*`` tensors), read from the header alone: ``int4`` when they are all Q4_0/Q4_1,
    ``int8`` when all Q8_0, ``bf16`` when all BF16, else ``f32`` (F32, F16 and any other or
    mixed quantization: dequantized exactly)."""
    _, types = _scan_header(path, tensors=True)
    kinds = {t for name, t in types.items() if name.startswith("blk.") and name.endswith(".weight")
             and not name.endswith("norm.weight")}
    if kinds and kinds <= {_Q4_0, _Q4_1}:
        return "int4"
    if kinds == {_Q8_0}:
        return "int8"
    if kinds == {_BF16}:
        return "bf16"
    return "f32"


def _read_str(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8")


def _skip_value(f, vtype: int) -> None:
    if vtype in _FIXED:
        f.seek(_FIXED[vtype], 1)
    elif vtype == _STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif vtype == _ARRAY:
        etype, count = struct.unpack("<IQ", f.read(12))
        if etype in _FIXED:
            f.seek(_FIXED[etype] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    else:
        raise InvalidArgument(f"unknown GGUF metadata type {vtype}")


class GGUFCheckpoint:
    """A GGUF file as a :class:`weight_service.checkpoint.Checkpoint` (opening it parses every
    token string of the vocabulary; cost: ``docs/benchmarks.md``). Raises ``InvalidArgument`` for
    an unsupported architecture, a frequency-table rope (``rope_freqs``), or a missing tensor."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"cannot read GGUF file {path}: {e}") from e
        self._fields = self._reader.fields
        self._arch = self._value("general.architecture")
        self._hf_arch = hf_architecture(self._arch)
        self._permuted = _ARCHITECTURES[self._arch][1]
        self._tensors = {}
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
            elif t.name == "rope_freqs.weight":
                raise InvalidArgument(f"{path} scales rope with a frequency table (rope_freqs), "
                                      "which is not supported; use the safetensors checkpoint")
        self.config = family_for_architecture(self._hf_arch).config_from_hf(self.hf_config(), self.has)

    def _value(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def hf_config(self) -> dict:
        """The metadata as an HF ``config.json`` dict (``architectures``, ``hidden_size``, ...;
        GGUF's own defaults where a key is absent: rms eps 1e-6, rope theta 10000, context 2048;
        tied embeddings iff the file has no ``output.weight``)."""
        a = self._arch
        n_head = int(self._value(f"{a}.attention.head_count"))
        hidden = int(self._value(f"{a}.embedding_length"))
        vocab = self._value(f"{a}.vocab_size")
        if vocab is None:
            vocab = len(self._fields["tokenizer.ggml.tokens"].data)
        head_dim = self._value(f"{a}.attention.key_length") or hidden // n_head
        scaling = None
        stype = self._value(f"{a}.rope.scaling.type")
        if stype and stype != "none":
            scaling = {"rope_type": stype, "factor": float(self._value(f"{a}.rope.scaling.factor", 1.0))}
            ctx = self._value(f"{a}.rope.scaling.original_context_length")
            if ctx:
                scaling["original_max_position_embeddings"] = int(ctx)
        return {
            "architectures": [self._hf_arch],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._value(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self._value(f"{a}.block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(self._value(f"{a}.attention.head_count_kv", n_head)),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(self._value(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._value(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": scaling,
            "max_position_embeddings": int(self._value(f"{a}.context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "bos_token_id": _opt_int(self._value("tokenizer.ggml.bos_token_id")),
            "eos_token_id": _opt_int(self._value("tokenizer.ggml.eos_token_id")),
        }

    def has(self, name: str) -> bool:
        """Whether the file holds the tensor with this HF name."""
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantized float32 tensor in HF layout (q/k rows un-permuted)."""
        from gguf.quants import dequantize

        t = self._tensors.get(name)
        if t is None:
            raise InvalidArgument(f"{self.path} has no tensor for {name}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if self._permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
            arr = unpermute_rotary(arr, heads)
        return torch.from_numpy(np.ascontiguousarray(arr).copy())

    def int4_groups(self, name: str) -> Int4Groups | None:
        """The int4 groups of a Q4_0/Q4_1 matrix exactly as stored (see the module docstring), in
        HF layout (q/k rows un-permuted); ``None`` for any other tensor type. Codes and scales are
        moved and reinterpreted, never rounded; only Q4_1's ``zero = m + 8 d`` is an addition
        (in float64, then float32: exact for real weights)."""
        t = self._tensors.get(name)
        if t is None:
            raise InvalidArgument(f"{self.path} has no tensor for {name}")
        kind = int(t.tensor_type)
        if kind not in (_Q4_0, _Q4_1):
            return None
        rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        header = 2 if kind == _Q4_0 else 4
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, cols // INT4_GROUP, header + INT4_GROUP // 2)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        nibbles = blocks[..., header:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
        scales = d.astype(np.float32)
        if kind == _Q4_0:
            zeros = np.zeros_like(scales)
        else:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
            zeros = (m.astype(np.float64) + 8 * d.astype(np.float64)).astype(np.float32)
        if self._permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
            q, scales, zeros = (unpermute_rotary(a, heads) for a in (q, scales, zeros))
        return Int4Groups(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scales, zeros)))

    def tokenizer_files(self) -> dict[str, bytes]:
        """``tokenizer.json`` and ``tokenizer_config.json`` built from the metadata."""
        from weight_service.tokenizer_export import gguf_tokenizer

        tokenizer, tokenizer_config = gguf_tokenizer(self._value)
        return {
            "tokenizer.json": tokenizer.to_str(pretty=False).encode(),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False).encode(),
        }

    def generation_config(self) -> dict | None:
        """An HF ``generation_config.json`` dict built from the metadata: ``eos_token_id`` is the
        list of the :data:`EOS_KEYS` ids present (EOS, EOT, EOM; duplicates once), and
        ``temperature``, ``top_k``, ``top_p`` come from :data:`SAMPLING_KEYS` where present
        (float32 values written as their shortest decimal, ``0.9`` not ``0.8999999761581421``).
        ``None`` when the file has none of these keys. Values that are not numbers are left
        out (the runner validates the rest)."""
        config: dict = {}
        eos = [int(v) for v in (self._value(k) for k in EOS_KEYS) if _is_number(v) and float(v).is_integer()]
        if eos:
            config["eos_token_id"] = list(dict.fromkeys(eos))
        for key, hf_key in SAMPLING_KEYS.items():
            value = self._value(key)
            if _is_number(value):
                config[hf_key] = int(value) if hf_key == "top_k" else float(str(np.float32(value)))
        return config or None

    def close(self) -> None:
        """Drop the reader (its memory map closes when collected)."""
        self._reader = None
        self._tensors = {}


def _opt_int(value) -> int | None:
    return None if value is None else int(value)


def _is_number(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool) \
        and bool(np.isfinite(value))
