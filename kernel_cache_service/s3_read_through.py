"""The S3 store's local tier reads through to the bucket: an entry missing on this host is
downloaded once, verified and placed in the tier; corrupt objects are quarantined and dropped
(``docs/architecture.md`` §6.1, "read-through" and "corruption")."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace

from kernel_cache_service.artifact import CHUNK_BYTES, CorruptArtifact
from kernel_cache_service.counters import Counters
from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.layout import BLOB
from kernel_cache_service.locks import OwnedTempDir
from kernel_cache_service.publish import finish_temp_entry, storage_error
from kernel_cache_service.reads import EntryReader
from kernel_cache_service.s3_entries import entry_from_head, entry_key
from kernel_cache_service.store import KernelStore
from kernel_cache_service.store_api import OpenEntry
from services.errors import WarmserveError
from services.s3 import ObjectStore
from services.s3_errors import CorruptObject

log = logging.getLogger(__name__)


class DetachedReader(EntryReader):
    """A reader over a verified copy in ``tmp/`` that the local tier ``local`` had no room to
    keep; the copy is removed when the reader closes."""

    def __init__(self, local: KernelStore, info: EntryInfo, tmp: OwnedTempDir) -> None:
        fd = os.open(tmp.path / BLOB, os.O_RDONLY)
        super().__init__(local.reads, info, fd, os.fstat(fd).st_ino)
        self._tmp = tmp

    def close(self) -> None:
        """Close the file and remove the copy."""
        super().close()
        self._tmp.remove()


class CountingReader:
    """A reader of the local tier whose outcome (hit or miss) is counted in ``counters`` (the S3
    store's; the reader's own counts go to the local tier)."""

    def __init__(self, counters: Counters, reader: OpenEntry) -> None:
        self._counters, self._reader = counters, reader
        self.info = reader.info

    @property
    def verified(self) -> bool:
        """True once every byte was read and matched the entry's sha256."""
        return self._reader.verified

    @property
    def inode(self) -> int:
        """The blob's inode (identifies the local copy)."""
        return self._reader.inode

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """As :meth:`EntryReader.chunks`; a corrupt local copy (quarantined by the local tier)
        raises :class:`CorruptArtifact` and counts a miss."""
        try:
            yield from self._reader.chunks(chunk_bytes)
        except CorruptArtifact:
            self._counters.count("misses")
            raise
        self._counters.count("hits")

    def close(self) -> None:
        """Release the read lease (and a detached copy)."""
        self._reader.close()

    def __enter__(self) -> CountingReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReadThrough:
    """The local tier ``local`` in front of ``objects`` (the entries' bucket folder, shown as
    ``url``); quarantines are counted in ``counters`` (the S3 store's)."""

    def __init__(self, local: KernelStore, objects: ObjectStore, counters: Counters) -> None:
        self.local, self.objects, self.counters = local, objects, counters
        self.url = objects.url()

    def drop_remote(self, name: str, fingerprint: str, etag: str | None, reason: str, *, count: bool = True) -> None:
        """Delete a corrupt object from the bucket (only the version ``etag`` when given), count
        it as quarantined (with ``count``) and log why. A failed delete is logged, not raised:
        the read stays a miss."""
        try:
            deleted = self.objects.delete(entry_key(name, fingerprint), etag=etag)
        except WarmserveError as e:
            deleted = False
            log.warning("could not delete a corrupt object", extra={"entry": f"{name}/{fingerprint}", "error": str(e)})
        if count:
            self.counters.count("quarantined")
        log.warning("quarantined corrupt entry from the object store",
                    extra={"entry": f"{name}/{fingerprint}", "reason": reason, "store": self.url,
                           "deleted": deleted})

    def _quarantine_download(self, name: str, fingerprint: str, tmp: OwnedTempDir, etag: str, reason: str) -> None:
        """Keep the corrupt bytes just read in the local tier's ``quarantine/`` (with a
        ``reason.txt``) and drop the object from the bucket."""
        target = self.local.layout.quarantine_dir()
        try:
            os.replace(tmp.path, target)
            (target / "reason.txt").write_text(f"{name}/{fingerprint}: {reason} (read from {self.url})\n")
        except OSError as e:
            log.warning("could not keep the corrupt bytes", extra={"entry": f"{name}/{fingerprint}", "error": str(e)})
        self.drop_remote(name, fingerprint, etag, reason)

    def pull(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry on this host (the local tier's, else fetched, verified and placed: see
        :meth:`pull_locked`), ``None`` on a MISS; a copy the tier had no room for is dropped."""
        with self.local.layout.lock(name, fingerprint):
            info, detached = self.pull_locked(name, fingerprint)
        if detached is not None:
            detached.remove()
        return info

    def open(self, name: str, fingerprint: str) -> OpenEntry | None:
        """The entry opened for reading from the local tier, fetched there first when missing
        (or read from a detached copy when the tier has no room); ``None`` on a MISS."""
        reader = self.local.open(name, fingerprint)
        if reader is not None:
            return reader
        with self.local.layout.lock(name, fingerprint):
            info, detached = self.pull_locked(name, fingerprint)
        if detached is not None:
            return DetachedReader(self.local, info, detached)
        return self.local.open(name, fingerprint) if info is not None else None

    def pull_locked(self, name: str, fingerprint: str) -> tuple[EntryInfo | None, OwnedTempDir | None]:
        """``(info, None)`` when the entry is (now) in the local tier; ``(info, tmp)`` when it was
        fetched and verified but the tier had no room (the caller reads ``tmp`` and removes it);
        ``(None, None)`` when the bucket lacks it or its object is corrupt (then quarantined).
        The caller holds the key's lock. Raises ``Unavailable`` / ``FailedPrecondition`` when the
        bucket cannot be read, ``ResourceExhausted`` / ``FailedPrecondition`` when the local disk
        cannot hold the copy."""
        present = self.local.reads.present(name, fingerprint)
        if present is not None:
            return present, None
        what = f"fetching {name}/{fingerprint[:12]} from {self.url}"
        try:
            tmp = OwnedTempDir(self.local.root / "tmp")
        except OSError as e:
            raise storage_error(e, what) from e
        keep = False
        try:
            try:
                with open(tmp.path / BLOB, "wb") as f:
                    head = self.objects.download(entry_key(name, fingerprint), f)
                if head is None:
                    return None, None
                info = entry_from_head(name, fingerprint, head)
                if info.size_bytes == 0:
                    raise ValueError("an empty object is not a program")
            except CorruptObject as e:
                self._quarantine_download(name, fingerprint, tmp, e.etag, str(e))
                return None, None
            except (ValueError, TypeError) as e:
                self._quarantine_download(name, fingerprint, tmp, head.etag, f"unusable metadata: {e}")
                return None, None
            except OSError as e:
                raise storage_error(e, what) from e
            try:
                finish_temp_entry(tmp.path, info)
            except OSError as e:
                raise storage_error(e, what) from e
            if self.local.max_bytes and info.size_bytes > self.local.max_bytes or \
                    self.local.budget.admit(tmp.path, info) is not None:
                keep = True
                log.info("serving an entry the local tier has no room for", extra={"entry": f"{name}/{fingerprint}"})
                return info, tmp
            log.info("fetched from the object store", extra={"entry": f"{name}/{fingerprint}",
                                                             "bytes": info.size_bytes, "store": self.url})
            return replace(info, last_access=self.local.reads.touch(name, fingerprint)), None
        finally:
            if not keep:
                tmp.remove()
