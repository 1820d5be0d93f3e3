"""What every object written through :class:`services.s3.ObjectStore` carries and how its bytes
are checked: ``size-bytes`` / ``sha256`` user metadata, free-text metadata values, and the
comparison of bytes read with them (``docs/architecture.md`` §6.1)."""

from __future__ import annotations

import base64
import hashlib
import re
import urllib.parse
from dataclasses import dataclass
from typing import BinaryIO

#: Chunk size of downloads and of the hashing of uploads, in bytes.
CHUNK_BYTES = 1 << 20
#: User-metadata keys every object written here carries (S3 lower-cases them).
META_SIZE, META_SHA256 = "size-bytes", "sha256"
#: S3 allows 2 KiB of user metadata; a free-text value is cut to this many characters.
MAX_META_CHARS = 256

_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ObjectHead:
    """What S3 says about one object: ``key`` (relative to the store), ``size`` in bytes, ``etag``
    (quoted, as S3 sends it), user ``metadata`` (lower-case keys), ``last_modified`` (unix s)."""

    key: str
    size: int
    etag: str
    metadata: dict[str, str]
    last_modified: float


def head_from_response(key: str, r: dict) -> ObjectHead:
    """The :class:`ObjectHead` of ``key`` from a HeadObject / GetObject response ``r``."""
    modified = r.get("LastModified")
    return ObjectHead(key, int(r.get("ContentLength", 0)), str(r.get("ETag", "")),
                      {k.lower(): v for k, v in (r.get("Metadata") or {}).items()},
                      modified.timestamp() if modified is not None else 0.0)


def encode_meta(text: str) -> str:
    """Free text as an S3 metadata value: ASCII (percent-encoded), at most :data:`MAX_META_CHARS`."""
    return urllib.parse.quote(str(text)[:MAX_META_CHARS], safe=" :/@._-+=,")


def decode_meta(value: str) -> str:
    """The inverse of :func:`encode_meta`."""
    return urllib.parse.unquote(value)


def object_metadata(size: int, sha: str, metadata: dict[str, str] | None) -> dict[str, str]:
    """``metadata`` plus the ``size-bytes`` (``size`` bytes) and ``sha256`` (hex ``sha``) every
    object carries."""
    return {**(metadata or {}), META_SIZE: str(size), META_SHA256: sha}


def sha256_b64(hex_digest: str) -> str:
    """A hex sha256 as the base64 S3's ``ChecksumSHA256`` wants."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def hash_stream(f: BinaryIO) -> tuple[int, str]:
    """``(size in bytes, sha256 hex)`` of what is left in ``f``, read in chunks."""
    sha, size = hashlib.sha256(), 0
    while block := f.read(CHUNK_BYTES):
        sha.update(block)
        size += len(block)
    return size, sha.hexdigest()


def mismatch(head: ObjectHead, size: int, sha: str, expect_size: int | None, expect_sha: str | None) -> str:
    """Why bytes of ``size`` and ``sha`` read from ``head`` are not the object (or not the
    ``expect_size`` bytes / ``expect_sha`` expected); ``""`` if they are."""
    meta_size, meta_sha = head.metadata.get(META_SIZE, ""), head.metadata.get(META_SHA256, "")
    if not meta_size.isdigit() or not _HEX64.fullmatch(meta_sha):
        return f"its size-bytes/sha256 metadata is missing or garbled ({meta_size[:20]!r}, {meta_sha[:20]!r})"
    if size != int(meta_size) or sha != meta_sha:
        return f"read {size} bytes with sha256 {sha[:16]}..., its metadata says {meta_size} bytes with " \
               f"{meta_sha[:16]}..."
    if expect_size is not None and size != expect_size:
        return f"read {size} bytes, {expect_size} were expected"
    if expect_sha is not None and sha != expect_sha:
        return f"sha256 {sha[:16]}... differs from the expected {expect_sha[:16]}..."
    return ""
