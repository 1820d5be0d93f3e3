"""The programs' side of the kernel cache: open it, fetch, publish, evict a broken entry, get
a program single-flight (:meth:`KernelCacheClient.get_or_build`), record the parts record of each
key wanted and say why a key missed (``docs/architecture.md`` §9)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_cache_service.explain import explain, one_line, wanted_parts_path
from kernel_cache_service.fingerprint import UNKNOWN, known_parts, parse_parts
from kernel_cache_service.single_flight import Flight, holder_name, holder_who
from services.address import parse_address
from services.errors import InvalidArgument, Untrusted, WarmserveError

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient
    from kernel_cache_service.entry import EntryInfo
    from runner_service.programs.spec import ProgramSpec

log = logging.getLogger(__name__)

#: What a loader gets: ``(program, source, published, detail)``: ``source`` ``hit`` or
#: ``compiled``, ``published`` the kernel cache's answer to the publish (or ``""``), ``detail``
#: a phrase for the report.
Loaded = tuple[Callable, str, str, str]


def open_kernel_cache(spec: KernelCacheClient | str | Path | None) -> KernelCacheClient | None:
    """A client for ``spec``: a client as is; a ``"host:port"`` string
    (:func:`services.address.parse_address`, no ``/`` in the host, not an existing directory) a
    daemon; any other string or path an embedded store rooted there; ``None`` no cache."""
    from kernel_cache_service.client import KernelCacheClient

    if spec is None or isinstance(spec, KernelCacheClient):
        return spec
    text = str(spec)
    if isinstance(spec, str) and _is_address(text):
        return KernelCacheClient(text)
    return KernelCacheClient(root=text)


def _is_address(text: str) -> bool:
    try:
        host, _port = parse_address(text)
    except InvalidArgument:
        return False
    return "/" not in host and not os.path.isdir(text)


def publish(cache: KernelCacheClient | None, name: str, fp: str, path: Path, holder: str) -> str:
    """Publish ``path`` as ``name``/``fp``: the cache's answer, ``""`` without a cache, for an
    ``UNKNOWN`` key or for a verifying client without a signing key (an unsigned entry would be
    refused by every verifier and hold the key against a signed publish: designated builders
    publish instead), ``"FAILED"`` when the publish failed (logged; the program is still used)."""
    if cache is None or fp == UNKNOWN or (cache.trusted_keys is not None and cache.signing_key is None):
        return ""
    try:
        return cache.publish(name, fp, path, producer=holder)
    except (WarmserveError, OSError) as e:  # the compiled program is still used
        log.warning("publishing %s/%s failed (the program compiled here is used): %s", name, fp[:12], e)
        return "FAILED"


def fetch(cache: KernelCacheClient | None, name: str, fp: str, dest: Path) -> EntryInfo | None:
    """Fetch ``name``/``fp`` into ``dest``: its entry, or ``None`` (no cache, ``UNKNOWN`` key, a
    MISS, or a failed fetch, logged). Raises ``Untrusted`` (logged) for an entry the client's
    trusted keys refuse: nothing of it was written; the caller builds the program here."""
    if cache is None or fp == UNKNOWN:
        return None
    try:
        return cache.fetch(name, fp, dest)
    except Untrusted as e:  # refused before a byte was written: never loaded
        log.warning("refused the kernel cache's %s/%s, compiling locally: %s", name, fp[:12], e)
        raise
    except (WarmserveError, OSError) as e:
        log.warning("fetching %s/%s failed, compiling locally: %s", name, fp[:12], e)
        return None


def evict_broken(cache: KernelCacheClient, name: str, fp: str, error: Exception) -> None:
    """Evict ``name``/``fp``, an entry whose bytes do not load (``error``), so it is rebuilt."""
    log.warning("kernel cache entry %s/%s does not load (%s); evicting and recompiling", name, fp[:12], error)
    try:
        cache.evict(name, fp)
    except WarmserveError as e:
        log.warning("evicting %s/%s failed: %s", name, fp[:12], e)


def how_published(fp: str, cache: KernelCacheClient | None, published: str) -> str:
    """A phrase for the report: what became of a program built here."""
    if fp == UNKNOWN:
        return "fingerprint UNKNOWN, not published"
    if cache is None:
        return "no kernel cache"
    return published or "not published"


def holder(spec: ProgramSpec) -> str:
    """Who builds or publishes, as the kernel cache records it (:func:`holder_name` of the runner id)."""
    return holder_name(spec.runner_id)


def get_or_build(spec: ProgramSpec, cache: KernelCacheClient | None, name: str, fp: str,
                 fetch_program: Callable[[], tuple[Callable, EntryInfo] | None],
                 build: Callable[[str], tuple[Callable, str, float]],
                 progress: Callable[[str], None]) -> Loaded:
    """Program ``name``/``fp``: fetched, or built once across the runners sharing ``cache``
    (:meth:`KernelCacheClient.get_or_build`, lease of ``spec.build_lease_s``); without a cache or
    for an ``UNKNOWN`` key built here uncoordinated. ``fetch_program`` returns ``(program,
    entry)`` or ``None``; ``build(holder)`` returns ``(program, published, seconds)``."""
    who = holder(spec)
    if cache is None or fp == UNKNOWN:
        progress(f"compiling {name} here")
        flight: Flight = Flight(build(who), True)
    else:
        flight = cache.get_or_build(name, fp, fetch_program, lambda: build(who), holder=who,
                                    ttl_s=spec.build_lease_s, progress=progress)
    if flight.built:
        program, published, seconds = flight.value
        note = "; took over an expired build lease" if flight.takeover else ""
        return program, "compiled", published, \
            f"compiled {name} in {seconds:.1f} s here ({how_published(fp, cache, published)}{note})"
    entry, mib = flight.entry, flight.entry.size_bytes / 2**20
    if flight.waited_s is None:
        return flight.value, "hit", "", f"kernel cache HIT {name} ({mib:.1f} MiB)"
    return flight.value, "hit", "", (f"fetched {name} from {holder_who(entry.producer)}'s publish after waiting "
                                     f"{flight.waited_s:.1f} s ({mib:.1f} MiB)")


def record_wanted(work: Path, name: str, fp: str) -> None:
    """Write the parts record of ``name``/``fp`` (computed in this process) to
    :func:`~kernel_cache_service.explain.wanted_parts_path` in ``work``, for ``warmserve cache
    explain NAME FP``; nothing for an ``UNKNOWN`` key. A failed write is logged only."""
    parts = known_parts(fp) if fp != UNKNOWN else ""
    if not parts:
        return
    path = wanted_parts_path(work, name, fp)
    try:
        if not path.is_file():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(parts)
            os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot record the fingerprint parts of %s/%s: %s", name, fp[:12], e)


def miss_note(cache: KernelCacheClient | None, name: str, fp: str) -> str:
    """A phrase for the report after ``name``/``fp`` was built here: which parts differ from the
    nearest other entry of ``name`` (:func:`~kernel_cache_service.explain.one_line`), ``""`` when
    there is none, no cache or no parts record of ``fp`` in this process, or the store cannot
    be listed (logged)."""
    parts = known_parts(fp) if cache is not None and fp != UNKNOWN else ""
    if not parts:
        return ""
    try:
        others = [e for e in cache.list(name, with_parts=True) if e.fingerprint != fp]
    except WarmserveError as e:
        log.warning("cannot list %s entries to explain the MISS: %s", name, e)
        return ""
    return one_line(explain(name, fp, parse_parts(parts), others))


def trust_note(cache: KernelCacheClient | None, refused_before: int = 0) -> str:
    """A phrase for the report: whether fetched programs were verified (``artifacts not
    verified`` without trusted keys) and why each entry refused since ``refused_before`` was."""
    if cache is None:
        return "no kernel cache"
    if cache.trusted_keys is None:
        return "artifacts not verified"
    refused = cache.refusals[refused_before:]
    note = f"artifacts verified against {len(cache.trusted_keys.key_ids)} trusted key(s)"
    return note + "".join(f"; refused {r}" for r in refused)
