"""Where the disk store keeps what under its root, and the per-key locks and lease records there
(``docs/architecture.md`` §6, "Kernel-cache store and publish protocol")."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import filelock

from kernel_cache_service.locks import entry_lock
from services.errors import InvalidArgument

BLOB = "blob"
MANIFEST = "manifest.json"
#: The entry's fingerprint parts record (canonical JSON), when published with one.
PARTS_FILE = "parts.json"
SUBDIRS = ("entries", "locks", "leases", "tmp", "trash", "quarantine")


class StoreLayout:
    """The directories of a store rooted at ``root`` (made absolute; the subdirectories are
    created). Raises ``InvalidArgument`` for a root that cannot be created."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        try:
            for sub in SUBDIRS:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgument(f"cannot use {self.root} as a kernel-cache root: {e.strerror}") from e

    def entry_dir(self, name: str, fingerprint: str) -> Path:
        """``entries/<name>/<fingerprint>``: the entry's ``blob``, ``manifest.json`` and maybe ``parts.json``."""
        return self.root / "entries" / name / fingerprint

    def lock(self, name: str, fingerprint: str) -> filelock.FileLock:
        """The key's filelock (publish, evict, quarantine and claim hold it)."""
        return entry_lock(self.root / "locks" / name / f"{fingerprint}.lock")

    def lease_path(self, name: str, fingerprint: str) -> Path:
        """The key's build-lease record (read and written holding :meth:`lock`)."""
        return self.root / "leases" / name / f"{fingerprint}.json"

    def lease_keys(self, name: str | None = None, fingerprint: str | None = None) -> list[tuple[str, str]]:
        """The keys with a lease record (of ``name``/``fingerprint`` when given), sorted."""
        pattern = f"{name or '*'}/{fingerprint or '*'}.json"
        return [(p.parent.name, p.name.removesuffix(".json"))
                for p in sorted((self.root / "leases").glob(pattern))]

    def quarantine_dir(self) -> Path:
        """A fresh, unused path under ``quarantine/`` to move a corrupt entry to."""
        return self.root / "quarantine" / f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
