"""Signed sidecar manifests: what the weight service signs and what a runner checks before it
maps a sidecar (``docs/architecture.md`` §7, "Signed sidecars").

``manifest.json`` is canonical JSON (sorted keys, no spaces) of ``{"version": 1, "fingerprint",
"family", "dtype", "files": {name: {"size_bytes", "sha256"}}, "weights": {"size_bytes",
"header_sha256", "tensors": {name: sha256}}}``: every other sidecar file by size and sha256, the
safetensors header (bytes ``[0, data_start)``) by its sha256 and every tensor's bytes by theirs
(per-tensor sha256, so a refusal names the tensor). ``manifest.sig`` holds the Ed25519
signature (``KEYID:BASE64``) over :func:`services.signing.canonical_payload` of the manifest
under the ``warmserve-sidecar-v1`` domain.

A verified sidecar is remembered in ``<sidecar root>/.verified/<dir name>.json`` by its
fingerprint, the signer's key id and each file's identity (device, inode, size, mtime_ns,
ctime_ns): a warm launch whose files have the same identities re-checks the signature but does
not rehash the tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from services.errors import Untrusted
from services.signing import SIDECAR_DOMAIN, SigningKey, TrustedKeys, canonical_payload
from weight_service.catalog import sidecar_files
from weight_service.sidecar import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    InvalidSidecar,
    SidecarInfo,
    write_temp_file,
)

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
#: The directory of remembered verifications, under the sidecar root.
RECORD_DIR = ".verified"
_CHUNK = 1 << 20


def _sha_range(f, begin: int, end: int) -> str:
    f.seek(begin)
    h, left = hashlib.sha256(), end - begin
    while left > 0 and (block := f.read(min(_CHUNK, left))):
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def _file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha_range(f, 0, os.fstat(f.fileno()).st_size)


def _covered_files(directory: Path) -> list[str]:
    return [n for n in sidecar_files(directory) if n not in (WEIGHTS_FILE, MANIFEST_FILE, SIGNATURE_FILE)]


def build_manifest(info: SidecarInfo) -> dict:
    """The manifest of the validated sidecar ``info`` (reads and hashes every byte of it)."""
    with open(info.path / WEIGHTS_FILE, "rb") as f:
        tensors = {n: _sha_range(f, info.data_start + e.begin, info.data_start + e.end)
                   for n, e in sorted(info.tensors.items())}
        header = _sha_range(f, 0, info.data_start)
    files = {n: {"size_bytes": (info.path / n).stat().st_size, "sha256": _file_sha(info.path / n)}
             for n in _covered_files(info.path)}
    return {"version": MANIFEST_VERSION, "fingerprint": info.fingerprint, "family": info.family, "dtype": info.dtype,
            "files": files, "weights": {"size_bytes": info.size_bytes, "header_sha256": header, "tensors": tensors}}


def manifest_payload(manifest: dict) -> bytes:
    """The bytes the manifest's signature covers (the ``warmserve-sidecar-v1`` canonical payload)."""
    return canonical_payload(SIDECAR_DOMAIN, manifest)


