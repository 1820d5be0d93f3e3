"""The on-disk kernel-cache store: compiled-program artifacts keyed by (name, fingerprint).

Used directly (embedded, no daemon) and by the daemon's servicer. Many processes on one host may
share one root. Layout under ``root``::

    entries/<name>/<fingerprint>/blob            the artifact (a file, or a directory as one tar)
    entries/<name>/<fingerprint>/manifest.json   EntryInfo; its mtime is the last-access time
    locks/<name>/<fingerprint>.lock              per-entry filelock (publish / evict / quarantine /
                                                 claim); empty, never deleted (unlinking a lock file
                                                 that others wait on would break mutual exclusion)
    leases/<name>/<fingerprint>.json             the key's build lease, while someone builds it
    budget.lock                                  serialises "make room + place" under a byte budget
    tmp/      private, flock-owned directories of publishes in progress
    trash/    evicted entries being deleted
    quarantine/  entries found corrupt, kept for inspection (removed by ``evict(all=True)``)

Mechanisms (``docs/architecture.md``, "Kernel-cache store and publish protocol"):

- **Atomic publish**: bytes stream into ``tmp/<owned dir>/blob`` while being counted and hashed
  (never held in memory); size and sha256 are checked against what the sender announced; the
  manifest is written next to the blob; then, holding the entry's filelock, one ``os.replace``
  renames the whole directory to ``entries/<name>/<fingerprint>``. Readers see all or nothing;
  the first publisher of a key wins and later ones get ``ALREADY_PRESENT``.
- **Crash safety**: a writer killed mid-publish leaves only its ``tmp/`` directory; the kernel
  drops its ``flock`` and the next store that starts removes it (live writers keep theirs).
- **Read leases**: a reader holds ``LOCK_SH`` on the blob while it reads; eviction needs
  ``LOCK_EX | LOCK_NB``, so an entry being read is never evicted (it is skipped).
- **LRU under a byte budget** (``max_bytes`` > 0): every lookup/read touches the manifest's mtime
  (no blob rewrite); before a publish is placed, least recently used entries not being read are
  evicted until the new one fits, else the publish is REJECTED. The store never goes over budget
  through its own publishes.
- **Integrity**: the sha256 of every read is checked at its end; a mismatch, a wrong blob size
  or an unreadable manifest moves the entry to ``quarantine/`` and reports a MISS.
- ``UNKNOWN`` fingerprints are never stored (REJECTED) and never matched (MISS).
- **Single-flight builds**: :meth:`KernelStore.claim` answers HIT, OWNER (a build lease) or
  WAIT; a publish ends the key's lease; see :mod:`kernel_cache_service.leases`.

Blobs are not fsynced: after a power loss a torn blob fails its integrity check and is
quarantined, which for a cache is the same as a miss. Counters (hits, misses, ...) are per
``KernelStore`` instance, i.e. since the daemon started.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import filelock

from kernel_cache_service.artifact import (
    CHUNK_BYTES,
    CorruptArtifact,
    HashingWriter,
    install_stream,
    iter_file,
    pack_directory,
)
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
from kernel_cache_service.leases import (
    HIT,
    LEASE_EXPIRED,
    OWNER,
    PUBLISHED_EVENT,
    WAIT,
    Claim,
    Lease,
    LeaseFile,
    validate_ttl,
)
from kernel_cache_service.locks import OwnedTempDir, entry_lock, lock_shared, sweep_unowned, try_exclusive
from services.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, WarmserveError
from services.fsmode import default_dir_mode, default_file_mode

log = logging.getLogger(__name__)

BLOB = "blob"
MANIFEST = "manifest.json"
#: Counters since the store object was made (the daemon's: since it started).
COUNTERS = ("hits", "misses", "publishes", "evictions", "quarantined", "claims", "waits", "builds", "takeovers")


class _Broken(Exception):
    """Internal: an entry directory exists but its manifest or blob is unusable."""


class EntryReader:
    """An entry opened for reading, holding a read lease (``LOCK_SH`` on the blob) until closed.

    Get one from :meth:`KernelStore.open`; use it as a context manager. ``info`` describes the
    entry, ``inode`` identifies its blob. :meth:`chunks` yields the blob and checks its sha256 at
    the end (``verified`` is then True).
    """

    def __init__(self, store: KernelStore, info: EntryInfo, fd: int, ino: int) -> None:
        self.info = info
        self.verified = False
        self._store, self._fd, self.inode = store, fd, ino

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The blob in chunks of at most ``chunk_bytes`` bytes (the last may be shorter).

        After the last chunk the size and sha256 are compared with the manifest; on a mismatch
        the entry is quarantined and :class:`CorruptArtifact` (a ``NotFound``) is raised.
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
            self._store._quarantine(info.name, info.fingerprint, self.inode, reason)
            self._store._count("misses")
            raise CorruptArtifact(f"entry {info.name}/{info.fingerprint} is corrupt and was quarantined")
        self.verified = True
        self._store._count("hits")

    def close(self) -> None:
        """Release the read lease."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def storage_error(e: OSError, what: str) -> WarmserveError:
    """The error a client sees for a failed write into the store (nothing of it is kept): a full
    disk or quota (``ENOSPC``, ``EDQUOT``) is ``ResourceExhausted``; anything else (a read-only
    root, permissions, I/O) ``FailedPrecondition``; one sentence naming ``what`` and the cause."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{what}: no space left on the kernel-cache disk ({e.strerror}); nothing was stored")
    return FailedPrecondition(f"{what}: cannot write the kernel-cache store ({e.strerror or e}); nothing was stored")


def empty_artifact(name: str, fingerprint: str) -> InvalidArgument:
    """The refusal of a 0-byte artifact (no program is empty)."""
    return InvalidArgument(f"{name}/{fingerprint[:12]}: an empty artifact (0 bytes) is not a program; "
                           "nothing was stored")


def finish_temp_entry(directory: Path, info: EntryInfo) -> None:
    """Make ``directory`` (holding the verified ``blob``) a complete entry for ``info``: write
    its manifest (mtime = ``info.created``: last access = creation, same clock) and give blob,
    manifest and directory the default modes. Raises ``OSError`` when the disk refuses."""
    manifest = directory / MANIFEST
    manifest.write_bytes(info.manifest_bytes())
    os.utime(manifest, (info.created, info.created))
    os.chmod(manifest, default_file_mode())
    os.chmod(directory / BLOB, default_file_mode())
    os.chmod(directory, default_dir_mode())


class PendingPublish:
    """An artifact on its way into the store; get one from :meth:`KernelStore.begin_publish`.

    :meth:`write` bytes (any chunking), then :meth:`commit`. Leaving the ``with`` block without a
    commit discards everything. Bytes beyond the announced size are dropped and make the commit
    REJECTED; so do a size or sha256 different from the announced ones.
    """

    def __init__(self, store: KernelStore, name: str, fingerprint: str, *, fmt: str, producer: str,
                 size: int | None, sha256: str | None) -> None:
        self.name, self.fingerprint, self.fmt, self.producer = name, fingerprint, fmt, producer
        self._expected_size, self._expected_sha = size, sha256
        self._store = store
        self._what = f"publishing {name}/{fingerprint[:12]}"
        self._tmp = None
        try:
            self._tmp = OwnedTempDir(store.root / "tmp")
            self._file = open(self._tmp.path / BLOB, "wb")  # closed by commit/abort
        except OSError as e:
            if self._tmp is not None:
                self._tmp.remove()
            raise storage_error(e, self._what) from e
        self._sink = HashingWriter(self._file)
        self.overflowed = False
        self._finished = False

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._sink.size

    def write(self, data: bytes) -> int:
        """Append ``data``; returns ``len(data)`` (file-like, so ``pack_directory`` can write here)."""
        if self._expected_size is not None and self._sink.size + len(data) > self._expected_size:
            self.overflowed = True
        if not self.overflowed:
            try:
                self._sink.write(data)
            except OSError as e:
                self.abort()
                raise storage_error(e, self._what) from e
        return len(data)

    def _rejection(self) -> str | None:
        size, sha = self._sink.size, self._sink.sha256
        if self.fingerprint == UNKNOWN:
            return "the fingerprint is UNKNOWN; unknown keys are never stored"
        if self.overflowed:
            return f"more bytes arrived than the {self._expected_size} announced"
        if self._expected_size is not None and size != self._expected_size:
            return f"received {size} bytes, {self._expected_size} were announced"
        if self._expected_sha is not None and sha != self._expected_sha:
            return f"sha256 of the received bytes is {sha}, {self._expected_sha} was announced"
        if self._store.max_bytes and size > self._store.max_bytes:
            return f"artifact of {size} bytes exceeds the store budget of {self._store.max_bytes} bytes"
        return None

    def commit(self) -> PublishResult:
        """Verify and make the entry visible; PUBLISHED, ALREADY_PRESENT or REJECTED (with reason).
        Raises ``InvalidArgument`` for an empty artifact (0 bytes received, as announced), which
        is discarded like a rejected one."""
        if self._finished:
            raise RuntimeError("publish already finished")
        self._finished = True
        try:
            try:
                self._file.close()
            except OSError as e:  # buffered bytes hit a full disk
                raise storage_error(e, self._what) from e
            reason = self._rejection()
            if reason is not None:
                return PublishResult(REJECTED, reason)
            if self._sink.size == 0:
                raise empty_artifact(self.name, self.fingerprint)
            info = EntryInfo(self.name, self.fingerprint, self._sink.size, self._sink.sha256,
                             created=time.time(), producer=self.producer, format=self.fmt)
            try:
                finish_temp_entry(self._tmp.path, info)
                return self._store._install(self._tmp.path, info)
            except OSError as e:
                raise storage_error(e, self._what) from e
        finally:
            self._tmp.remove()

    def abort(self) -> None:
        """Discard the bytes written so far."""
        if not self._finished:
            self._finished = True
            try:
                self._file.close()
            except OSError:  # the buffered tail could not be written: it is discarded anyway
                pass
            finally:
                self._tmp.remove()

    def __enter__(self) -> PendingPublish:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


class KernelStore:
    """A kernel-cache store rooted at ``root`` (created if absent) with a byte budget.

    ``max_bytes``: budget for the sum of blob sizes in bytes; 0 means unlimited. Raises
    ``InvalidArgument`` for a negative budget or a root that cannot be created. Creating a store
    removes leftovers of dead writers (``tmp/``) and interrupted evictions (``trash/``);
    ``swept`` says how many were removed. Thread-safe; process-safe on one host.
    """

    def __init__(self, root: str | Path, max_bytes: int = 0) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.root = Path(root).absolute()
        self.max_bytes = max_bytes
        try:
            for sub in ("entries", "locks", "leases", "tmp", "trash", "quarantine"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgument(f"cannot use {self.root} as a kernel-cache root: {e.strerror}") from e
        self._counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self.swept = self.sweep()

    # ---------------------------------------------------------------- bookkeeping

    def _count(self, what: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[what] += n

    def _entry_dir(self, name: str, fingerprint: str) -> Path:
        return self.root / "entries" / name / fingerprint

    def _lock(self, name: str, fingerprint: str) -> filelock.FileLock:
        return entry_lock(self.root / "locks" / name / f"{fingerprint}.lock")

    def _lease_file(self, name: str, fingerprint: str) -> LeaseFile:
        return LeaseFile(self.root / "leases" / name / f"{fingerprint}.json")

    def sweep(self) -> int:
        """Remove unowned temp directories, leftover trash and expired lease records (of builders
        that died; a live builder renews its own); returns how many were removed."""
        removed = sweep_unowned(self.root / "tmp")
        for path in list((self.root / "leases").glob("*/*.json")):
            name, fp = path.parent.name, path.name.removesuffix(".json")
            with self._lock(name, fp):
                record = self._lease_file(name, fp).read()
                if record is not None and record.remaining_s() <= 0:
                    self._lease_file(name, fp).remove()
                    removed += 1
        for child in list((self.root / "trash").iterdir()):
            shutil.rmtree(child, ignore_errors=True)
            removed += 1
        if removed:
            log.info("swept leftovers", extra={"root": str(self.root), "removed": removed})
        return removed

    def _load(self, name: str, fingerprint: str) -> tuple[EntryInfo, int] | None:
        """``(info, blob inode)``, ``None`` when absent; raises ``_Broken`` for an unusable entry."""
        d = self._entry_dir(name, fingerprint)
        try:
            st_manifest = os.stat(d / MANIFEST)
            data = (d / MANIFEST).read_bytes()
            st_blob = os.stat(d / BLOB)
        except FileNotFoundError:
            if d.is_dir():
                raise _Broken("manifest or blob missing") from None
            return None
        try:
            info = EntryInfo.from_manifest(data, st_manifest.st_mtime)
        except (ValueError, KeyError, TypeError) as e:
            raise _Broken(f"unreadable manifest: {e}") from e
        if (info.name, info.fingerprint) != (name, fingerprint):
            raise _Broken(f"manifest names {info.name}/{info.fingerprint}")
        if st_blob.st_size != info.size_bytes:
            raise _Broken(f"blob has {st_blob.st_size} bytes, manifest says {info.size_bytes}")
        return info, st_blob.st_ino

    def _touch(self, name: str, fingerprint: str) -> float:
        now = time.time()
        try:
            os.utime(self._entry_dir(name, fingerprint) / MANIFEST, (now, now))
        except OSError:  # evicted meanwhile, or not ours to touch: LRU order is best effort
            pass
        return now

    def _quarantine(self, name: str, fingerprint: str, ino: int | None, reason: str) -> None:
        with self._lock(name, fingerprint):
            self._quarantine_locked(name, fingerprint, ino, reason)

    def _quarantine_locked(self, name: str, fingerprint: str, ino: int | None, reason: str) -> None:
        """Move the entry to ``quarantine/`` if it is still the one found bad (same blob inode, or
        still broken when ``ino`` is None)."""
        d = self._entry_dir(name, fingerprint)
        if ino is not None:
            try:
                if os.stat(d / BLOB).st_ino != ino:
                    return  # replaced by a fresh publish meanwhile
            except FileNotFoundError:
                return
        else:
            try:
                self._load(name, fingerprint)
                return  # absent, or repaired meanwhile
            except _Broken:
                pass
        target = self.root / "quarantine" / f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(d, target)
        except FileNotFoundError:
            return
        (target / "reason.txt").write_text(f"{name}/{fingerprint}: {reason}\n")
        self._count("quarantined")
        log.warning("quarantined corrupt entry",
                    extra={"entry": f"{name}/{fingerprint}", "reason": reason, "path": str(target)})

    def _scan(self, prefix: str = "") -> list[EntryInfo]:
        """Every readable entry whose name starts with ``prefix`` (broken ones are skipped)."""
        out = []
        for name_dir in sorted((self.root / "entries").iterdir()):
            if not name_dir.name.startswith(prefix):
                continue
            try:
                fingerprints = sorted(p.name for p in name_dir.iterdir())
            except (FileNotFoundError, NotADirectoryError):
                continue
            for fp in fingerprints:
                if fp == UNKNOWN:  # never stored by us; never listed or matched
                    continue
                try:
                    loaded = self._load(name_dir.name, fp)
                except _Broken:
                    continue
                if loaded is not None:
                    out.append(loaded[0])
        return out

    # ---------------------------------------------------------------- reads

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info on a HIT (and its last-access time is refreshed), ``None`` on a MISS.

        Checks the manifest and the blob size (a cheap check; the sha256 is verified on read).
        ``UNKNOWN`` is always a MISS. Raises ``InvalidArgument`` for a bad key.
        """
        validate_key(name, fingerprint)
        loaded = None
        if fingerprint != UNKNOWN:
            try:
                loaded = self._load(name, fingerprint)
            except _Broken as e:
                self._quarantine(name, fingerprint, None, str(e))
        if loaded is None:
            self._count("misses")
            return None
        self._count("hits")
        info = loaded[0]
        return EntryInfo(**{**info.to_dict(), "last_access": self._touch(name, fingerprint)})

    def open(self, name: str, fingerprint: str) -> EntryReader | None:
        """Open an entry for reading (holding a read lease), or ``None`` on a MISS.

        The caller must close the reader (``with store.open(...) as r``). Raises
        ``InvalidArgument`` for a bad key.
        """
        validate_key(name, fingerprint)
        if fingerprint == UNKNOWN:
            self._count("misses")
            return None
        d = self._entry_dir(name, fingerprint)
        try:
            fd = os.open(d / BLOB, os.O_RDONLY)
        except FileNotFoundError:
            fd = -1
        loaded = None
        try:
            if fd >= 0:
                lock_shared(fd)
            loaded = self._load(name, fingerprint)
            if loaded is not None and (fd < 0 or loaded[1] != os.fstat(fd).st_ino):
                loaded = None  # evicted (and maybe republished) between open and lock: a miss
        except _Broken as e:
            self._quarantine(name, fingerprint, None, str(e))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        if loaded is None:
            if fd >= 0:
                os.close(fd)
            self._count("misses")
            return None
        info = loaded[0]
        info = EntryInfo(**{**info.to_dict(), "last_access": self._touch(name, fingerprint)})
        return EntryReader(self, info, fd, loaded[1])

    def fetch(self, name: str, fingerprint: str, dest: str | Path) -> EntryInfo | None:
        """Write the entry at ``dest`` atomically (a file, or a directory restored from its tar);
        ``None`` on a MISS, including a corrupt entry (quarantined). Raises ``InvalidArgument``
        for a bad key or an unusable ``dest`` (see :func:`artifact.install_stream`)."""
        reader = self.open(name, fingerprint)
        if reader is None:
            return None
        with reader:
            try:
                install_stream(reader.chunks(), reader.info.format, dest)
            except CorruptArtifact:
                if reader.verified:  # intact bytes, but a "dir" entry that is not a tar
                    self._quarantine(name, fingerprint, reader.inode, "directory artifact does not unpack")
                return None
        return reader.info

    def list(self, prefix: str = "") -> list[EntryInfo]:
        """Entries whose name starts with ``prefix``, sorted by name then fingerprint."""
        return self._scan(validate_prefix(prefix))

    def stat(self) -> dict:
        """``root``, ``entries``, ``total_bytes``, ``max_bytes``, this instance's counters
        (:data:`COUNTERS`) and ``leases`` (build leases held now, i.e. not expired)."""
        entries = self._scan()
        with self._counter_lock:
            counters = {k: self._counters[k] for k in COUNTERS}
        return {"root": str(self.root), "entries": len(entries),
                "total_bytes": sum(e.size_bytes for e in entries), "max_bytes": self.max_bytes, **counters,
                "leases": len(self.leases())}

    def leases(self) -> list[Lease]:
        """The build leases held now (unexpired), sorted by name then fingerprint."""
        out, now = [], time.time()
        for path in sorted((self.root / "leases").glob("*/*.json")):
            name, fp = path.parent.name, path.name.removesuffix(".json")
            with self._lock(name, fp):
                lease = self._lease_file(name, fp).read()
            if lease is not None and lease.remaining_s(now) > 0:
                out.append(lease)
        return out

    # ---------------------------------------------------------------- single-flight builds

    def _present(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info if it is stored and sound (a broken one is quarantined). Caller holds
        the entry lock."""
        try:
            loaded = self._load(name, fingerprint)
        except _Broken as e:
            self._quarantine_locked(name, fingerprint, None, str(e))
            return None
        return loaded[0] if loaded else None

    def claim(self, name: str, fingerprint: str, holder: str = "", ttl_s: float | None = None) -> Claim:
        """Ask for the right to build ``name``/``fingerprint`` (see :mod:`kernel_cache_service.leases`):
        ``HIT`` (with the entry), ``OWNER`` (with a new lease of ``ttl_s`` seconds, default 30 s,
        that names ``holder``) or ``WAIT`` (with the live lease of whoever builds). Raises
        ``InvalidArgument`` for a bad key, an ``UNKNOWN`` fingerprint (never stored, so never
        built for the store) or a TTL outside [0.1, 3600] s; ``FailedPrecondition`` /
        ``ResourceExhausted`` when the lease cannot be written."""
        validate_key(name, fingerprint)
        if fingerprint == UNKNOWN:
            raise InvalidArgument(f"{name}/UNKNOWN cannot be claimed: unknown keys are never stored")
        ttl = validate_ttl(ttl_s)
        self._count("claims")
        with self._lock(name, fingerprint):
            info = self._present(name, fingerprint)
            if info is not None:
                return Claim(HIT, entry=info)
            record = self._lease_file(name, fingerprint).read()
            now = time.time()
            if record is not None and record.remaining_s(now) > 0:
                self._count("waits")
                return Claim(WAIT, lease=record)
            lease = Lease(name, fingerprint, uuid.uuid4().hex, holder, now + ttl, ttl)
            try:
                self._lease_file(name, fingerprint).write(lease)
            except OSError as e:
                raise storage_error(e, f"claiming {name}/{fingerprint[:12]}") from e
        takeover = record is not None
        self._count("builds")
        if takeover:
            self._count("takeovers")
            log.info("build lease taken over", extra={"entry": f"{name}/{fingerprint}", "holder": holder,
                                                          "previous_holder": record.holder})
        return Claim(OWNER, lease=lease, takeover=takeover)

    @contextlib.contextmanager
    def _held(self, lease: Lease) -> Iterator[tuple[LeaseFile, Lease] | None]:
        """Holding the key's lock: ``(the key's lease file, the recorded lease)`` when ``lease``
        is the one recorded there (same id), else ``None`` (taken over, released, or ended by the
        entry's publish)."""
        validate_key(lease.name, lease.fingerprint)
        with self._lock(lease.name, lease.fingerprint):
            file = self._lease_file(lease.name, lease.fingerprint)
            record = file.read()
            yield (file, record) if record is not None and record.lease_id == lease.lease_id else None

    def renew(self, lease: Lease) -> Lease | None:
        """The lease recorded under ``lease``'s id extended by *its* TTL from now (the holder,
        TTL and expiry the caller sends are not trusted), or ``None`` when it is no longer held
        (taken over, released, or ended by the entry's publish); then nothing changes."""
        with self._held(lease) as held:
            if held is None:
                return None
            file, record = held
            renewed = record.renewed()
            try:
                file.write(renewed)
            except OSError as e:
                raise storage_error(e, f"renewing the lease on {lease.name}/{lease.fingerprint[:12]}") from e
            return renewed

    def release(self, lease: Lease) -> bool:
        """Give ``lease`` up without publishing (waiters see ``LEASE_EXPIRED``); ``False`` when it
        was no longer held."""
        with self._held(lease) as held:
            if held is not None:
                held[0].remove()
            return held is not None

    def wait_build(self, name: str, fingerprint: str, timeout_s: float | None = None,
                   poll_s: float = 0.1) -> Claim | None:
        """After a ``WAIT``: block until the entry is published (``PUBLISHED`` with the entry)
        or no live lease is left on the key (``LEASE_EXPIRED``: claim again); a lease taken over
        by another waiter meanwhile is waited on in turn. ``None`` after ``timeout_s`` seconds
        (``None``: no limit). Polls every ``poll_s`` seconds (the store spans processes)."""
        validate_key(name, fingerprint)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock(name, fingerprint):
                info = self._present(name, fingerprint)
                if info is not None:
                    return Claim(PUBLISHED_EVENT, entry=info)
                record = self._lease_file(name, fingerprint).read()
            if record is None or record.remaining_s() <= 0:
                return Claim(LEASE_EXPIRED, lease=record if record and record.lease_id else None)
            if end is not None and time.monotonic() >= end:
                return None
            time.sleep(poll_s if end is None else max(0.0, min(poll_s, end - time.monotonic())))

    # ---------------------------------------------------------------- writes

    def precheck(self, name: str, fingerprint: str, size: int | None = None) -> PublishResult | None:
        """The answer to a publish that needs no bytes: REJECTED (UNKNOWN key, ``size`` bytes over
        the budget) or ALREADY_PRESENT; ``None`` when the bytes are needed. Raises
        ``InvalidArgument`` for a bad key or an announced ``size`` of 0 bytes (an empty artifact)."""
        validate_key(name, fingerprint)
        if fingerprint == UNKNOWN:
            return PublishResult(REJECTED, "the fingerprint is UNKNOWN; unknown keys are never stored")
        if size == 0:
            raise empty_artifact(name, fingerprint)
        if size is not None and self.max_bytes and size > self.max_bytes:
            return PublishResult(
                REJECTED, f"artifact of {size} bytes exceeds the store budget of {self.max_bytes} bytes")
        try:
            loaded = self._load(name, fingerprint)
        except _Broken:
            loaded = None  # the commit quarantines it under the entry lock
        return PublishResult(ALREADY_PRESENT, "", loaded[0]) if loaded else None

    def begin_publish(self, name: str, fingerprint: str, *, fmt: str = "file", producer: str = "",
                      size: int | None = None, sha256: str | None = None) -> PendingPublish:
        """Start a publish of ``fmt`` (``"file"`` or ``"dir"``, i.e. a tar) bytes. ``size`` (bytes)
        and ``sha256`` (hex), when given, are what the sender announced and are verified at
        commit. Raises ``InvalidArgument`` for a bad key, format or sha256."""
        validate_key(name, fingerprint)
        if fmt not in FORMATS:
            raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if sha256 is not None and (len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256)):
            raise InvalidArgument("sha256 must be 64 lowercase hex characters")
        if size is not None and size < 0:
            raise InvalidArgument(f"size must be >= 0 bytes, got {size}")
        return PendingPublish(self, name, fingerprint, fmt=fmt, producer=producer, size=size, sha256=sha256)

    def publish(self, name: str, fingerprint: str, path: str | Path, *, producer: str = "") -> PublishResult:
        """Publish the file or directory at ``path`` (a directory is stored as one tar).

        Raises ``InvalidArgument`` for a bad key or a ``path`` that is neither a file nor a
        directory; otherwise returns PUBLISHED, ALREADY_PRESENT or REJECTED.
        """
        path = Path(path)
        validate_key(name, fingerprint)
        if not (path.is_file() or path.is_dir()):
            raise InvalidArgument(f"{path} is not a file or a directory")
        early = self.precheck(name, fingerprint)
        if early is not None:
            return early
        fmt = "dir" if path.is_dir() else "file"
        with self.begin_publish(name, fingerprint, fmt=fmt, producer=producer) as pending:
            if fmt == "file":
                for block in iter_file(path):
                    pending.write(block)
            else:
                pack_directory(path, pending)
            return pending.commit()

    def _install(self, tmp: Path, info: EntryInfo) -> PublishResult:
        """Make the verified temp entry ``tmp`` visible as ``info``'s key (holding its lock)."""
        name, fp = info.name, info.fingerprint
        with self._lock(name, fp):
            present = self._present(name, fp)
            if present is not None:
                self._lease_file(name, fp).remove()
                return PublishResult(ALREADY_PRESENT, "", present)
            rejected = self._admit(tmp, info)
            if rejected is not None:
                return rejected
            self._lease_file(name, fp).remove()  # the build is done: waiters see PUBLISHED
        self._count("publishes")
        log.info("published", extra={"entry": f"{name}/{fp}", "bytes": info.size_bytes, "format": info.format})
        return PublishResult(PUBLISHED, "", EntryInfo(**{**info.to_dict(), "last_access": info.created}))

    def _admit(self, tmp: Path, info: EntryInfo) -> PublishResult | None:
        """Place the verified temp entry directory ``tmp`` (blob + manifest) as ``info``'s key,
        evicting least recently used entries to make room under the budget; ``None`` once placed,
        REJECTED when no room can be made (the other entries are being read). The caller holds
        the key's lock and has checked that the key is absent."""
        name, fp = info.name, info.fingerprint
        if self.max_bytes:
            with entry_lock(self.root / "budget.lock"):
                if not self._make_room(info.size_bytes, exclude=(name, fp)):
                    return PublishResult(
                        REJECTED, f"no room for {info.size_bytes} bytes under the budget of "
                                  f"{self.max_bytes} bytes: the other entries are being read")
                self._place(tmp, name, fp)
        else:
            self._place(tmp, name, fp)
        return None

    def _place(self, tmp: Path, name: str, fingerprint: str) -> None:
        (self.root / "entries" / name).mkdir(exist_ok=True)
        os.replace(tmp, self._entry_dir(name, fingerprint))

    def _make_room(self, needed: int, exclude: tuple[str, str]) -> bool:
        """Evict least recently used entries (not ``exclude``, not being read, not locked) until
        ``needed`` more bytes fit the budget. Caller holds ``budget.lock``."""
        entries = self._scan()
        total = sum(e.size_bytes for e in entries)
        for e in sorted(entries, key=lambda e: e.last_access):
            if total + needed <= self.max_bytes:
                break
            if (e.name, e.fingerprint) == exclude:
                continue
            freed = self._evict_entry(e.name, e.fingerprint, wait=False)
            if freed is not None:
                total -= freed
        return total + needed <= self.max_bytes

    def _evict_entry(self, name: str, fingerprint: str, *, wait: bool) -> int | None:
        """Remove one entry unless it is being read; returns bytes freed, ``None`` if skipped or
        absent. ``wait=False`` also skips an entry whose lock someone else holds."""
        lock = self._lock(name, fingerprint)
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except filelock.Timeout:
            return None
        try:
            d = self._entry_dir(name, fingerprint)
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
                target = self.root / "trash" / f"{os.getpid()}-{uuid.uuid4().hex}"
                os.replace(d, target)
            finally:
                if fd >= 0:
                    os.close(fd)
        finally:
            lock.release()
        shutil.rmtree(target, ignore_errors=True)
        self._count("evictions")
        log.info("evicted", extra={"entry": f"{name}/{fingerprint}", "bytes": size})
        return size

    def evict(self, name: str | None = None, fingerprint: str | None = None, *,
              all: bool = False) -> tuple[int, int]:
        """Evict one entry (``name`` + ``fingerprint``), every fingerprint of ``name``, or, with
        ``all``, everything (and empty ``quarantine/``), with their build leases (a stuck build is
        broken this way). Entries being read are skipped.
        Returns ``(entries evicted, bytes freed)``. Raises ``InvalidArgument`` for a bad key or
        a bad combination (``all`` with a key, a fingerprint without a name, nothing given)."""
        if all:
            if name or fingerprint:
                raise InvalidArgument("evict all takes no name or fingerprint")
            targets = [(n.name, f.name) for n in sorted((self.root / "entries").iterdir())
                       if n.is_dir() for f in sorted(n.iterdir())]
            for child in list((self.root / "quarantine").iterdir()):
                shutil.rmtree(child, ignore_errors=True)
        elif name:
            validate_part(name, "name")
            if fingerprint:
                targets = [(name, validate_part(fingerprint, "fingerprint"))]
            else:
                name_dir = self.root / "entries" / name
                targets = [(name, f.name) for f in sorted(name_dir.iterdir())] if name_dir.is_dir() else []
        else:
            raise InvalidArgument("evict needs a name, a name and a fingerprint, or all")
        count = freed = 0
        for n, f in targets:
            size = self._evict_entry(n, f, wait=True)
            if size is not None:
                count += 1
                freed += size
        self._break_leases(name, fingerprint)
        return count, freed

    def _break_leases(self, name: str | None, fingerprint: str | None) -> None:
        """Remove the lease records of one key, of every fingerprint of ``name``, or (both
        ``None``) of every key: an evicted key is forgotten entirely, so an operator can break
        a stuck build (its holder's next renewal finds the lease gone; waiters claim again)."""
        pattern = f"{name or '*'}/{fingerprint or '*'}.json"
        for path in list((self.root / "leases").glob(pattern)):
            n, fp = path.parent.name, path.name.removesuffix(".json")
            with self._lock(n, fp):
                record = self._lease_file(n, fp).read()
                self._lease_file(n, fp).remove()
            if record is not None:
                log.info("build lease broken by evict", extra={"entry": f"{n}/{fp}", "holder": record.holder})
