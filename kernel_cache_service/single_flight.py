"""Single-flight get-or-build over a kernel cache: fetch an entry, or claim its key and build it
once while the other claimants wait for the publish (``docs/architecture.md`` §6; the leases
themselves are :mod:`kernel_cache_service.leases`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.leases import OWNER, PUBLISHED_EVENT, WAIT, Lease
from services.errors import Untrusted, WarmserveError

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Claim rounds before a caller stops coordinating and builds anyway (each round ends with a
#: publish it fetches, or a builder that died: this bounds a chain of failing builders).
MAX_CLAIM_ROUNDS = 5


def holder_name(who: str) -> str:
    """A lease holder / entry producer as the kernel cache records it: ``<who>@<host>:<pid>``."""
    return f"{who}@{socket.gethostname()}:{os.getpid()}"


def holder_who(holder: str) -> str:
    """The ``who`` part of a :func:`holder_name` (the whole text for other producers)."""
    return holder.split("@", 1)[0] or holder


@dataclass(frozen=True)
class Flight(Generic[T]):
    """What :func:`get_or_build` got: ``value`` (``fetch``'s or ``build``'s), ``built`` (built
    here), ``entry`` (the fetched entry, ``None`` when built), ``waited_s`` (seconds waited for
    another builder's publish; ``None`` when not waited), ``takeover`` (built under a lease taken
    over from a builder that died)."""

    value: T
    built: bool
    entry: EntryInfo | None = None
    waited_s: float | None = None
    takeover: bool = False


class LeaseKeeper:
    """While its ``with`` block runs (a build), renews ``lease`` every third of its TTL in a
    daemon thread; on exit releases it if a publish did not end it already, so waiters learn
    at once that a failed build will not publish. A lost lease (renewal refused: the kernel
    cache restarted, or the lease expired and was taken over) is logged; the build goes on and
    its publish then finds the key taken (``ALREADY_PRESENT``) or stores it."""

    def __init__(self, cache: KernelCacheClient, lease: Lease) -> None:
        self.cache, self.lease = cache, lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="build-lease", daemon=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease.ttl_s / 3):
            try:
                renewed = self.cache.renew(self.lease)
            except WarmserveError as e:
                log.warning("renewing the build lease on %s failed: %s", self.lease.name, e)
                continue
            if renewed is None:
                log.warning("the build lease on %s/%s was lost; building on", self.lease.name,
                            self.lease.fingerprint[:12])
                return
            self.lease = renewed

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.cache.release(self.lease)
        except WarmserveError as e:  # it expires by itself after its TTL
            log.warning("releasing the build lease on %s failed: %s", self.lease.name, e)


def get_or_build(cache: KernelCacheClient, name: str, fingerprint: str,
                 fetch: Callable[[], tuple[T, EntryInfo] | None], build: Callable[[], T], *,
                 holder: str, ttl_s: float | None = None,
                 progress: Callable[[str], None] | None = None) -> Flight[T]:
    """Get ``name``/``fingerprint``: ``fetch()`` it, or, on a miss, claim the key
    (:meth:`KernelCacheClient.claim`, a lease of ``ttl_s`` seconds naming ``holder``) and either
    ``build()`` it holding the lease (renewed by :class:`LeaseKeeper`; ``build`` publishes,
    which ends it) or wait for whoever builds it and fetch their publish. ``fetch`` returns
    ``(value, entry)`` or ``None`` (a miss, or an entry that does not load), or raises
    ``Untrusted`` (an entry whose signature is refused): then it builds here. When claiming or
    waiting fails (an old daemon, no token) or :data:`MAX_CLAIM_ROUNDS` rounds end without a
    publish, it builds uncoordinated. ``progress`` hears what it is doing ("compiling NAME
    here", "waiting for WHO to build NAME"). Raises what ``build`` raises."""
    say = progress or (lambda _what: None)

    def built(takeover: bool = False) -> Flight[T]:
        say(f"compiling {name} here")
        return Flight(build(), True, takeover=takeover)

    try:
        got = fetch()
    except Untrusted as e:  # claims would answer HIT for the refused entry: build here
        log.warning("the entry of %s is refused (%s); compiling here", name, e)
        return built()
    if got is not None:
        return Flight(got[0], False, got[1])
    t0 = time.perf_counter()
    for _ in range(MAX_CLAIM_ROUNDS):
        try:
            handle = cache.claim(name, fingerprint, holder=holder, ttl_s=ttl_s)
        except WarmserveError as e:
            log.warning("cannot claim the build of %s (%s); compiling without coordination", name, e)
            return built()
        with handle:
            claim = handle.claim
            if claim.status == OWNER:
                with LeaseKeeper(cache, claim.lease):
                    return built(claim.takeover)
            if claim.status == WAIT:
                say(f"waiting for {holder_who(claim.lease.holder)} to build {name}")
                try:
                    event = handle.wait()
                except WarmserveError as e:
                    log.warning("waiting for the build of %s failed (%s); compiling here", name, e)
                    return built()
                if event.status != PUBLISHED_EVENT:
                    continue  # the builder is gone: claim again
        try:
            got = fetch()
        except Untrusted as e:  # another builder's publish, refused
            log.warning("the published entry of %s is refused (%s); compiling here", name, e)
            return built()
        if got is not None:
            return Flight(got[0], False, got[1], waited_s=time.perf_counter() - t0)
    log.warning("no build of %s finished after %d claims; compiling here", name, MAX_CLAIM_ROUNDS)
    return built()
