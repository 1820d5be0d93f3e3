"""The kernel-cache store on an object store (S3 API), behind a local disk tier.

``warmserve cache serve --root DIR --store s3://BUCKET/PREFIX`` serves an :class:`S3KernelStore`:
the bucket is the store hosts share, ``DIR`` (a :class:`~kernel_cache_service.store.KernelStore`,
bounded by ``--max-bytes``, LRU) is this host's copy of what it read or published. It answers
the same calls with the same contract as the disk store, so the servicer, the client and the
runners do not know which one they talk to.

Objects (under ``PREFIX/kernel-cache/``)::

    entries/<name>/<fingerprint>    the blob (a file, or a directory as one tar); user metadata:
                                    size-bytes, sha256, format, producer, created, entry-version

One object per entry: S3 makes a PUT visible whole or not at all, so there is no manifest to
keep in step with a blob. The metadata travels with the bytes.

- **Publish**: the bytes are received and verified into the local tier's ``tmp/`` exactly as
  the disk store does (announced size and sha256), then uploaded with ``If-None-Match: *``. The
  conditional PUT is the commit point: exactly one of N racing publishers (threads, processes,
  hosts) wins and gets PUBLISHED; the others get ALREADY_PRESENT with the winner's entry (the
  winner's bytes are fetched into their local tier). The winner's copy is then placed in the
  local tier (when there is room; it stays in the bucket either way). A key this host's tier
  already holds answers ALREADY_PRESENT, as the disk store does, and its copy is uploaded if the
  bucket lacks it. An upload that fails (endpoint down, access denied) stores nothing anywhere.
- **Read-through**: a lookup, fetch or claim that misses the local tier GETs the object once,
  streaming it into ``tmp/`` while hashing it; only bytes whose size and sha256 match the
  object's metadata are placed in the local tier (making room LRU-first under ``--max-bytes``)
  and served. A HIT therefore always means verified bytes on this host's disk. When the tier has
  no room (every other entry is being read) the verified copy is served from ``tmp/`` and dropped.
- **Corruption**: bytes that do not match their metadata, or missing/garbled metadata, are
  never served: the read is a MISS (NOT_FOUND on Fetch), the bytes read are kept in the local
  tier's ``quarantine/`` with a ``reason.txt`` (as the disk store keeps a corrupt entry), the
  object is deleted from the bucket (conditionally on its ETag, so a fresh publish of the key is
  never removed) and a warning is logged; the next claim of the key builds and publishes it
  again. A corrupt local copy is quarantined by the disk tier and read again from the bucket.
- **Leases stay in the daemon** (the local tier's lease files, :mod:`kernel_cache_service.leases`):
  single flight holds among the runners of one host. A lease object in the bucket would need
  conditional overwrites (``If-Match``) for renewals and takeovers that not every S3-compatible
  store implements, every waiting claim would poll the bucket (requests cost money and add
  latency), and expiry across hosts would rest on their wall clocks. Without it, hosts that
  start cold at the same moment may each build a program once; the conditional publish keeps
  exactly one copy and everyone fetches that one, so the price is bounded (one build per host
  per key, only when they race) and correctness does not depend on it.
- ``list`` and ``evict`` act on the bucket (and the local tier); ``stat`` reports the local tier
  (``entries``, ``total_bytes`` bounded by ``max_bytes``) with this store's counters.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

from kernel_cache_service.artifact import CHUNK_BYTES, CorruptArtifact
from kernel_cache_service.entry import (
    ALREADY_PRESENT,
    FORMATS,
    PUBLISHED,
    REJECTED,
    EntryInfo,
    PublishResult,
)
from kernel_cache_service.fingerprint import UNKNOWN
from kernel_cache_service.keys import validate_key, validate_part, validate_prefix
from kernel_cache_service.leases import HIT, Claim, Lease, validate_ttl
from kernel_cache_service.locks import OwnedTempDir
from kernel_cache_service.store import (
    BLOB,
    COUNTERS,
    EntryReader,
    KernelStore,
    _Broken,
    empty_artifact,
    finish_temp_entry,
    storage_error,
)
from services.errors import InvalidArgument, WarmserveError
from services.s3 import CorruptObject, ObjectHead, ObjectStore, decode_meta, encode_meta

log = logging.getLogger(__name__)

#: The kernel cache's folder under the ``--store`` prefix, and its entries' folder in it.
FOLDER, ENTRIES = "kernel-cache", "entries"
ENTRY_VERSION = "1"
#: Counters this store keeps itself; the others come from the local tier (see :meth:`S3KernelStore.stat`).
_OWN = ("hits", "misses", "publishes")


def entry_key(name: str, fingerprint: str) -> str:
    """The object key of an entry, relative to ``PREFIX/kernel-cache/``."""
    return f"{ENTRIES}/{name}/{fingerprint}"


def entry_metadata(info: EntryInfo) -> dict[str, str]:
    """The user metadata an entry's object carries besides ``size-bytes`` and ``sha256``."""
    return {"entry-version": ENTRY_VERSION, "format": info.format, "producer": encode_meta(info.producer),
            "created": repr(float(info.created))}


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
                     format=fmt, last_access=created)


