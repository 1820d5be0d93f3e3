"""The sidecar format: file names, header, fingerprints, validation and atomic publish.

A sidecar is a directory ``<root>/<source-slug>-<sha256(abs source path)[:12]>-<family>-<dtype>/``
(keyed by source, family and weights dtype, not by fingerprint, so a stale one is found and
replaced) holding ``model.safetensors``, ``config.json``, and when the checkpoint has them
``generation_config.json`` (the model's generation defaults: a safetensors checkpoint's own file,
validated as a JSON object and copied; for a GGUF, built from its metadata, see
:meth:`weight_service.gguf_reader.GGUFCheckpoint.generation_config`), ``tokenizer.json`` and
``tokenizer_config.json``. The weights dtype (:data:`WEIGHTS_DTYPES`: ``f32``, ``bf16``, ``int8``,
``int4``) picks the family's layout (:meth:`model_families.family.ModelFamily.tensor_specs`):
float sidecars hold every tensor in that dtype, quantized ones hold uint8/int8 codes with
float32 scales (and zeros) next to the float tensors the layout keeps (:mod:`model_families.quant`).

``model.safetensors`` is a standard safetensors file (8-byte little-endian header length, JSON
header padded with spaces to a multiple of 8, then the tensor bytes, contiguous, in header order)
whose ``__metadata__`` holds (all strings): ``warmserve.format_version``, ``warmserve.family``,
``warmserve.dtype``, ``warmserve.config`` (the family config's JSON, :meth:`model_families.family.FamilyConfig.to_json`),
``warmserve.fingerprint``, ``warmserve.source_fingerprint``, ``warmserve.names_fingerprint`` and
``warmserve.source``; and, only for a family that has them, ``warmserve.layout_facts`` (the
canonical JSON of :meth:`model_families.family.ModelFamily.layout_facts`).

Fingerprints (sha256 hex):

- ``names_fingerprint`` = sha256 of the sorted packed tensor names, one per line;
- ``fingerprint`` = sha256 over format version, family, pack-spec version, weights dtype,
  ``source_fingerprint`` (:func:`weight_service.sources.source_fingerprint`) and
  ``names_fingerprint``: an int4 and an f32 sidecar of one checkpoint differ in both; plus the
  layout facts' canonical JSON when the family has any (an empty dict leaves the fingerprint as
  it was).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from model_families import get_family
from model_families.dtypes import WEIGHTS_DTYPE_CHOICES, WEIGHTS_DTYPES
from model_families.family import FamilyConfig, TensorSpec
from services.errors import FailedPrecondition, InvalidArgument
from services.fsmode import default_file_mode
from weight_service.sources import GENERATION_CONFIG

#: "2": sidecars may hold ``generation_config.json`` (a GGUF's EOS/EOT/EOM ids and sampling
#: defaults); a version-1 sidecar of the same checkpoint lacks it, so it is invalid and repacked.
FORMAT_VERSION = "2"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONFIG_FILE = "config.json"
#: The same name in the checkpoint and in the sidecar (one source: :mod:`weight_service.sources`).
GENERATION_CONFIG_FILE = GENERATION_CONFIG
#: The signed manifest of a sidecar and its signature (:mod:`weight_service.manifest`).
MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
#: Every file a sidecar may hold, in the order Fetch streams them (weights last).
SIDECAR_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, MANIFEST_FILE,
                 SIGNATURE_FILE, WEIGHTS_FILE)
TEMP_PREFIX = ".tmp-"

#: What ``prepare`` accepts: a weights dtype, or ``auto`` (the checkpoint's own, see
#: :func:`weight_service.checkpoint.native_weights_dtype`).
DTYPE_CHOICES = WEIGHTS_DTYPE_CHOICES
#: torch dtype -> (safetensors dtype string, bytes per element), for the dtypes a layout uses.
ST_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float32: ("F32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 1),
    torch.int32: ("I32", 4),
}
#: safetensors dtype string -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {code: dt for dt, (code, _) in ST_DTYPES.items()}
_MAX_HEADER_BYTES = 100 << 20
_REQUIRED_KEYS = ("format_version", "family", "dtype", "config", "fingerprint",
                  "source_fingerprint", "names_fingerprint", "source")


class InvalidSidecar(FailedPrecondition):
    """A sidecar failed validation; the message is the reason (one sentence)."""


def check_dtype(dtype: str, *, auto: bool = True) -> str:
    """Return ``dtype`` if it is a weights dtype (or ``"auto"`` when ``auto``); else
    ``InvalidArgument`` naming the choices."""
    choices = DTYPE_CHOICES if auto else WEIGHTS_DTYPES
    if dtype not in choices:
        raise InvalidArgument(f"dtype must be one of {', '.join(choices)}, got {dtype!r}")
    return dtype


def _nbytes(spec: TensorSpec) -> int:
    n = ST_DTYPES[spec.dtype][1]
    for d in spec.shape:
        n *= d
    return n


def sidecar_dir_name(slug: str, path_hash: str, family: str, dtype: str) -> str:
    """``<slug>-<path_hash>-<family>-<dtype>``: the directory of one (source, family, dtype)."""
    return f"{slug}-{path_hash}-{family}-{dtype}"


def names_fingerprint(names) -> str:
    """sha256 hex of the sorted tensor names, newline-separated."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


