"""The one interface of a kernel-cache store, :class:`KernelStoreAPI`, which the disk store
(:class:`~kernel_cache_service.store.KernelStore`) and the S3 store
(:class:`~kernel_cache_service.s3_store.S3KernelStore`) implement and the servicer and the
client's embedded mode are typed against (``docs/architecture.md`` §6 and §6.1)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from kernel_cache_service.entry import EntryInfo, PublishResult
from kernel_cache_service.leases import Claim, Lease
from kernel_cache_service.publish import PendingPublish
from services.signing import SigningKey


class OpenEntry(Protocol):
    """An entry opened for reading, holding a read lease until closed (a context manager)."""

    info: EntryInfo

    @property
    def verified(self) -> bool:
        """True once every byte was read and matched the entry's sha256."""

    @property
    def inode(self) -> int:
        """Identifies the blob read (a quarantine moves only that one)."""

    def chunks(self, chunk_bytes: int = ...) -> Iterator[bytes]:
        """The blob in chunks of at most ``chunk_bytes`` bytes; a size or sha256 mismatch at the
        end raises :class:`~kernel_cache_service.artifact.CorruptArtifact` (a ``NotFound``)."""

    def close(self) -> None:
        """Release the read lease."""

    def __enter__(self) -> OpenEntry: ...

    def __exit__(self, *exc) -> None: ...


class KernelStoreAPI(Protocol):
    """A kernel-cache store: entries keyed by (name, fingerprint), published atomically, read
    verified, bounded by ``max_bytes`` bytes (0 = no budget) on this host's disk under ``root``,
    with single-flight build leases. Bad keys raise ``InvalidArgument``; each method's answers
    and errors are those of :class:`~kernel_cache_service.store.KernelStore`."""

    root: Path
    max_bytes: int
    swept: int

    def sweep(self) -> int:
        """Remove dead writers' temp data, trash and expired leases; returns how many."""

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry on a HIT, ``None`` on a MISS."""

    def open(self, name: str, fingerprint: str) -> OpenEntry | None:
        """The entry opened for reading, ``None`` on a MISS."""

    def fetch(self, name: str, fingerprint: str, dest: str | Path,
              check: Callable[[EntryInfo], object] | None = None) -> EntryInfo | None:
        """The entry written at ``dest`` atomically, ``None`` on a MISS; ``check(info)`` runs
        before any byte is written (it may raise: nothing is written)."""

    def list(self, prefix: str = "", with_parts: bool = False) -> list[EntryInfo]:
        """Entries whose name starts with ``prefix``, sorted by name then fingerprint (with their
        fingerprint parts records when ``with_parts``)."""

    def stat(self) -> dict:
        """``root``, ``entries``, ``total_bytes``, ``max_bytes``, the counters, ``leases``."""

    def leases(self) -> list[Lease]:
        """The build leases held now."""

    def claim(self, name: str, fingerprint: str, holder: str = "", ttl_s: float | None = None) -> Claim:
        """HIT, OWNER (a new lease) or WAIT (the builder's lease)."""

    def renew(self, lease: Lease) -> Lease | None:
        """The lease extended by its TTL, ``None`` when no longer held."""

    def release(self, lease: Lease) -> bool:
        """Give the lease up; ``False`` when no longer held."""

    def wait_build(self, name: str, fingerprint: str, timeout_s: float | None = None,
                   poll_s: float = 0.1) -> Claim | None:
        """After WAIT: PUBLISHED or LEASE_EXPIRED, ``None`` after ``timeout_s`` seconds."""

    def precheck(self, name: str, fingerprint: str, size: int | None = None) -> PublishResult | None:
        """REJECTED or ALREADY_PRESENT without the bytes, ``None`` when they are needed."""

    def begin_publish(self, name: str, fingerprint: str, *, fmt: str = "file", producer: str = "",
                      size: int | None = None, sha256: str | None = None, signature: str = "",
                      signer: SigningKey | None = None, parts: str = "") -> PendingPublish:
        """A publish to write bytes into and commit (keeping ``signature``, or signed by
        ``signer``; with the fingerprint ``parts`` record)."""

    def publish(self, name: str, fingerprint: str, path: str | Path, *, producer: str = "",
                signer: SigningKey | None = None, parts: str = "") -> PublishResult:
        """Publish the file or directory at ``path`` (signed by ``signer`` when given; with the
        fingerprint ``parts`` record)."""

    def evict(self, name: str | None = None, fingerprint: str | None = None, *,
              all: bool = False) -> tuple[int, int]:
        """``(entries evicted, bytes freed)`` of one key, a name, or everything."""
