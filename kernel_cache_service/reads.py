"""Reads and integrity of the disk store: loading an entry's manifest, lookups, read leases,
verified reads and quarantine (``docs/architecture.md`` §6, "read leases" and "integrity")."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from kernel_cache_service.artifact import CHUNK_BYTES, CorruptArtifact, install_stream, install_verified
from kernel_cache_service.counters import Counters
from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.fingerprint import UNKNOWN
from kernel_cache_service.layout import BLOB, MANIFEST, PARTS_FILE, StoreLayout
from kernel_cache_service.locks import lock_shared
from services.errors import InvalidArgument

log = logging.getLogger(__name__)


class BrokenEntry(Exception):
    """An entry directory exists but its manifest or blob is unusable (the message says why)."""


class EntryReader:
    """An entry opened for reading, holding a read lease (``LOCK_SH`` on the blob fd ``fd``)
    until closed; use it as a context manager. ``info`` describes the entry, ``inode`` identifies
    its blob. :meth:`chunks` yields the blob and checks its sha256 at the end (``verified`` is
    then True); a mismatch is quarantined through ``reads``."""

    def __init__(self, reads: EntryReads, info: EntryInfo, fd: int, ino: int) -> None:
        self.info = info
        self.verified = False
        self._reads, self._fd, self.inode = reads, fd, ino

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The blob in chunks of at most ``chunk_bytes`` bytes (the last may be shorter).

        After the last chunk the size and sha256 are compared with the manifest; on a mismatch
        the entry is quarantined and :class:`CorruptArtifact` (a ``NotFound``) is raised; a
        ``chunk_bytes`` <= 0 raises ``InvalidArgument``.
        """
        if chunk_bytes <= 0:
            raise InvalidArgument(f"chunk size must be > 0 bytes, got {chunk_bytes}")
        sha, size = hashlib.sha256(), 0
        os.lseek(self._fd, 0, os.SEEK_SET)
        while block := os.read(self._fd, chunk_bytes):
            sha.update(block)
            size += len(block)
            yield block
        info = self.info
        if size != info.size_bytes or sha.hexdigest() != info.sha256:
            reason = f"read {size} bytes with sha256 {sha.hexdigest()[:16]}..., manifest says " \
                     f"{info.size_bytes} bytes with {info.sha256[:16]}..."
            self._reads.quarantine(info.name, info.fingerprint, self.inode, reason)
            self._reads.counters.count("misses")
            raise CorruptArtifact(f"entry {info.name}/{info.fingerprint} is corrupt and was quarantined")
        self.verified = True
        self._reads.counters.count("hits")

    def close(self) -> None:
        """Release the read lease."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fetch_entry(opened: EntryReader | None, dest: str | Path, quarantine: Callable[[str, str, int, str], None],
                check: Callable[[EntryInfo], object] | None = None) -> EntryInfo | None:
    """Write the entry ``opened`` reads (closed here; ``None``: a MISS) at ``dest`` atomically (a
    file, or a directory restored from its tar); ``None`` when its bytes are corrupt. Intact bytes
    of a "dir" entry that do not unpack are passed to ``quarantine(name, fingerprint, inode,
    reason)``. Raises ``InvalidArgument`` for an unusable ``dest`` (see :func:`artifact.install_stream`).
    ``check(info)`` runs first and may raise (nothing is written then); with it, a "dir" entry's
    bytes are verified whole before anything is unpacked (:func:`artifact.install_verified`)."""
    if opened is None:
        return None
    with opened as reader:
        try:
            if check is None:
                install_stream(reader.chunks(), reader.info.format, dest)
            else:
                check(reader.info)
                install_verified(reader.chunks(), reader.info.format, dest)
        except CorruptArtifact:
            if reader.verified:  # intact bytes, but a "dir" entry that is not a tar
                quarantine(reader.info.name, reader.info.fingerprint, reader.inode,
                           "directory artifact does not unpack")
            return None
    return reader.info


class EntryReads:
    """The read side of the store at ``layout``: finds, checks, opens and quarantines entries,
    counting hits, misses and quarantines in ``counters``. Keys are validated by the caller."""

    def __init__(self, layout: StoreLayout, counters: Counters) -> None:
        self.layout, self.counters = layout, counters

    def load(self, name: str, fingerprint: str) -> tuple[EntryInfo, int] | None:
        """``(info, blob inode)``, ``None`` when absent; raises :class:`BrokenEntry` for an
        unusable entry (manifest or blob missing, manifest unreadable or naming another key, blob
        size differing from the manifest's)."""
        d = self.layout.entry_dir(name, fingerprint)
        try:
            st_manifest = os.stat(d / MANIFEST)
            data = (d / MANIFEST).read_bytes()
            st_blob = os.stat(d / BLOB)
        except FileNotFoundError:
            if d.is_dir():
                raise BrokenEntry("manifest or blob missing") from None
            return None
        try:
            info = EntryInfo.from_manifest(data, st_manifest.st_mtime)
        except (ValueError, KeyError, TypeError) as e:
            raise BrokenEntry(f"unreadable manifest: {e}") from e
        if (info.name, info.fingerprint) != (name, fingerprint):
            raise BrokenEntry(f"manifest names {info.name}/{info.fingerprint}")
        if st_blob.st_size != info.size_bytes:
            raise BrokenEntry(f"blob has {st_blob.st_size} bytes, manifest says {info.size_bytes}")
        return info, st_blob.st_ino

    def load_sound(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info, ``None`` when absent or broken (left as it is)."""
        try:
            loaded = self.load(name, fingerprint)
        except BrokenEntry:
            return None
        return loaded[0] if loaded else None

    def parts(self, name: str, fingerprint: str, limit: int) -> str:
        """The entry's parts record as stored (checked at publish), ``""`` when it has none, it
        is unreadable or over ``limit`` bytes."""
        path = self.layout.entry_dir(name, fingerprint) / PARTS_FILE
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except OSError:
            return ""
        if len(data) > limit:
            return ""
        try:
            return data.decode("ascii")
        except UnicodeDecodeError:
            return ""

    def touch(self, name: str, fingerprint: str) -> float:
        """Set the entry's last access (its manifest's mtime) to now; returns now (unix s)."""
        now = time.time()
        try:
            os.utime(self.layout.entry_dir(name, fingerprint) / MANIFEST, (now, now))
        except OSError:  # evicted meanwhile, or not ours to touch: LRU order is best effort
            pass
        return now

    def present(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info if it is stored and sound (a broken one is quarantined). Caller holds
        the key's lock."""
        try:
            loaded = self.load(name, fingerprint)
        except BrokenEntry as e:
            self.quarantine_locked(name, fingerprint, None, str(e))
            return None
        return loaded[0] if loaded else None

    def quarantine(self, name: str, fingerprint: str, ino: int | None, reason: str) -> None:
        """:meth:`quarantine_locked`, taking the key's lock."""
        with self.layout.lock(name, fingerprint):
            self.quarantine_locked(name, fingerprint, ino, reason)

    def quarantine_locked(self, name: str, fingerprint: str, ino: int | None, reason: str) -> None:
        """Move the entry to ``quarantine/`` (with a ``reason.txt``) if it is still the one found
        bad (same blob inode ``ino``, or still broken when ``ino`` is None)."""
        d = self.layout.entry_dir(name, fingerprint)
        if ino is not None:
            try:
                if os.stat(d / BLOB).st_ino != ino:
                    return  # replaced by a fresh publish meanwhile
            except FileNotFoundError:
                return
        else:
            try:
                self.load(name, fingerprint)
                return  # absent, or repaired meanwhile
            except BrokenEntry:
                pass
        target = self.layout.quarantine_dir()
        try:
            os.replace(d, target)
        except FileNotFoundError:
            return
        (target / "reason.txt").write_text(f"{name}/{fingerprint}: {reason}\n")
        self.counters.count("quarantined")
        log.warning("quarantined corrupt entry",
                    extra={"entry": f"{name}/{fingerprint}", "reason": reason, "path": str(target)})

    def scan(self, prefix: str = "") -> list[EntryInfo]:
        """Every readable entry whose name starts with ``prefix``, sorted by name then fingerprint
        (broken ones are skipped)."""
        out = []
        for name_dir in sorted((self.layout.root / "entries").iterdir()):
            if not name_dir.name.startswith(prefix):
                continue
            try:
                fingerprints = sorted(p.name for p in name_dir.iterdir())
            except (FileNotFoundError, NotADirectoryError):
                continue
            for fp in fingerprints:
                if fp == UNKNOWN:  # never stored by us; never listed or matched
                    continue
                info = self.load_sound(name_dir.name, fp)
                if info is not None:
                    out.append(info)
        return out

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info on a HIT (its last access refreshed), ``None`` on a MISS (``UNKNOWN``,
        absent, or broken: then quarantined). Checks the manifest and blob size only."""
        loaded = None
        if fingerprint != UNKNOWN:
            try:
                loaded = self.load(name, fingerprint)
            except BrokenEntry as e:
                self.quarantine(name, fingerprint, None, str(e))
        if loaded is None:
            self.counters.count("misses")
            return None
        self.counters.count("hits")
        return replace(loaded[0], last_access=self.touch(name, fingerprint))

    def open(self, name: str, fingerprint: str) -> EntryReader | None:
        """The entry opened for reading (holding a read lease), ``None`` on a MISS."""
        if fingerprint == UNKNOWN:
            self.counters.count("misses")
            return None
        try:
            fd = os.open(self.layout.entry_dir(name, fingerprint) / BLOB, os.O_RDONLY)
        except FileNotFoundError:
            fd = -1
        loaded = None
        try:
            if fd >= 0:
                lock_shared(fd)
            loaded = self.load(name, fingerprint)
            if loaded is not None and (fd < 0 or loaded[1] != os.fstat(fd).st_ino):
                loaded = None  # evicted (and maybe republished) between open and lock: a miss
        except BrokenEntry as e:
            self.quarantine(name, fingerprint, None, str(e))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        if loaded is None:
            if fd >= 0:
                os.close(fd)
            self.counters.count("misses")
            return None
        info = replace(loaded[0], last_access=self.touch(name, fingerprint))
        return EntryReader(self, info, fd, loaded[1])
