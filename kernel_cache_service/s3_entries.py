"""The kernel cache's objects in a bucket: one object per entry, its key and the user metadata
that describes it, and the entry's fingerprint parts record as an object of its own (user
metadata is limited to 2 KiB; a record may hold up to 64 KiB) (``docs/architecture.md`` §6.1,
"Objects")."""

from __future__ import annotations

from kernel_cache_service.entry import FORMATS, EntryInfo
from services.s3_meta import ObjectHead, decode_meta, encode_meta

#: The kernel cache's folder under the ``--store`` prefix, and its entries' folder in it.
FOLDER, ENTRIES = "kernel-cache", "entries"
#: The folder of the entries' parts records (beside ``entries/``, so listing entries never sees them).
PARTS = "parts"
ENTRY_VERSION = "1"


def entry_key(name: str, fingerprint: str) -> str:
    """The object key of an entry, relative to ``PREFIX/kernel-cache/``."""
    return f"{ENTRIES}/{name}/{fingerprint}"


def parts_key(name: str, fingerprint: str) -> str:
    """The object key of an entry's fingerprint parts record, relative to ``PREFIX/kernel-cache/``."""
    return f"{PARTS}/{name}/{fingerprint}"


def key_of(object_key: str) -> tuple[str, str] | None:
    """``(name, fingerprint)`` of an object key made by :func:`entry_key` (not validated),
    ``None`` for any other key."""
    segments = object_key.split("/")
    return (segments[1], segments[2]) if len(segments) == 3 and segments[0] == ENTRIES else None


def entry_metadata(info: EntryInfo) -> dict[str, str]:
    """The user metadata an entry's object carries besides ``size-bytes`` and ``sha256`` (the
    publisher's ``signature`` only when it gave one: ``KEYID:BASE64`` is plain ASCII)."""
    meta = {"entry-version": ENTRY_VERSION, "format": info.format, "producer": encode_meta(info.producer),
            "created": repr(float(info.created))}
    if info.signature:
        meta["signature"] = info.signature
    return meta


def entry_from_head(name: str, fingerprint: str, head: ObjectHead) -> EntryInfo:
    """The :class:`EntryInfo` an object's metadata describes (``last_access`` = its creation);
    raises ``ValueError`` when the metadata is missing, garbled or disagrees with the object's
    size."""
    meta = head.metadata
    if meta.get("entry-version") != ENTRY_VERSION:
        raise ValueError(f"unknown entry-version {meta.get('entry-version')!r}")
    size, sha, fmt = meta.get("size-bytes", ""), meta.get("sha256", ""), meta.get("format", "")
    if not size.isdigit() or int(size) != head.size:
        raise ValueError(f"size-bytes {size[:20]!r} but the object has {head.size} bytes")
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha) or fmt not in FORMATS:
        raise ValueError("garbled sha256 or format metadata")
    created = float(meta.get("created", "x"))
    return EntryInfo(name, fingerprint, int(size), sha, created=created, producer=decode_meta(meta.get("producer", "")),
                     format=fmt, last_access=created, signature=meta.get("signature", ""))