def sidecar_fingerprint(family: str, spec_version: str, dtype: str, source_fp: str, names_fp: str,
                        layout_facts: str = "") -> str:
    """sha256 hex over format version, family, spec version, dtype, source and names
    fingerprints, and the layout facts' canonical JSON (:func:`canonical_facts`) when not empty."""
    lines = [f"format={FORMAT_VERSION}", f"family={family}", f"spec={spec_version}",
             f"dtype={dtype}", f"source={source_fp}", f"names={names_fp}"]
    if layout_facts:
        lines.append(f"layout={layout_facts}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def canonical_facts(facts: dict) -> str:
    """Canonical JSON (sorted keys, no spaces) of a family's layout facts; ``""`` when empty."""
    return json.dumps(facts, sort_keys=True, separators=(",", ":")) if facts else ""


def _facts_difference(stored: dict, expected: dict) -> str:
    keys = sorted(k for k in set(stored) | set(expected) if stored.get(k) != expected.get(k))
    return "; ".join(f"{k} (sidecar {json.dumps(stored.get(k))}, config {json.dumps(expected.get(k))})" for k in keys)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in the file: safetensors dtype string, shape, byte offsets relative to the data
    start (``begin`` inclusive, ``end`` exclusive)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def build_header(specs: dict[str, TensorSpec], metadata: dict[str, str]
                 ) -> tuple[bytes, dict[str, TensorEntry], int]:
    """The file prefix (length + JSON header, padded to 8 bytes), the tensor entries (laid out
    contiguously in sorted name order, each in its spec's dtype) and the total file size in
    bytes."""
    entries: dict[str, TensorEntry] = {}
    offset = 0
    for name in sorted(specs):
        nbytes = _nbytes(specs[name])
        entries[name] = TensorEntry(ST_DTYPES[specs[name].dtype][0], tuple(specs[name].shape), offset, offset + nbytes)
        offset += nbytes
    header = {"__metadata__": dict(metadata)}
    header.update({n: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
                   for n, e in entries.items()})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, entries, len(prefix) + offset


@dataclass(frozen=True)
class SidecarInfo:
    """A validated sidecar: its directory, metadata, config, tensor entries, the byte offset where
    tensor data starts, and the weights file size in bytes."""

    path: Path
    metadata: dict[str, str]
    config: FamilyConfig
    tensors: dict[str, TensorEntry]
    data_start: int
    size_bytes: int

    @property
    def fingerprint(self) -> str:
        return self.metadata["warmserve.fingerprint"]

    @property
    def family(self) -> str:
        return self.metadata["warmserve.family"]

    @property
    def dtype(self) -> str:
        return self.metadata["warmserve.dtype"]

    @property
    def source(self) -> str:
        return self.metadata["warmserve.source"]


def read_header(weights: Path) -> tuple[dict, int, int]:
    """``(header dict, data start offset, file size)`` of a safetensors file; ``InvalidSidecar``
    when the file is missing, shorter than its header, or the header is not a JSON object."""
    try:
        with open(weights, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise InvalidSidecar(f"{weights} is truncated: {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise InvalidSidecar(f"{weights} has a garbled header: it claims {n} header bytes "
                                     f"in a {size}-byte file")
            raw = f.read(n)
    except FileNotFoundError:
        raise InvalidSidecar(f"{weights} does not exist") from None
    except OSError as e:
        raise InvalidSidecar(f"cannot read {weights}: {e.strerror}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidSidecar(f"{weights} has a garbled header: not JSON ({e})") from e
    if not isinstance(header, dict):
        raise InvalidSidecar(f"{weights} has a garbled header: not a JSON object")
    return header, 8 + n, size


def validate_sidecar(directory: Path, *, source_fingerprint: str | None = None,
                     fingerprint: str | None = None) -> SidecarInfo:
    """Validate ``directory/model.safetensors`` and return its :class:`SidecarInfo`.

    Checks, in order: header (readable, JSON, the ``warmserve.*`` metadata, format version,
    family, dtype, config); the layout facts (stored against what the config implies); the packed
    name set (the family layout's names for this config plus the recorded extra tensors, against
    ``names_fingerprint`` and against the header's tensors); the fingerprint (recomputed from the
    metadata; equal to ``fingerprint`` when given); staleness (``source_fingerprint``, the
    checkpoint's current one, when given); every tensor's dtype and shape; contiguous offsets and
    the exact file size. Raises :class:`InvalidSidecar` with the first failing reason.
    """
    weights = Path(directory) / WEIGHTS_FILE
    header, data_start, size = read_header(weights)
    raw_meta = header.pop("__metadata__", None)
    if not isinstance(raw_meta, dict):
        raise InvalidSidecar(f"{weights} has no __metadata__, so it is not a warmserve sidecar")
    missing = [k for k in _REQUIRED_KEYS if not isinstance(raw_meta.get(f"warmserve.{k}"), str)]
    if missing:
        raise InvalidSidecar(f"{weights} lacks metadata {', '.join('warmserve.' + k for k in missing)}")
    meta = {k: v for k, v in raw_meta.items() if isinstance(v, str)}
    if meta["warmserve.format_version"] != FORMAT_VERSION:
        raise InvalidSidecar(f"{weights} has format version {meta['warmserve.format_version']}, "
                             f"this build reads {FORMAT_VERSION}")
    dtype = meta["warmserve.dtype"]
    if dtype not in WEIGHTS_DTYPES:
        raise InvalidSidecar(f"{weights} has unknown dtype {dtype!r}")
    try:
        family = get_family(meta["warmserve.family"])
        config = family.config_from_dict(json.loads(meta["warmserve.config"]))
        specs = family.tensor_specs(config, dtype)
    except (InvalidArgument, ValueError, TypeError) as e:
        raise InvalidSidecar(f"{weights} has an invalid family, config or dtype: {e}") from e

    try:
        facts = canonical_facts(family.layout_facts(config))
    except (InvalidArgument, ValueError, TypeError) as e:
        raise InvalidSidecar(f"{weights} has a config its family cannot lay out: {e}") from e
    stored_facts = meta.get("warmserve.layout_facts", "")
    if stored_facts != facts:
        try:
            stored = json.loads(stored_facts) if stored_facts else {}
        except ValueError:
            stored = {"layout_facts": stored_facts}
        expected = json.loads(facts) if facts else {}
        raise InvalidSidecar(f"{weights} is stale: sidecar layout facts differ from what its config implies: "
                             f"{_facts_difference(stored, expected) if isinstance(stored, dict) else stored_facts}")
    names_fp = names_fingerprint(specs)
    if names_fp != meta["warmserve.names_fingerprint"]:
        raise InvalidSidecar(f"{weights} is stale: its packed tensor-name set differs from the "
                             f"{family.name} family's layout")
    if set(header) != set(specs):
        extra, lacking = sorted(set(header) - set(specs)), sorted(set(specs) - set(header))
        raise InvalidSidecar(f"{weights} is stale or edited: its tensor names do not match its metadata "
                             f"(unexpected {extra}, missing {lacking})")
    expected_fp = sidecar_fingerprint(family.name, family.pack_version, dtype,
                                      meta["warmserve.source_fingerprint"], names_fp, facts)
    if expected_fp != meta["warmserve.fingerprint"]:
        raise InvalidSidecar(f"{weights} fingerprint does not match its metadata "
                             "(packed by another pack-spec version, or edited)")
    if fingerprint is not None and fingerprint != expected_fp:
        raise InvalidSidecar(f"{weights} has fingerprint {expected_fp[:16]}..., expected {fingerprint[:16]}...")
    if source_fingerprint is not None and source_fingerprint != meta["warmserve.source_fingerprint"]:
        raise InvalidSidecar(f"{weights} is stale: the checkpoint changed since it was packed "
                             "(a file's size, mtime or config differs)")

    entries: dict[str, TensorEntry] = {}
    for name, spec in specs.items():
        info = header[name]
        st_dtype = ST_DTYPES[spec.dtype][0]
        if not isinstance(info, dict):
            raise InvalidSidecar(f"{weights} has a garbled header entry for {name}")
        if info.get("dtype") != st_dtype:
            raise InvalidSidecar(f"{weights} tensor {name} has dtype {info.get('dtype')}, expected {st_dtype}")
        if list(info.get("shape", [])) != list(spec.shape):
            raise InvalidSidecar(f"{weights} tensor {name} has shape {info.get('shape')}, expected {list(spec.shape)}")
        offsets = info.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise InvalidSidecar(f"{weights} tensor {name} has garbled data_offsets")
        entries[name] = TensorEntry(st_dtype, tuple(spec.shape), offsets[0], offsets[1])
    position = 0
    for name, e in sorted(entries.items(), key=lambda kv: kv[1].begin):
        nbytes = _nbytes(specs[name])
        if e.begin != position or e.end - e.begin != nbytes:
            raise InvalidSidecar(f"{weights} tensor {name} has offsets {e.begin}..{e.end}, "
                                 f"expected {position}..{position + nbytes}")
        position = e.end
    if size != data_start + position:
        raise InvalidSidecar(f"{weights} is truncated or padded: {size} bytes, the header needs "
                             f"{data_start + position}")
    return SidecarInfo(Path(directory), meta, config, entries, data_start, size)


def new_temp_file(directory: Path, name: str) -> tuple[int, Path]:
    """``mkstemp`` in ``directory`` (same filesystem as the final file, so ``os.replace`` is atomic).
    Returns ``(fd, path)``; the name starts with :data:`TEMP_PREFIX` so crash garbage is found."""
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{name}-", dir=directory)
    return fd, Path(tmp)


def finish_temp_file(fd: int, tmp: Path) -> None:
    """fsync and close ``fd``, then chmod ``tmp`` to ``0o666 & ~umask`` (mkstemp makes it 0o600)."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, default_file_mode())


def write_temp_file(directory: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to a finished (fsynced, chmodded) temp file in ``directory``; returns its path."""
    fd, tmp = new_temp_file(directory, name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    finish_temp_file(fd, tmp)
    return tmp


def publish(directory: Path, temps: dict[str, Path]) -> None:
    """``os.replace`` each temp file onto its final name in ``directory`` (``model.safetensors``
    last: it is the commit point, validated by fingerprint), then fsync the directory. A sidecar
    file (:data:`SIDECAR_FILES`) that ``temps`` does not hold is left over from an earlier pack
    (say, a ``generation_config.json`` since deleted from the checkpoint): it is removed before
    the commit point, so the new weights never come with an old file."""
    for name in sorted(temps, key=lambda n: n == WEIGHTS_FILE):
        if name == WEIGHTS_FILE:
            for stale in SIDECAR_FILES:
                if stale not in temps:
                    (directory / stale).unlink(missing_ok=True)
        os.replace(temps[name], directory / name)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temp_files(directory: Path) -> int:
    """Delete crash garbage (``.tmp-*`` files) in ``directory``; returns how many. Call with the
    sidecar's lock held."""
    count = 0
    if directory.is_dir():
        for p in directory.glob(f"{TEMP_PREFIX}*"):
            p.unlink(missing_ok=True)
            count += 1
    return count