def _read_signed(directory: Path) -> tuple[dict, str]:
    """``(manifest, signature text)`` of ``directory``; ``Untrusted`` when absent or not JSON."""
    try:
        raw, sig = (directory / MANIFEST_FILE).read_bytes(), (directory / SIGNATURE_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        raise Untrusted(f"sidecar {directory.name} is not signed (no readable {MANIFEST_FILE} and "
                        f"{SIGNATURE_FILE})") from None
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise Untrusted(f"sidecar {directory.name}: {MANIFEST_FILE} is not JSON") from None
    if not isinstance(manifest, dict):
        raise Untrusted(f"sidecar {directory.name}: {MANIFEST_FILE} is not a JSON object")
    return manifest, sig


def check_own_manifest(info: SidecarInfo, key: SigningKey) -> None:
    """Cheap check (no hashing) that ``info``'s sidecar carries a manifest signed by ``key`` for
    its fingerprint, weights size and file set; raises ``InvalidSidecar`` otherwise (the caller
    repacks: bytes it did not just pack itself are never signed)."""
    try:
        manifest, sig = _read_signed(info.path)
        TrustedKeys([key.public_key()]).verify(manifest_payload(manifest), sig, "the manifest")
    except Untrusted as e:
        raise InvalidSidecar(f"sidecar {info.path.name} is not signed by this signing key ({e})") from None
    weights = manifest.get("weights")
    if manifest.get("fingerprint") != info.fingerprint or not isinstance(weights, dict) \
            or weights.get("size_bytes") != info.size_bytes \
            or sorted(manifest.get("files") or {}) != _covered_files(info.path):
        raise InvalidSidecar(f"sidecar {info.path.name}: its signed manifest is not this sidecar's")


def sign_sidecar(info: SidecarInfo, key: SigningKey) -> None:
    """Write ``info``'s manifest (every byte hashed) and its signature by ``key``: call right
    after packing it, holding the sidecar's lock (what is signed is what is on disk). Both files
    go to temp files renamed into place. Raises ``OSError`` when they cannot be written."""
    manifest = build_manifest(info)
    text = key.sign(manifest_payload(manifest)).to_text()
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    temps = {MANIFEST_FILE: write_temp_file(info.path, MANIFEST_FILE, body),
             SIGNATURE_FILE: write_temp_file(info.path, SIGNATURE_FILE, text.encode() + b"\n")}
    for name, tmp in temps.items():
        os.replace(tmp, info.path / name)
    log.info("signed the sidecar manifest", extra={"sidecar": info.path.name, "key_id": key.key_id})


def _identity(directory: Path) -> dict[str, list[int]]:
    out = {}
    for name in sidecar_files(directory):
        st = (directory / name).stat()
        out[name] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def _record_path(directory: Path) -> Path:
    return directory.parent / RECORD_DIR / f"{directory.name}.json"


def _compare(info: SidecarInfo, manifest: dict) -> None:
    """``Untrusted`` naming the first file or tensor whose bytes differ from ``manifest``."""
    name = info.path.name
    for field in ("fingerprint", "family", "dtype"):
        if manifest.get(field) != getattr(info, field):
            raise Untrusted(f"sidecar {name}: the signed manifest's {field} is not the sidecar's")
    files, weights = manifest.get("files"), manifest.get("weights")
    if not isinstance(files, dict) or not isinstance(weights, dict) or sorted(files) != _covered_files(info.path):
        raise Untrusted(f"sidecar {name}: its files are not those the signed manifest lists")
    for fname, want in files.items():
        path = info.path / fname
        if not isinstance(want, dict) or want.get("size_bytes") != path.stat().st_size \
                or want.get("sha256") != _file_sha(path):
            raise Untrusted(f"sidecar {name}: {fname} differs from its signed manifest")
    if weights.get("size_bytes") != info.size_bytes or not isinstance(weights.get("tensors"), dict) \
            or sorted(weights["tensors"]) != sorted(info.tensors):
        raise Untrusted(f"sidecar {name}: the weights' size or tensor names differ from the signed manifest")
    with open(info.path / WEIGHTS_FILE, "rb") as f:
        if weights.get("header_sha256") != _sha_range(f, 0, info.data_start):
            raise Untrusted(f"sidecar {name}: the safetensors header differs from the signed manifest")
        for tname, e in sorted(info.tensors.items(), key=lambda kv: kv[1].begin):
            if weights["tensors"][tname] != _sha_range(f, info.data_start + e.begin, info.data_start + e.end):
                raise Untrusted(f"sidecar {name}: tensor {tname} differs from the signed manifest")


def verify_sidecar(info: SidecarInfo, trusted: TrustedKeys, *, remember: bool = True) -> str:
    """Check the validated sidecar ``info`` against its signed manifest before anything maps it:
    the signature (by a key of ``trusted``), fingerprint, family, dtype, the file set, every
    file's and tensor's sha256 (skipped when a remembered record of the same fingerprint, key
    and file identities exists). Returns a phrase for the start-up report. Raises ``Untrusted``
    saying what failed. ``remember``: record a success (best effort)."""
    manifest, sig = _read_signed(info.path)
    kid = trusted.verify(manifest_payload(manifest), sig, f"sidecar {info.path.name}")
    before = _identity(info.path)
    record = {"fingerprint": info.fingerprint, "key_id": kid, "files": before}
    try:
        if json.loads(_record_path(info.path).read_text()) == record:
            return f"sidecar verified (key {kid}, remembered)"
    except (OSError, ValueError):
        pass
    _compare(info, manifest)
    if remember and _identity(info.path) == before:
        try:
            path = _record_path(info.path)
            path.parent.mkdir(exist_ok=True)
            os.replace(write_temp_file(path.parent, path.name, json.dumps(record).encode()), path)
        except OSError as e:
            log.warning("cannot remember the verified sidecar (it is rehashed next launch): %s", e)
    return f"sidecar verified (key {kid})"
