"""Single-flight builds: build leases on kernel-cache keys, kept as small files beside the entries.

A runner that misses an entry *claims* its key (:meth:`KernelStore.claim`) and gets one of:

- ``HIT``: the entry exists, fetch it;
- ``OWNER``: build it; the :class:`Lease` is yours until ``expires`` (unix seconds), renew it
  every ``ttl_s / 3`` seconds while building (:meth:`KernelStore.renew`); your publish ends it
  (the store removes the lease when the entry is placed), a failed build releases it;
- ``WAIT``: someone else holds a live lease (``lease`` is theirs); wait
  (:meth:`KernelStore.wait_build`) until the entry is ``PUBLISHED`` or the lease ends without a
  publish (``LEASE_EXPIRED``: its holder died, hung, or released it), then claim again: one
  claimant becomes the new OWNER (``takeover`` when the old lease had expired unreleased).

The lease record of a key is ``leases/<name>/<fingerprint>.json`` (JSON of :class:`Lease`),
read and written only under the entry's filelock (``locks/<name>/<fingerprint>.lock``), so a
claim is atomic across threads and processes sharing the root, and the daemon (which uses the
same store) coordinates with embedded users of the same directory. A record is rewritten in
place, never through a temp file: a writer killed mid-write leaves a torn record, which reads as
an expired lease (taken over at the next claim). Nothing else is ever written for a lease, so
lease state cannot leave a partial entry or a temp file behind. Expiry uses the wall clock
(:func:`time.time`): hosts sharing a directory must keep their clocks in sync (NTP) to well
within a TTL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kernel_cache_service.counters import Counters
from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.fingerprint import UNKNOWN
from kernel_cache_service.keys import validate_key
from kernel_cache_service.layout import StoreLayout
from kernel_cache_service.publish import storage_error
from services.errors import InvalidArgument

log = logging.getLogger(__name__)

HIT, OWNER, WAIT = "HIT", "OWNER", "WAIT"
#: How a wait after ``WAIT`` ends.
PUBLISHED_EVENT, LEASE_EXPIRED = "PUBLISHED", "LEASE_EXPIRED"
#: Lease TTL in seconds when the claimant gives none; a builder renews every third of it.
DEFAULT_LEASE_TTL_S = 30.0
MIN_LEASE_TTL_S = 0.1
MAX_LEASE_TTL_S = 3600.0


def validate_ttl(ttl_s: float | None) -> float:
    """``ttl_s`` in seconds as a float (``None`` or 0: :data:`DEFAULT_LEASE_TTL_S`); raises
    ``InvalidArgument`` outside ``[MIN_LEASE_TTL_S, MAX_LEASE_TTL_S]``."""
    if not ttl_s:
        return DEFAULT_LEASE_TTL_S
    ttl = float(ttl_s)
    if not (math.isfinite(ttl) and MIN_LEASE_TTL_S <= ttl <= MAX_LEASE_TTL_S):
        raise InvalidArgument(f"a lease TTL must be in [{MIN_LEASE_TTL_S:g}, {MAX_LEASE_TTL_S:g}] seconds, "
                              f"got {ttl_s!r}")
    return ttl


@dataclass(frozen=True)
class Lease:
    """The right to build one key until ``expires`` (unix seconds, wall clock). ``lease_id`` is a
    random hex id; ``holder`` free text naming the builder; ``ttl_s`` what a renewal adds (s)."""

    name: str
    fingerprint: str
    lease_id: str
    holder: str
    expires: float
    ttl_s: float

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds until it expires (negative once expired)."""
        return self.expires - (time.time() if now is None else now)

    def renewed(self, now: float | None = None) -> Lease:
        """This lease extended to ``ttl_s`` seconds from ``now``."""
        return replace(self, expires=(time.time() if now is None else now) + self.ttl_s)


@dataclass(frozen=True)
class Claim:
    """The answer to a claim, or the event that ends a wait.

    ``status``: ``HIT`` / ``PUBLISHED`` (``entry`` set), ``OWNER`` (``lease`` is the caller's;
    ``takeover`` when it replaced an expired, unreleased lease), ``WAIT`` (``lease`` is the
    builder's) or ``LEASE_EXPIRED``."""

    status: str
    entry: EntryInfo | None = None
    lease: Lease | None = None
    takeover: bool = False


#: A record that exists but does not parse (a writer killed mid-write): an expired lease.
_TORN = Lease("", "", "", "", 0.0, 0.0)


class LeaseFile:
    """The lease record of one key at ``path``. Every method must be called holding the
    entry's filelock (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> Lease | None:
        """The recorded lease, ``None`` when there is none; a torn record reads as a lease that
        expired at time 0."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(data)
            return Lease(**{k: doc[k] for k in Lease.__dataclass_fields__})
        except (ValueError, KeyError, TypeError):
            return _TORN

    def write(self, lease: Lease) -> None:
        """Record ``lease`` (in place). Raises ``OSError`` when the directory is not writable."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(asdict(lease)).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Forget the lease (absent already is fine)."""
        self.path.unlink(missing_ok=True)


def validate_claim(name: str, fingerprint: str, ttl_s: float | None) -> float:
    """The TTL (s) a claim of ``name``/``fingerprint`` gets (:func:`validate_ttl`). Raises
    ``InvalidArgument`` for a bad key, an ``UNKNOWN`` fingerprint (never stored, so never built
    for the store) or a TTL outside [0.1, 3600] s."""
    validate_key(name, fingerprint)
    if fingerprint == UNKNOWN:
        raise InvalidArgument(f"{name}/UNKNOWN cannot be claimed: unknown keys are never stored")
    return validate_ttl(ttl_s)


