"""The on-disk kernel-cache store, :class:`KernelStore`: compiled-program artifacts keyed by
(name, fingerprint), embedded or behind the daemon, shared by the processes of one host.

Layout, publish protocol, read leases, LRU budget, integrity and single-flight builds:
``docs/architecture.md`` §6. The class composes :mod:`~kernel_cache_service.reads`,
:mod:`~kernel_cache_service.publish`, :mod:`~kernel_cache_service.budget` and
:mod:`~kernel_cache_service.leases` over a :class:`~kernel_cache_service.layout.StoreLayout`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kernel_cache_service.budget import Budget
from kernel_cache_service.counters import Counters
from kernel_cache_service.entry import ALREADY_PRESENT, PUBLISHED, EntryInfo, PublishResult
from kernel_cache_service.keys import validate_key, validate_prefix
from kernel_cache_service.layout import StoreLayout
from kernel_cache_service.leases import BuildLeases, Claim, Lease
from kernel_cache_service.limits import MAX_PARTS_BYTES
from kernel_cache_service.locks import sweep_unowned
from kernel_cache_service.publish import PendingPublish, begin_publish, early_rejection, publish_path
from kernel_cache_service.reads import EntryReader, EntryReads, fetch_entry
from services.errors import InvalidArgument
from services.signing import SigningKey

log = logging.getLogger(__name__)


class KernelStore:
    """A kernel-cache store rooted at ``root`` (created if absent) with a byte budget; implements
    :class:`~kernel_cache_service.store_api.KernelStoreAPI`.

    ``max_bytes``: budget for the sum of blob sizes in bytes; 0 means unlimited. Raises
    ``InvalidArgument`` for a negative budget or a root that cannot be created. Creating a store
    removes leftovers of dead writers (``tmp/``) and interrupted evictions (``trash/``);
    ``swept`` says how many were removed. Thread-safe; process-safe on one host. Its
    collaborators are public for the S3 store's local tier: ``layout``, ``counters``, ``reads``,
    ``budget``, ``builds``.
    """

    def __init__(self, root: str | Path, max_bytes: int = 0) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.layout = StoreLayout(root)
        self.root, self.max_bytes = self.layout.root, max_bytes
        self.counters = Counters()
        self.reads = EntryReads(self.layout, self.counters)
        self.budget = Budget(self.layout, self.reads, self.counters, max_bytes)
        self.builds = BuildLeases(self.layout, self.reads.present, self.counters)
        self.swept = self.sweep()

    def sweep(self) -> int:
        """Remove unowned temp directories, leftover trash and expired lease records (of builders
        that died; a live builder renews its own); returns how many were removed."""
        removed = sweep_unowned(self.root / "tmp") + self.builds.sweep_expired()
        for child in list((self.root / "trash").iterdir()):
            shutil.rmtree(child, ignore_errors=True)
            removed += 1
        if removed:
            log.info("swept leftovers", extra={"root": str(self.root), "removed": removed})
        return removed

    # ---------------------------------------------------------------- reads

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info on a HIT (and its last-access time is refreshed), ``None`` on a MISS.

        Checks the manifest and the blob size (a cheap check; the sha256 is verified on read).
        ``UNKNOWN`` is always a MISS. Raises ``InvalidArgument`` for a bad key.
        """
        validate_key(name, fingerprint)
        return self.reads.lookup(name, fingerprint)

    def open(self, name: str, fingerprint: str) -> EntryReader | None:
        """Open an entry for reading (holding a read lease), or ``None`` on a MISS.

        The caller must close the reader (``with store.open(...) as r``). Raises
        ``InvalidArgument`` for a bad key.
        """
        validate_key(name, fingerprint)
        return self.reads.open(name, fingerprint)

    def fetch(self, name: str, fingerprint: str, dest: str | Path,
              check: Callable[[EntryInfo], object] | None = None) -> EntryInfo | None:
        """Write the entry at ``dest`` atomically (a file, or a directory restored from its tar);
        ``None`` on a MISS, including a corrupt entry (quarantined). Raises ``InvalidArgument``
        for a bad key or an unusable ``dest`` (see :func:`artifact.install_stream`). ``check(info)``,
        when given, runs before any byte is written and may raise (e.g. ``Untrusted``): then
        nothing is written; a "dir" entry is then also verified whole before it is unpacked."""
        return fetch_entry(self.open(name, fingerprint), dest, self.reads.quarantine, check)

    def list(self, prefix: str = "", with_parts: bool = False) -> list[EntryInfo]:
        """Entries whose name starts with ``prefix``, sorted by name then fingerprint; with
        ``with_parts``, each with its fingerprint parts record (``parts``; ``""`` when it has none)."""
        entries = self.reads.scan(validate_prefix(prefix))
        if with_parts:
            entries = [replace(e, parts=self.reads.parts(e.name, e.fingerprint, MAX_PARTS_BYTES)) for e in entries]
        return entries

    def stat(self) -> dict:
        """``root``, ``entries``, ``total_bytes``, ``max_bytes``, this instance's counters
        (:data:`~kernel_cache_service.counters.COUNTERS`) and ``leases`` (build leases held now,
        i.e. not expired)."""
        entries = self.reads.scan()
        return {"root": str(self.root), "entries": len(entries),
                "total_bytes": sum(e.size_bytes for e in entries), "max_bytes": self.max_bytes,
                **self.counters.snapshot(), "leases": len(self.leases())}

    def leases(self) -> list[Lease]:
        """The build leases held now (unexpired), sorted by name then fingerprint."""
        return self.builds.held()

    # ---------------------------------------------------------------- single-flight builds

    def claim(self, name: str, fingerprint: str, holder: str = "", ttl_s: float | None = None) -> Claim:
        """Ask for the right to build ``name``/``fingerprint`` (see :mod:`kernel_cache_service.leases`):
        ``HIT`` (with the entry), ``OWNER`` (with a new lease of ``ttl_s`` seconds, default 30 s,
        that names ``holder``) or ``WAIT`` (with the live lease of whoever builds). Raises
        ``InvalidArgument`` for a bad key, an ``UNKNOWN`` fingerprint (never stored, so never
        built for the store) or a TTL outside [0.1, 3600] s; ``FailedPrecondition`` /
        ``ResourceExhausted`` when the lease cannot be written."""
        return self.builds.claim(name, fingerprint, holder, ttl_s)

    def renew(self, lease: Lease) -> Lease | None:
        """The lease extended by its recorded TTL from now, ``None`` when no longer held
        (see :meth:`BuildLeases.renew <kernel_cache_service.leases.BuildLeases.renew>`)."""
        return self.builds.renew(lease)

    def release(self, lease: Lease) -> bool:
        """Give ``lease`` up without publishing (waiters see ``LEASE_EXPIRED``); ``False`` when it
        was no longer held."""
        return self.builds.release(lease)

    def wait_build(self, name: str, fingerprint: str, timeout_s: float | None = None,
                   poll_s: float = 0.1) -> Claim | None:
        """After a ``WAIT``: ``PUBLISHED`` (with the entry) or ``LEASE_EXPIRED`` (claim again),
        ``None`` after ``timeout_s`` seconds (``None``: no limit); polls every ``poll_s`` s."""
        return self.builds.wait_build(name, fingerprint, timeout_s, poll_s)

    # ---------------------------------------------------------------- writes

    def precheck(self, name: str, fingerprint: str, size: int | None = None) -> PublishResult | None:
        """The answer to a publish that needs no bytes: REJECTED (UNKNOWN key, ``size`` bytes over
        the budget) or ALREADY_PRESENT; ``None`` when the bytes are needed. Raises
        ``InvalidArgument`` for a bad key or an announced ``size`` of 0 bytes (an empty artifact)."""
        early = early_rejection(name, fingerprint, size, self.max_bytes)
        if early is not None:
            return early
        info = self.reads.load_sound(name, fingerprint)  # a broken one: the commit quarantines it
        return PublishResult(ALREADY_PRESENT, "", info) if info is not None else None

    def begin_publish(self, name: str, fingerprint: str, *, fmt: str = "file", producer: str = "",
                      size: int | None = None, sha256: str | None = None, signature: str = "",
                      signer: SigningKey | None = None, parts: str = "") -> PendingPublish:
        """Start a publish of ``fmt`` (``"file"`` or ``"dir"``, i.e. a tar) bytes. ``size`` (bytes)
        and ``sha256`` (hex), when given, are what the sender announced and are verified at
        commit; ``parts`` (the key's fingerprint parts record) is stored beside the entry.
        Raises ``InvalidArgument`` for a bad key, format, sha256 or parts record."""
        return begin_publish(self.root / "tmp", self.max_bytes, self._install, name, fingerprint, fmt=fmt,
                             producer=producer, size=size, sha256=sha256, signature=signature, signer=signer,
                             parts=parts)

    def publish(self, name: str, fingerprint: str, path: str | Path, *, producer: str = "",
                signer: SigningKey | None = None, parts: str = "") -> PublishResult:
        """Publish the file or directory at ``path`` (a directory is stored as one tar), with the
        fingerprint ``parts`` record when given.

        Raises ``InvalidArgument`` for a bad key, a bad parts record or a ``path`` that is
        neither a file nor a directory; otherwise returns PUBLISHED, ALREADY_PRESENT or REJECTED.
        """
        return publish_path(self, name, fingerprint, path, producer, signer, parts)

    def _install(self, tmp: Path, info: EntryInfo) -> PublishResult:
        """Make the verified temp entry ``tmp`` visible as ``info``'s key (holding its lock)."""
        name, fp = info.name, info.fingerprint
        with self.layout.lock(name, fp):
            present = self.reads.present(name, fp)
            if present is not None:
                self.builds.end_locked(name, fp)
                return PublishResult(ALREADY_PRESENT, "", present)
            rejected = self.budget.admit(tmp, info)
            if rejected is not None:
                return rejected
            self.builds.end_locked(name, fp)  # the build is done: waiters see PUBLISHED
        self.counters.count("publishes")
        log.info("published", extra={"entry": f"{name}/{fp}", "bytes": info.size_bytes, "format": info.format})
        return PublishResult(PUBLISHED, "", replace(info, last_access=info.created))

    def evict(self, name: str | None = None, fingerprint: str | None = None, *,
              all: bool = False) -> tuple[int, int]:
        """Evict one entry (``name`` + ``fingerprint``), every fingerprint of ``name``, or, with
        ``all``, everything (and empty ``quarantine/``), with their build leases (a stuck build is
        broken this way). Entries being read are skipped.
        Returns ``(entries evicted, bytes freed)``. Raises ``InvalidArgument`` for a bad key or
        a bad combination (``all`` with a key, a fingerprint without a name, nothing given)."""
        evicted = self.budget.evict(name, fingerprint, all)
        self.builds.break_leases(name, fingerprint)
        return evicted