class _DetachedReader(EntryReader):
    """A reader over a verified copy in ``tmp/`` that the local tier had no room to keep; the
    copy is removed when the reader closes."""

    def __init__(self, store: KernelStore, info: EntryInfo, tmp: OwnedTempDir) -> None:
        fd = os.open(tmp.path / BLOB, os.O_RDONLY)
        super().__init__(store, info, fd, os.fstat(fd).st_ino)
        self._tmp = tmp

    def close(self) -> None:
        """Close the file and remove the copy."""
        super().close()
        self._tmp.remove()


class _CountingReader:
    """An :class:`EntryReader` of the local tier whose outcome (hit or miss) is counted by the
    :class:`S3KernelStore` (the reader's own counts go to the local tier)."""

    def __init__(self, store: S3KernelStore, reader: EntryReader) -> None:
        self._s3, self._reader = store, reader
        self.info = reader.info

    @property
    def verified(self) -> bool:
        """True once every byte was read and matched the entry's sha256."""
        return self._reader.verified

    @property
    def inode(self) -> int:
        """The blob's inode (identifies the local copy)."""
        return self._reader.inode

    def chunks(self, chunk_bytes: int = CHUNK_BYTES):
        """As :meth:`EntryReader.chunks`; a corrupt local copy (quarantined by the local tier)
        raises :class:`CorruptArtifact` and counts a miss."""
        try:
            yield from self._reader.chunks(chunk_bytes)
        except CorruptArtifact:
            self._s3._count("misses")
            raise
        self._s3._count("hits")

    def close(self) -> None:
        """Release the read lease (and a detached copy)."""
        self._reader.close()

    def __enter__(self) -> _CountingReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class S3KernelStore:
    """The kernel-cache store in ``objects`` (an :class:`~services.s3.ObjectStore` at
    ``PREFIX/kernel-cache``) behind a local :class:`KernelStore` at ``root`` with a budget of
    ``max_bytes`` bytes (0 = unlimited). Same methods and answers as :class:`KernelStore` (see
    the module docstring for how each uses the bucket). Bucket errors raise ``Unavailable``
    (endpoint down, timeouts) or ``FailedPrecondition`` (access denied, bucket gone) with one
    sentence; nothing is stored by a failed publish. Thread-safe; process-safe on one host
    (processes sharing ``root`` coordinate through its locks, hosts through the bucket).
    """

    def __init__(self, root: str | Path, max_bytes: int = 0, *, objects: ObjectStore) -> None:
        self.local = KernelStore(root, max_bytes=max_bytes)
        self.objects = objects
        self.root, self.max_bytes, self.swept = self.local.root, self.local.max_bytes, self.local.swept
        self.url = objects.url()
        self._counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()

    @classmethod
    def open_url(cls, url: str, root: str | Path, max_bytes: int = 0, *, check: bool = True,
                 **store_kwargs) -> S3KernelStore:
        """The store at ``url`` (``s3://BUCKET/PREFIX``; its entries go under
        ``PREFIX/kernel-cache/``) with its local tier at ``root``. With ``check``, the bucket is
        probed first (:meth:`services.s3.ObjectStore.check`). Raises ``InvalidArgument`` for a
        malformed URL, an unreachable endpoint, a missing bucket, denied access or an endpoint
        that ignores conditional writes."""
        objects = ObjectStore.from_url(url, **store_kwargs)
        if check:
            objects.check()
        return cls(root, max_bytes, objects=objects.child(FOLDER))

    # ---------------------------------------------------------------- bookkeeping

    def _count(self, what: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[what] += n

    def sweep(self) -> int:
        """The local tier's sweep (dead writers' temp data, trash, expired leases)."""
        return self.local.sweep()

    def _drop_remote(self, name: str, fingerprint: str, etag: str | None, reason: str, *, count: bool = True) -> None:
        """Delete a corrupt object from the bucket (only the version ``etag`` when given), count
        it as quarantined (with ``count``) and log why. A failed delete is logged, not raised:
        the read stays a miss."""
        try:
            deleted = self.objects.delete(entry_key(name, fingerprint), etag=etag)
        except WarmserveError as e:
            deleted = False
            log.warning("could not delete a corrupt object", extra={"entry": f"{name}/{fingerprint}", "error": str(e)})
        if count:
            self._count("quarantined")
        log.warning("quarantined corrupt entry from the object store",
                    extra={"entry": f"{name}/{fingerprint}", "reason": reason, "store": self.url,
                           "deleted": deleted})

    def _quarantine_download(self, name: str, fingerprint: str, tmp: OwnedTempDir, etag: str, reason: str) -> None:
        """Keep the corrupt bytes just read in the local tier's ``quarantine/`` (with a
        ``reason.txt``) and drop the object from the bucket."""
        target = self.root / "quarantine" / f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(tmp.path, target)
            (target / "reason.txt").write_text(f"{name}/{fingerprint}: {reason} (read from {self.url})\n")
        except OSError as e:
            log.warning("could not keep the corrupt bytes", extra={"entry": f"{name}/{fingerprint}", "error": str(e)})
        self._drop_remote(name, fingerprint, etag, reason)

    def _quarantine(self, name: str, fingerprint: str, ino: int | None, reason: str) -> None:
        """Bytes that verified but are unusable (a "dir" entry that does not unpack): quarantine
        the local copy (when it is still the one read, ``ino``) and drop the shared object; the
        entry counts once as quarantined."""
        before = self._local_count("quarantined")
        self.local._quarantine(name, fingerprint, ino, reason)
        self._drop_remote(name, fingerprint, None, reason, count=self._local_count("quarantined") == before)

    def _local_count(self, what: str) -> int:
        with self.local._counter_lock:
            return self.local._counters[what]

    # ---------------------------------------------------------------- read-through

    def _pull(self, name: str, fingerprint: str) -> tuple[EntryInfo | None, OwnedTempDir | None]:
        """The entry on this host: the local tier's, else the object fetched, verified and placed
        (see :meth:`_pull_locked`)."""
        with self.local._lock(name, fingerprint):
            return self._pull_locked(name, fingerprint)

    def _pull_locked(self, name: str, fingerprint: str) -> tuple[EntryInfo | None, OwnedTempDir | None]:
        """``(info, None)`` when the entry is (now) in the local tier; ``(info, tmp)`` when it was
        fetched and verified but the tier had no room (the caller reads ``tmp`` and removes it);
        ``(None, None)`` when the bucket lacks it or its object is corrupt (then quarantined).
        The caller holds the key's lock. Raises ``Unavailable`` / ``FailedPrecondition`` when the
        bucket cannot be read, ``ResourceExhausted`` / ``FailedPrecondition`` when the local disk
        cannot hold the copy."""
        present = self.local._present(name, fingerprint)
        if present is not None:
            return present, None
        what = f"fetching {name}/{fingerprint[:12]} from {self.url}"
        try:
            tmp = OwnedTempDir(self.root / "tmp")
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
                    self.local._admit(tmp.path, info) is not None:
                keep = True
                log.info("serving an entry the local tier has no room for", extra={"entry": f"{name}/{fingerprint}"})
                return info, tmp
            log.info("fetched from the object store", extra={"entry": f"{name}/{fingerprint}",
                                                             "bytes": info.size_bytes, "store": self.url})
            return replace(info, last_access=self.local._touch(name, fingerprint)), None
        finally:
            if not keep:
                tmp.remove()

    # ---------------------------------------------------------------- reads

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info on a HIT (verified bytes in the local tier, fetched from the bucket
        when missing there), ``None`` on a MISS. Raises ``InvalidArgument`` for a bad key."""
        validate_key(name, fingerprint)
        info = None
        if fingerprint != UNKNOWN:
            info = self.local.lookup(name, fingerprint)
            if info is None:
                info, detached = self._pull(name, fingerprint)
                if detached is not None:
                    detached.remove()
        self._count("hits" if info is not None else "misses")
        return info

    def open(self, name: str, fingerprint: str) -> _CountingReader | None:
        """Open an entry for reading (a read lease on the local copy), or ``None`` on a MISS;
        close the reader (``with store.open(...) as r``)."""
        validate_key(name, fingerprint)
        reader = None
        if fingerprint != UNKNOWN:
            reader = self.local.open(name, fingerprint)
            if reader is None:
                info, detached = self._pull(name, fingerprint)
                if detached is not None:
                    reader = _DetachedReader(self.local, info, detached)
                elif info is not None:
                    reader = self.local.open(name, fingerprint)
        if reader is None:
            self._count("misses")
            return None
        return _CountingReader(self, reader)

    #: Same as the disk store's, over this store's :meth:`open` and :meth:`_quarantine`.
    fetch = KernelStore.fetch

    def list(self, prefix: str = "") -> list[EntryInfo]:
        """The bucket's entries whose name starts with ``prefix``, sorted by name then
        fingerprint (one HEAD each; entries with unusable metadata are skipped). ``last_access``
        is the local tier's when it holds the entry, else the object's creation."""
        prefix = validate_prefix(prefix)
        out = []
        for obj in self.objects.list(f"{ENTRIES}/{prefix}"):
            parts = obj.key.split("/")
            if len(parts) != 3:
                continue
            name, fingerprint = parts[1], parts[2]
            try:
                validate_key(name, fingerprint)
            except InvalidArgument:
                continue
            if fingerprint == UNKNOWN or not name.startswith(prefix):
                continue
            head = self.objects.head(obj.key)
            try:
                info = entry_from_head(name, fingerprint, head) if head is not None else None
            except (ValueError, TypeError):
                info = None
            if info is None:
                continue
            try:
                held = self.local._load(name, fingerprint)
            except _Broken:
                held = None
            if held is not None:
                info = replace(info, last_access=held[0].last_access)
            out.append(info)
        return sorted(out, key=lambda e: (e.name, e.fingerprint))

    def stat(self) -> dict:
        """As :meth:`KernelStore.stat`: ``root``, ``entries`` and ``total_bytes`` of the local
        tier (what ``max_bytes`` bounds), ``hits``/``misses``/``publishes`` as this store
        answered them, ``quarantined``/``evictions``/``claims`` of both tiers, and the lease
        counters and ``leases`` of the local tier (leases live there)."""
        s = self.local.stat()
        with self._counter_lock:
            own = {k: self._counters[k] for k in COUNTERS}
        for k in _OWN:
            s[k] = own[k]
        for k in ("quarantined", "evictions", "claims"):
            s[k] += own[k]
        return s

    def leases(self) -> list[Lease]:
        """The build leases held now (they live in the local tier)."""
        return self.local.leases()

    # ---------------------------------------------------------------- single-flight builds

    def claim(self, name: str, fingerprint: str, holder: str = "", ttl_s: float | None = None) -> Claim:
        """HIT when the entry is on this host or in the bucket (fetched and verified first),
        else the local tier's OWNER or WAIT (leases live in the daemon, see the module
        docstring). Raises as :meth:`KernelStore.claim`, and ``Unavailable`` /
        ``FailedPrecondition`` when the bucket cannot be read."""
        validate_key(name, fingerprint)
        if fingerprint == UNKNOWN:
            raise InvalidArgument(f"{name}/UNKNOWN cannot be claimed: unknown keys are never stored")
        validate_ttl(ttl_s)
        info, detached = self._pull(name, fingerprint)
        if detached is not None:
            detached.remove()
        if info is not None:
            self._count("claims")
            return Claim(HIT, entry=info)
        return self.local.claim(name, fingerprint, holder, ttl_s)

    def renew(self, lease: Lease) -> Lease | None:
        """The local tier's :meth:`KernelStore.renew`."""
        return self.local.renew(lease)

    def release(self, lease: Lease) -> bool:
        """The local tier's :meth:`KernelStore.release`."""
        return self.local.release(lease)

    def wait_build(self, name: str, fingerprint: str, timeout_s: float | None = None,
                   poll_s: float = 0.1) -> Claim | None:
        """The local tier's :meth:`KernelStore.wait_build`: a build on this host ends in PUBLISHED
        (placed locally) or LEASE_EXPIRED (claim again: the claim then finds what another host
        published, or builds)."""
        return self.local.wait_build(name, fingerprint, timeout_s, poll_s)

    # ---------------------------------------------------------------- writes

    def precheck(self, name: str, fingerprint: str, size: int | None = None) -> PublishResult | None:
        """As :meth:`KernelStore.precheck`, asking the bucket (one HEAD): ALREADY_PRESENT when it
        holds the key. An object with unusable metadata is dropped here, so the bytes that follow
        can replace it."""
        validate_key(name, fingerprint)
        if fingerprint == UNKNOWN:
            return PublishResult(REJECTED, "the fingerprint is UNKNOWN; unknown keys are never stored")
        if size == 0:
            raise empty_artifact(name, fingerprint)
        if size is not None and self.max_bytes and size > self.max_bytes:
            return PublishResult(
                REJECTED, f"artifact of {size} bytes exceeds the store budget of {self.max_bytes} bytes")
        try:
            head = self.objects.head(entry_key(name, fingerprint))
        except WarmserveError as e:
            raise type(e)(f"publishing {name}/{fingerprint[:12]}: {e}; nothing was stored") from e
        if head is None:
            return None
        try:
            return PublishResult(ALREADY_PRESENT, "", entry_from_head(name, fingerprint, head))
        except (ValueError, TypeError) as e:
            self._drop_remote(name, fingerprint, head.etag, f"unusable metadata: {e}")
            return None

    #: Same as the disk store's: the bytes go to the local tier's ``tmp/``; :meth:`_install` commits.
    begin_publish = KernelStore.begin_publish
    publish = KernelStore.publish

    def _install(self, tmp: Path, info: EntryInfo) -> PublishResult:
        """Commit the verified temp entry ``tmp``: the conditional upload decides (see the module
        docstring), then the local tier keeps a copy when it has room."""
        name, fp = info.name, info.fingerprint
        what = f"publishing {name}/{fp[:12]} to {self.url}"
        with self.local._lock(name, fp):
            present = self.local._present(name, fp)
            if present is not None:
                self._upload_held(present)
                self.local._lease_file(name, fp).remove()
                return PublishResult(ALREADY_PRESENT, "", present)
            for _ in range(2):
                if self.objects.put_file(entry_key(name, fp), tmp / BLOB, sha256=info.sha256,
                                         metadata=entry_metadata(info), what=what):
                    break
                winner, detached = self._pull_locked(name, fp)  # another publisher won: take theirs
                if detached is not None:
                    detached.remove()
                if winner is not None:
                    self.local._lease_file(name, fp).remove()
                    return PublishResult(ALREADY_PRESENT, "", winner)
                # the object that won was corrupt (now dropped) or is gone again: try once more
            else:
                return PublishResult(REJECTED, f"{self.url} keeps refusing {name}/{fp[:12]} with an object that "
                                               "cannot be read back")
            if self.local._admit(tmp, info) is not None:
                log.info("published to the object store only: no room in the local tier",
                         extra={"entry": f"{name}/{fp}", "bytes": info.size_bytes})
            self.local._lease_file(name, fp).remove()  # the build is done: waiters see PUBLISHED
        self._count("publishes")
        log.info("published", extra={"entry": f"{name}/{fp}", "bytes": info.size_bytes, "format": info.format,
                                     "store": self.url})
        return PublishResult(PUBLISHED, "", replace(info, last_access=info.created))

    def _upload_held(self, info: EntryInfo) -> None:
        """Upload the local tier's copy of ``info`` when the bucket lacks it (best effort: a
        failure is logged; the local answer stands)."""
        blob = self.local._entry_dir(info.name, info.fingerprint) / BLOB
        try:
            if self.objects.put_file(entry_key(info.name, info.fingerprint), blob, sha256=info.sha256,
                                     metadata=entry_metadata(info)):
                log.info("uploaded the local copy the object store lacked",
                         extra={"entry": f"{info.name}/{info.fingerprint}", "store": self.url})
        except (WarmserveError, OSError) as e:
            log.warning("could not upload the local copy", extra={"entry": f"{info.name}/{info.fingerprint}",
                                                                  "error": str(e)})

    def evict(self, name: str | None = None, fingerprint: str | None = None, *,
              all: bool = False) -> tuple[int, int]:
        """Evict one entry, every fingerprint of ``name``, or with ``all`` everything, from the
        bucket and the local tier (whose copies being read are skipped there, and whose
        ``quarantine/`` ``all`` empties), with their build leases. Returns ``(entries evicted,
        bytes freed)`` counting each key once. Raises ``InvalidArgument`` as the disk store does."""
        if all:
            if name or fingerprint:
                raise InvalidArgument("evict all takes no name or fingerprint")
            prefix = f"{ENTRIES}/"
        elif name:
            validate_part(name, "name")
            if fingerprint:
                validate_part(fingerprint, "fingerprint")
            prefix = f"{ENTRIES}/{name}/{fingerprint or ''}"
        else:
            raise InvalidArgument("evict needs a name, a name and a fingerprint, or all")

        def wanted(n: str, f: str) -> bool:
            return all or (n == name and (not fingerprint or f == fingerprint))

        remote = {}
        for obj in self.objects.list(prefix):
            parts = obj.key.split("/")
            if len(parts) == 3 and wanted(parts[1], parts[2]):
                remote[(parts[1], parts[2])] = obj.size
        before = {(e.name, e.fingerprint): e.size_bytes for e in self.local.list(name or "") if wanted(e.name, e.fingerprint)}
        self.local.evict(name, fingerprint, all=all)
        after = {(e.name, e.fingerprint) for e in self.local.list(name or "") if wanted(e.name, e.fingerprint)}
        removed_local = {k: size for k, size in before.items() if k not in after}
        removed_remote = {k: size for k, size in remote.items() if self.objects.delete(entry_key(*k))}
        self._count("evictions", len(set(removed_remote) - set(removed_local)))
        keys = set(removed_local) | set(removed_remote)
        return len(keys), sum(max(removed_local.get(k, 0), removed_remote.get(k, 0)) for k in keys)