class BuildLeases:
    """The build leases of the disk store at ``layout``: claims, renewals, releases, waits,
    sweeping and breaking, each holding the key's filelock. ``present(name, fingerprint)`` says
    whether the entry is stored (caller holding the lock); claims are counted in ``counters``."""

    def __init__(self, layout: StoreLayout, present: Callable[[str, str], EntryInfo | None],
                 counters: Counters) -> None:
        self.layout, self._present, self.counters = layout, present, counters

    def file(self, name: str, fingerprint: str) -> LeaseFile:
        """The key's lease record (use it holding the key's lock)."""
        return LeaseFile(self.layout.lease_path(name, fingerprint))

    def end_locked(self, name: str, fingerprint: str) -> None:
        """The build of the key is done (its entry is placed): forget its lease, so waiters see
        PUBLISHED. Caller holds the key's lock."""
        self.file(name, fingerprint).remove()

    def claim(self, name: str, fingerprint: str, holder: str, ttl_s: float | None) -> Claim:
        """``HIT`` (with the entry), ``OWNER`` (with a new lease of ``ttl_s`` seconds, default
        30 s, naming ``holder``) or ``WAIT`` (with the builder's live lease). Raises as
        :func:`validate_claim`, and ``FailedPrecondition`` / ``ResourceExhausted`` when the lease
        cannot be written."""
        ttl = validate_claim(name, fingerprint, ttl_s)
        self.counters.count("claims")
        with self.layout.lock(name, fingerprint):
            info = self._present(name, fingerprint)
            if info is not None:
                return Claim(HIT, entry=info)
            record = self.file(name, fingerprint).read()
            now = time.time()
            if record is not None and record.remaining_s(now) > 0:
                self.counters.count("waits")
                return Claim(WAIT, lease=record)
            lease = Lease(name, fingerprint, uuid.uuid4().hex, holder, now + ttl, ttl)
            try:
                self.file(name, fingerprint).write(lease)
            except OSError as e:
                raise storage_error(e, f"claiming {name}/{fingerprint[:12]}") from e
        takeover = record is not None
        self.counters.count("builds")
        if takeover:
            self.counters.count("takeovers")
            log.info("build lease taken over", extra={"entry": f"{name}/{fingerprint}", "holder": holder,
                                                          "previous_holder": record.holder})
        return Claim(OWNER, lease=lease, takeover=takeover)

    @contextlib.contextmanager
    def _held(self, lease: Lease) -> Iterator[tuple[LeaseFile, Lease] | None]:
        """Holding the key's lock: ``(the key's lease file, the recorded lease)`` when ``lease``
        is the one recorded there (same id), else ``None``."""
        validate_key(lease.name, lease.fingerprint)
        with self.layout.lock(lease.name, lease.fingerprint):
            file = self.file(lease.name, lease.fingerprint)
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

    def wait_build(self, name: str, fingerprint: str, timeout_s: float | None, poll_s: float) -> Claim | None:
        """After a ``WAIT``: block until the entry is published (``PUBLISHED`` with the entry)
        or no live lease is left on the key (``LEASE_EXPIRED``: claim again); a lease taken over
        by another waiter meanwhile is waited on in turn. ``None`` after ``timeout_s`` seconds
        (``None``: no limit). Polls every ``poll_s`` seconds (the store spans processes)."""
        validate_key(name, fingerprint)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self.layout.lock(name, fingerprint):
                info = self._present(name, fingerprint)
                if info is not None:
                    return Claim(PUBLISHED_EVENT, entry=info)
                record = self.file(name, fingerprint).read()
            if record is None or record.remaining_s() <= 0:
                return Claim(LEASE_EXPIRED, lease=record if record and record.lease_id else None)
            if end is not None and time.monotonic() >= end:
                return None
            time.sleep(poll_s if end is None else max(0.0, min(poll_s, end - time.monotonic())))

    def _records(self, name: str | None = None, fingerprint: str | None = None) -> Iterator[tuple[str, str, Lease | None]]:
        """``(name, fingerprint, recorded lease)`` of every key with a record (of ``name`` /
        ``fingerprint`` when given), each read holding its lock."""
        for n, fp in self.layout.lease_keys(name, fingerprint):
            with self.layout.lock(n, fp):
                yield n, fp, self.file(n, fp).read()

    def held(self) -> list[Lease]:
        """The build leases held now (unexpired), sorted by name then fingerprint."""
        now = time.time()
        return [r for _, _, r in self._records() if r is not None and r.remaining_s(now) > 0]

    def sweep_expired(self) -> int:
        """Remove the records of expired leases (builders that died; a live one renews its own);
        returns how many."""
        removed = 0
        for n, fp in self.layout.lease_keys():
            with self.layout.lock(n, fp):
                record = self.file(n, fp).read()
                if record is not None and record.remaining_s() <= 0:
                    self.file(n, fp).remove()
                    removed += 1
        return removed

    def break_leases(self, name: str | None, fingerprint: str | None) -> None:
        """Remove the lease records of one key, of every fingerprint of ``name``, or (both
        ``None``) of every key: an evicted key is forgotten entirely, so an operator can break
        a stuck build (its holder's next renewal finds the lease gone; waiters claim again)."""
        for n, fp in self.layout.lease_keys(name, fingerprint):
            with self.layout.lock(n, fp):
                record = self.file(n, fp).read()
                self.file(n, fp).remove()
            if record is not None:
                log.info("build lease broken by evict", extra={"entry": f"{n}/{fp}", "holder": record.holder})
