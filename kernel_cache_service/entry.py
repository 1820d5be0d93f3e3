"""What the store knows about an entry (its manifest) and the outcome of a publish.

An entry is an artifact blob (a file, or a directory stored as one uncompressed tar) plus a
manifest, ``manifest.json``, holding the fields of :class:`EntryInfo` except ``last_access``,
which is the manifest's mtime (touched on every read, so LRU order needs no rewrite); the
publisher's signature, when it gave one, is a manifest field, so it lands atomically with the entry.
The entry's fingerprint parts record (``parts``, :mod:`kernel_cache_service.fingerprint`), when
the publisher sent one, is a file of its own beside the manifest (``parts.json``), read only
when asked for (``List`` with ``with_parts``), so lookups and listings stay as cheap as before.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from services.signing import program_payload

#: Artifact formats: a single file, or a directory packed as one uncompressed tar.
FORMATS = ("file", "dir")

PUBLISHED = "PUBLISHED"
ALREADY_PRESENT = "ALREADY_PRESENT"
REJECTED = "REJECTED"

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class EntryInfo:
    """One stored entry. Sizes in bytes, times in unix seconds; ``sha256`` is the blob's hex digest;
    ``format`` is ``"file"`` or ``"dir"``; ``producer`` is free text (host, pid, tool);
    ``signature`` the publisher's (``services.signing.Signature.to_text``: ``KEYID:BASE64``) over
    :meth:`signed_payload`, ``""`` when unsigned; ``parts`` the entry's fingerprint parts record
    (canonical JSON whose sha256 is ``fingerprint``), ``""`` when not published or not asked for.
    ``parts`` is not in the signed payload: the signature covers the fingerprint, which is the
    record's digest."""

    name: str
    fingerprint: str
    size_bytes: int
    sha256: str
    created: float
    producer: str
    format: str
    last_access: float = 0.0
    signature: str = ""
    parts: str = ""

    def signed_payload(self) -> bytes:
        """The bytes a publisher signs (:func:`services.signing.program_payload` of this entry)."""
        return program_payload(self.name, self.fingerprint, self.sha256, self.size_bytes, self.format,
                               self.producer)

    def to_dict(self) -> dict:
        """Every field by name (JSON-ready: ``cache ls --json`` prints it)."""
        return asdict(self)

    def manifest_bytes(self) -> bytes:
        """The manifest file's content (``last_access`` lives in the file's mtime instead)."""
        doc = {"version": MANIFEST_VERSION, **self.to_dict()}
        doc.pop("last_access")
        doc.pop("parts")
        if not doc["signature"]:
            doc.pop("signature")
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def from_manifest(cls, data: bytes, last_access: float) -> EntryInfo:
        """Parse a manifest; raises ``ValueError`` (or ``KeyError``/``TypeError``) when malformed."""
        doc = json.loads(data)
        if doc.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unknown manifest version {doc.get('version')!r}")
        info = cls(
            name=str(doc["name"]),
            fingerprint=str(doc["fingerprint"]),
            size_bytes=int(doc["size_bytes"]),
            sha256=str(doc["sha256"]),
            created=float(doc["created"]),
            producer=str(doc["producer"]),
            format=str(doc["format"]),
            last_access=last_access,
            signature=str(doc.get("signature", "")),
        )
        if info.format not in FORMATS or info.size_bytes < 0 or len(info.sha256) != 64:
            raise ValueError("malformed manifest")
        return info


@dataclass(frozen=True)
class PublishResult:
    """Outcome of a publish: ``status`` is PUBLISHED, ALREADY_PRESENT or REJECTED; ``reason`` says
    why for REJECTED; ``entry`` is the stored entry (absent when rejected)."""

    status: str
    reason: str = ""
    entry: EntryInfo | None = None
