"""The disk store's byte budget and eviction: placing a verified entry, LRU eviction to make
room, and ``cache evict`` (``docs/architecture.md`` §6, "LRU budget" and "read leases")."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import filelock

from kernel_cache_service.counters import Counters
from kernel_cache_service.entry import REJECTED, EntryInfo, PublishResult
from kernel_cache_service.keys import validate_part
from kernel_cache_service.layout import BLOB, StoreLayout
from kernel_cache_service.locks import entry_lock, try_exclusive
from kernel_cache_service.reads import EntryReads
from services.errors import InvalidArgument

log = logging.getLogger(__name__)


def validate_evict(name: str | None, fingerprint: str | None, all: bool) -> None:
    """Check what an evict names: everything (``all``, no key), a ``name``, or a ``name`` and a
    ``fingerprint``. Raises ``InvalidArgument`` for a bad key part or any other combination."""
    if all:
        if name or fingerprint:
            raise InvalidArgument("evict all takes no name or fingerprint")
    elif name:
        validate_part(name, "name")
        if fingerprint:
            validate_part(fingerprint, "fingerprint")
    else:
        raise InvalidArgument("evict needs a name, a name and a fingerprint, or all")


class Budget:
    """Entries of the store at ``layout`` under a budget of ``max_bytes`` bytes of blobs (0 =
    unlimited), LRU by last access (``reads``); evictions are counted in ``counters``. An entry
    being read (``LOCK_SH`` on its blob) is never evicted."""

    def __init__(self, layout: StoreLayout, reads: EntryReads, counters: Counters, max_bytes: int) -> None:
        self.layout, self.reads, self.counters, self.max_bytes = layout, reads, counters, max_bytes

    def admit(self, tmp: Path, info: EntryInfo) -> PublishResult | None:
        """Place the verified temp entry directory ``tmp`` (blob + manifest) as ``info``'s key,
        evicting least recently used entries to make room under the budget; ``None`` once placed,
        REJECTED when no room can be made (the other entries are being read). The caller holds
        the key's lock and has checked that the key is absent."""
        name, fp = info.name, info.fingerprint
        if self.max_bytes:
            with entry_lock(self.layout.root / "budget.lock"):
                if not self._make_room(info.size_bytes, exclude=(name, fp)):
                    return PublishResult(
                        REJECTED, f"no room for {info.size_bytes} bytes under the budget of "
                                  f"{self.max_bytes} bytes: the other entries are being read")
                self._place(tmp, name, fp)
        else:
            self._place(tmp, name, fp)
        return None

    def _place(self, tmp: Path, name: str, fingerprint: str) -> None:
        (self.layout.root / "entries" / name).mkdir(exist_ok=True)
        os.replace(tmp, self.layout.entry_dir(name, fingerprint))

    def _make_room(self, needed: int, exclude: tuple[str, str]) -> bool:
        """Evict least recently used entries (not ``exclude``, not being read, not locked) until
        ``needed`` more bytes fit the budget. Caller holds ``budget.lock``."""
        entries = self.reads.scan()
        total = sum(e.size_bytes for e in entries)
        for e in sorted(entries, key=lambda e: e.last_access):
            if total + needed <= self.max_bytes:
                break
            if (e.name, e.fingerprint) == exclude:
                continue
            freed = self.evict_entry(e.name, e.fingerprint, wait=False)
            if freed is not None:
                total -= freed
        return total + needed <= self.max_bytes

    def evict_entry(self, name: str, fingerprint: str, *, wait: bool) -> int | None:
        """Remove one entry unless it is being read; returns bytes freed, ``None`` if skipped or
        absent. ``wait=False`` also skips an entry whose lock someone else holds."""
        lock = self.layout.lock(name, fingerprint)
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except filelock.Timeout:
            return None
        try:
            d = self.layout.entry_dir(name, fingerprint)
            try:
                fd = os.open(d / BLOB, os.O_RDONLY)
            except FileNotFoundError:
                fd = -1
                if not d.is_dir():
                    return None
            try:
                if fd >= 0 and not try_exclusive(fd):
                    return None  # being read: never evicted
                size = os.fstat(fd).st_size if fd >= 0 else 0
                target = self.layout.root / "trash" / f"{os.getpid()}-{uuid.uuid4().hex}"
                os.replace(d, target)
            finally:
                if fd >= 0:
                    os.close(fd)
        finally:
            lock.release()
        shutil.rmtree(target, ignore_errors=True)
        self.counters.count("evictions")
        log.info("evicted", extra={"entry": f"{name}/{fingerprint}", "bytes": size})
        return size

    def evict(self, name: str | None, fingerprint: str | None, all: bool) -> tuple[int, int]:
        """Evict one entry, every fingerprint of ``name``, or with ``all`` everything (and empty
        ``quarantine/``); entries being read are skipped. Returns ``(entries evicted, bytes
        freed)``. Raises as :func:`validate_evict`."""
        validate_evict(name, fingerprint, all)
        root = self.layout.root
        if all:
            targets = [(n.name, f.name) for n in sorted((root / "entries").iterdir())
                       if n.is_dir() for f in sorted(n.iterdir())]
            for child in list((root / "quarantine").iterdir()):
                shutil.rmtree(child, ignore_errors=True)
        elif fingerprint:
            targets = [(name, fingerprint)]
        else:
            name_dir = root / "entries" / name
            targets = [(name, f.name) for f in sorted(name_dir.iterdir())] if name_dir.is_dir() else []
        count = freed = 0
        for n, f in targets:
            size = self.evict_entry(n, f, wait=True)
            if size is not None:
                count += 1
                freed += size
        return count, freed
