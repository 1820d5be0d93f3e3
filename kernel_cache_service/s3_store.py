"""The kernel-cache store on an object store (S3 API) behind a local disk tier,
:class:`S3KernelStore` (``warmserve cache serve --root DIR --store s3://BUCKET/PREFIX``).

Same contract as the disk store; how publish, read-through, corruption, leases, list and evict
use the bucket: ``docs/architecture.md`` §6.1. Objects are described in
:mod:`~kernel_cache_service.s3_entries`, the read-through in :mod:`~kernel_cache_service.s3_read_through`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kernel_cache_service.budget import validate_evict
from kernel_cache_service.counters import Counters
from kernel_cache_service.entry import ALREADY_PRESENT, PUBLISHED, REJECTED, EntryInfo, PublishResult
from kernel_cache_service.fingerprint import UNKNOWN
from kernel_cache_service.keys import validate_key, validate_prefix
from kernel_cache_service.layout import BLOB
from kernel_cache_service.leases import HIT, Claim, Lease, validate_claim
from kernel_cache_service.limits import MAX_PARTS_BYTES
from kernel_cache_service.publish import PendingPublish, begin_publish, early_rejection, publish_path
from kernel_cache_service.reads import fetch_entry
from kernel_cache_service.s3_entries import (
    ENTRIES,
    FOLDER,
    PARTS,
    entry_from_head,
    entry_key,
    entry_metadata,
    key_of,
    parts_key,
)
from kernel_cache_service.s3_read_through import CountingReader, ReadThrough
from kernel_cache_service.store import KernelStore
from services.errors import InvalidArgument, WarmserveError
from services.s3 import ObjectStore
from services.s3_errors import CorruptObject
from services.signing import SigningKey

log = logging.getLogger(__name__)

#: Counters this store keeps itself; the others come from the local tier (see :meth:`S3KernelStore.stat`).
_OWN = ("hits", "misses", "publishes")


class S3KernelStore:
    """The kernel-cache store in ``objects`` (an :class:`~services.s3.ObjectStore` at
    ``PREFIX/kernel-cache``) behind a local :class:`KernelStore` at ``root`` with a budget of
    ``max_bytes`` bytes (0 = unlimited); implements
    :class:`~kernel_cache_service.store_api.KernelStoreAPI` with the disk store's answers.
    Bucket errors raise ``Unavailable`` (endpoint down, timeouts) or ``FailedPrecondition``
    (access denied, bucket gone) with one sentence; nothing is stored by a failed publish.
    Thread-safe; process-safe on one host (processes sharing ``root`` coordinate through its
    locks, hosts through the bucket).
    """

    def __init__(self, root: str | Path, max_bytes: int = 0, *, objects: ObjectStore) -> None:
        self.local = KernelStore(root, max_bytes=max_bytes)
        self.objects = objects
        self.root, self.max_bytes, self.swept = self.local.root, self.local.max_bytes, self.local.swept
        self.url = objects.url()
        self.counters = Counters()
        self.tier = ReadThrough(self.local, objects, self.counters)

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

    def sweep(self) -> int:
        """The local tier's sweep (dead writers' temp data, trash, expired leases)."""
        return self.local.sweep()

    def _quarantine(self, name: str, fingerprint: str, ino: int | None, reason: str) -> None:
        """Bytes that verified but are unusable (a "dir" entry that does not unpack): quarantine
        the local copy (when it is still the one read, ``ino``) and drop the shared object; the
        entry counts once as quarantined."""
        before = self.local.counters.get("quarantined")
        self.local.reads.quarantine(name, fingerprint, ino, reason)
        self.tier.drop_remote(name, fingerprint, None, reason,
                              count=self.local.counters.get("quarantined") == before)

    # ---------------------------------------------------------------- reads

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info on a HIT (verified bytes in the local tier, fetched from the bucket
        when missing there), ``None`` on a MISS. Raises ``InvalidArgument`` for a bad key."""
        validate_key(name, fingerprint)
        info = None
        if fingerprint != UNKNOWN:
            info = self.local.lookup(name, fingerprint) or self.tier.pull(name, fingerprint)
        self.counters.count("hits" if info is not None else "misses")
        return info

    def open(self, name: str, fingerprint: str) -> CountingReader | None:
        """Open an entry for reading (a read lease on the local copy), or ``None`` on a MISS;
        close the reader (``with store.open(...) as r``)."""
        validate_key(name, fingerprint)
        reader = self.tier.open(name, fingerprint) if fingerprint != UNKNOWN else None
        if reader is None:
            self.counters.count("misses")
            return None
        return CountingReader(self.counters, reader)

    def fetch(self, name: str, fingerprint: str, dest: str | Path,
              check: Callable[[EntryInfo], object] | None = None) -> EntryInfo | None:
        """As :meth:`KernelStore.fetch`, over this store's :meth:`open` (an unusable "dir" entry
        is quarantined here and dropped from the bucket)."""
        return fetch_entry(self.open(name, fingerprint), dest, self._quarantine, check)

    def _parts(self, name: str, fingerprint: str) -> str:
        """The entry's parts record object (``""`` when absent, corrupt or too large)."""
        try:
            got = self.objects.get_bytes(parts_key(name, fingerprint), limit=MAX_PARTS_BYTES)
        except CorruptObject:
            return ""
        if got is None:
            return ""
        try:
            return got[1].decode("ascii")
        except UnicodeDecodeError:
            return ""

    def list(self, prefix: str = "", with_parts: bool = False) -> list[EntryInfo]:
        """The bucket's entries whose name starts with ``prefix``, sorted by name then
        fingerprint (one HEAD each; entries with unusable metadata are skipped). ``last_access``
        is the local tier's when it holds the entry, else the object's creation. ``with_parts``:
        each with its parts record (one GET each of ``parts/<name>/<fingerprint>``)."""
        prefix = validate_prefix(prefix)
        out = []
        for obj in self.objects.list(f"{ENTRIES}/{prefix}"):
            key = key_of(obj.key)
            if key is None:
                continue
            name, fingerprint = key
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
            held = self.local.reads.load_sound(name, fingerprint)
            if held is not None:
                info = replace(info, last_access=held.last_access)
            out.append(replace(info, parts=self._parts(name, fingerprint)) if with_parts else info)
        return sorted(out, key=lambda e: (e.name, e.fingerprint))

    def stat(self) -> dict:
        """As :meth:`KernelStore.stat`: ``root``, ``entries`` and ``total_bytes`` of the local
        tier (what ``max_bytes`` bounds), ``hits``/``misses``/``publishes`` as this store
        answered them, ``quarantined``/``evictions``/``claims`` of both tiers, and the lease
        counters and ``leases`` of the local tier (leases live there)."""
        s = self.local.stat()
        own = self.counters.snapshot()
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
        else the local tier's OWNER or WAIT (leases live in the daemon, ``docs/architecture.md``
        §6.1). Raises as :meth:`KernelStore.claim`, and ``Unavailable`` / ``FailedPrecondition``
        when the bucket cannot be read."""
        validate_claim(name, fingerprint, ttl_s)
        info = self.tier.pull(name, fingerprint)
        if info is not None:
            self.counters.count("claims")
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
        early = early_rejection(name, fingerprint, size, self.max_bytes)
        if early is not None:
            return early
        try:
            head = self.objects.head(entry_key(name, fingerprint))
        except WarmserveError as e:
            raise type(e)(f"publishing {name}/{fingerprint[:12]}: {e}; nothing was stored") from e
        if head is None:
            return None
        try:
            return PublishResult(ALREADY_PRESENT, "", entry_from_head(name, fingerprint, head))
        except (ValueError, TypeError) as e:
            self.tier.drop_remote(name, fingerprint, head.etag, f"unusable metadata: {e}")
            return None

    def begin_publish(self, name: str, fingerprint: str, *, fmt: str = "file", producer: str = "",
                      size: int | None = None, sha256: str | None = None, signature: str = "",
                      signer: SigningKey | None = None, parts: str = "") -> PendingPublish:
        """As :meth:`KernelStore.begin_publish`: the bytes go to the local tier's ``tmp/``;
        :meth:`_install` commits them to the bucket."""
        return begin_publish(self.root / "tmp", self.max_bytes, self._install, name, fingerprint, fmt=fmt,
                             producer=producer, size=size, sha256=sha256, signature=signature, signer=signer,
                             parts=parts)

    def publish(self, name: str, fingerprint: str, path: str | Path, *, producer: str = "",
                signer: SigningKey | None = None, parts: str = "") -> PublishResult:
        """As :meth:`KernelStore.publish`, into the bucket (and the local tier)."""
        return publish_path(self, name, fingerprint, path, producer, signer, parts)

    def _install(self, tmp: Path, info: EntryInfo) -> PublishResult:
        """Commit the verified temp entry ``tmp``: its parts record goes first (a plain PUT: the
        record of a key is one text, whoever uploads it), then the conditional upload of the
        blob decides (``docs/architecture.md`` §6.1), then the local tier keeps a copy when it
        has room."""
        name, fp = info.name, info.fingerprint
        what = f"publishing {name}/{fp[:12]} to {self.url}"
        if info.parts:
            self.objects.put_bytes(parts_key(name, fp), info.parts.encode("ascii"), if_absent=False, what=what)
        with self.local.layout.lock(name, fp):
            present = self.local.reads.present(name, fp)
            if present is not None:
                self._upload_held(present)
                self.local.builds.end_locked(name, fp)
                return PublishResult(ALREADY_PRESENT, "", present)
            for _ in range(2):
                if self.objects.put_file(entry_key(name, fp), tmp / BLOB, sha256=info.sha256,
                                         metadata=entry_metadata(info), what=what):
                    break
                winner, detached = self.tier.pull_locked(name, fp)  # another publisher won: take theirs
                if detached is not None:
                    detached.remove()
                if winner is not None:
                    self.local.builds.end_locked(name, fp)
                    return PublishResult(ALREADY_PRESENT, "", winner)
                # the object that won was corrupt (now dropped) or is gone again: try once more
            else:
                return PublishResult(REJECTED, f"{self.url} keeps refusing {name}/{fp[:12]} with an object that "
                                               "cannot be read back")
            if self.local.budget.admit(tmp, info) is not None:
                log.info("published to the object store only: no room in the local tier",
                         extra={"entry": f"{name}/{fp}", "bytes": info.size_bytes})
            self.local.builds.end_locked(name, fp)  # the build is done: waiters see PUBLISHED
        self.counters.count("publishes")
        log.info("published", extra={"entry": f"{name}/{fp}", "bytes": info.size_bytes, "format": info.format,
                                     "store": self.url})
        return PublishResult(PUBLISHED, "", replace(info, last_access=info.created))

    def _upload_held(self, info: EntryInfo) -> None:
        """Upload the local tier's copy of ``info`` when the bucket lacks it (best effort: a
        failure is logged; the local answer stands)."""
        blob = self.local.layout.entry_dir(info.name, info.fingerprint) / BLOB
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
        validate_evict(name, fingerprint, all)
        prefix = f"{ENTRIES}/" if all else f"{ENTRIES}/{name}/{fingerprint or ''}"

        def wanted(key: tuple[str, str] | None) -> bool:
            return key is not None and (all or (key[0] == name and (not fingerprint or key[1] == fingerprint)))

        remote = {key_of(obj.key): obj.size for obj in self.objects.list(prefix) if wanted(key_of(obj.key))}
        before = {(e.name, e.fingerprint): e.size_bytes for e in self.local.list(name or "")
                  if wanted((e.name, e.fingerprint))}
        self.local.evict(name, fingerprint, all=all)
        after = {(e.name, e.fingerprint) for e in self.local.list(name or "") if wanted((e.name, e.fingerprint))}
        removed_local = {k: size for k, size in before.items() if k not in after}
        removed_remote = {k: size for k, size in remote.items() if self.objects.delete(entry_key(*k))}
        parts_prefix = f"{PARTS}/" if all else f"{PARTS}/{name}/{fingerprint or ''}"
        for obj in self.objects.list(parts_prefix):  # the records go with their entries (and orphans)
            segments = obj.key.split("/")
            if len(segments) == 3 and wanted((segments[1], segments[2])):
                self.objects.delete(obj.key)
        self.counters.count("evictions", len(set(removed_remote) - set(removed_local)))
        keys = set(removed_local) | set(removed_remote)
        return len(keys), sum(max(removed_local.get(k, 0), removed_remote.get(k, 0)) for k in keys)
