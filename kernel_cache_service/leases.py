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

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kernel_cache_service.entry import EntryInfo
from services.errors import InvalidArgument

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
