"""The kernel-cache client: one API over a daemon (gRPC) or an embedded store (a local directory).

``KernelCacheClient("127.0.0.1:50051")`` talks to a daemon; ``KernelCacheClient(root=DIR)``
opens a :class:`~kernel_cache_service.store.KernelStore` in-process, no daemon needed. Both give
the same answers: a MISS is ``None``; publish returns ``"PUBLISHED"``, ``"ALREADY_PRESENT"`` or
``"REJECTED"``; bad keys raise :class:`services.errors.InvalidArgument` before anything is sent;
daemon errors come back as the matching :class:`services.errors.WarmserveError` (an unreachable
daemon is :class:`services.errors.Unavailable`).

Single-flight builds: :meth:`KernelCacheClient.claim` returns a :class:`ClaimHandle` (HIT,
OWNER with a lease, or WAIT, whose :meth:`ClaimHandle.wait` blocks until the build ends);
:meth:`renew` and :meth:`release` keep or drop a lease (see :mod:`kernel_cache_service.leases`);
:meth:`get_or_build` runs the whole protocol (:mod:`kernel_cache_service.single_flight`).

Memory stays bounded for any artifact size: publishing a file hashes it in one pass and streams
it in a second; a directory is packed into a temporary tar while being hashed, then streamed;
fetch writes chunks to a temp file (or unpacks the tar as it arrives) next to ``dest`` and
renames it into place only after the sha256 matched.

Signed artifacts (``docs/architecture.md`` §6, "signed entries"): a client given a
``signing_key`` signs what it publishes (:meth:`EntryInfo.signed_payload`); one given
``trusted_keys`` verifies the signature of every entry it fetches before writing a byte of it,
and (a directory) the whole tar's sha256 before unpacking it; a refusal raises
``services.errors.Untrusted`` and is recorded in :attr:`KernelCacheClient.refusals`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc

from kernel_cache_service import single_flight
from kernel_cache_service.artifact import (
    CHUNK_BYTES,
    CorruptArtifact,
    HashingWriter,
    hash_file,
    install_stream,
    install_verified,
    iter_file,
    pack_directory,
)
from kernel_cache_service.convert import (
    claim_from_proto,
    entry_from_proto,
    lease_from_proto,
    lease_to_proto,
    publish_from_proto,
)
from kernel_cache_service.entry import ALREADY_PRESENT, REJECTED, EntryInfo, PublishResult
from kernel_cache_service.explain import DEFAULT_NEAREST, Explanation, explain
from kernel_cache_service.fingerprint import UNKNOWN, known_parts
from kernel_cache_service.keys import validate_key, validate_prefix
from kernel_cache_service.leases import WAIT, Claim, Lease, validate_ttl
from kernel_cache_service.single_flight import Flight
from kernel_cache_service.store import KernelStore
from kernel_cache_service.store_api import KernelStoreAPI
from services.channel import ClientSecurity, open_channel
from services.errors import InvalidArgument, Untrusted, WarmserveError, from_rpc_error
from services.paths import default_kernel_cache_root
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc
from services.signing import SigningKey, TrustedKeys

__all__ = ["ClaimHandle", "EntryInfo", "KernelCacheClient", "Lease"]

T = TypeVar("T")


class ClaimHandle:
    """The answer to :meth:`KernelCacheClient.claim`: ``claim`` (a :class:`Claim`: ``status``
    HIT, OWNER or WAIT, ``entry``, ``lease``, ``takeover``). After WAIT, :meth:`wait` blocks until
    the build ends; :meth:`cancel` (or leaving a ``with`` block) stops waiting."""

    def __init__(self, claim: Claim, next_event: Callable[[], Claim] | None = None,
                 cancel: Callable[[], None] | None = None) -> None:
        self.claim = claim
        self._next, self._cancel = next_event, cancel

    @property
    def status(self) -> str:
        """``HIT``, ``OWNER`` or ``WAIT``."""
        return self.claim.status

    def wait(self) -> Claim:
        """After ``WAIT``: block until the entry is ``PUBLISHED`` (``entry`` set) or the builder's
        lease ended without a publish (``LEASE_EXPIRED``: claim again). Raises ``RuntimeError``
        for any other status, ``Unavailable`` when the daemon goes away meanwhile."""
        if self.claim.status != WAIT or self._next is None:
            raise RuntimeError(f"only a WAIT claim can be waited on, this one is {self.claim.status}")
        event, self._next = self._next(), None
        self.cancel()
        return event

    def cancel(self) -> None:
        """Stop waiting (no-op once the wait ended, or for HIT/OWNER)."""
        if self._cancel is not None:
            self._cancel()
            self._cancel = None

    def __enter__(self) -> ClaimHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class KernelCacheClient:
    """Kernel-cache operations against the daemon at ``address`` or, without one, an embedded
    store at ``root`` (default :func:`services.paths.default_kernel_cache_root`; ``max_bytes``:
    its byte budget, 0 = unlimited).

    ``store``: with an embedded store, an ``s3://BUCKET/PREFIX`` to share through (``root`` is
    then its local tier, see :mod:`kernel_cache_service.s3_store`).
    ``security`` is what the client presents to a daemon (its bearer token and TLS files).
    ``timeout_s`` bounds each unary call (seconds); streams (fetch, publish) have no deadline.
    ``signing_key``: what publishes are signed with; ``trusted_keys``: the keys a fetched entry
    must be signed by (``None``: fetched entries are not verified, as before signing existed).
    Raises ``InvalidArgument`` when both ``address`` and ``root`` (or ``store``) are given, and for
    a ``store`` that cannot be used (malformed URL, unreachable endpoint, missing bucket, ...).
    """

    def __init__(self, address: str | None = None, *, root: str | Path | None = None,
                 security: ClientSecurity | None = None, max_bytes: int = 0, timeout_s: float = 30.0,
                 store: str | None = None, signing_key: SigningKey | None = None,
                 trusted_keys: TrustedKeys | None = None) -> None:
        if address is not None and (root is not None or store is not None):
            raise InvalidArgument("give a daemon address or an embedded store (root, store), not both")
        self.address = address
        self.timeout_s = timeout_s
        self.signing_key, self.trusted_keys = signing_key, trusted_keys
        #: One sentence per entry refused by :meth:`fetch` (its signature failed), oldest first.
        self.refusals: list[str] = []
        self._store: KernelStoreAPI | None = None
        self._channel: grpc.Channel | None = None
        if address is None and store:
            from kernel_cache_service.s3_store import S3KernelStore

            self._store = S3KernelStore.open_url(store, root or default_kernel_cache_root(), max_bytes=max_bytes)
        elif address is None:
            self._store = KernelStore(root or default_kernel_cache_root(), max_bytes=max_bytes)
        else:
            self._channel = open_channel(address, security=security)
            self._stub = pb_grpc.KernelCacheStub(self._channel)

    # ---------------------------------------------------------------- helpers

    def _error(self, err: grpc.RpcError) -> WarmserveError:
        e = from_rpc_error(err)
        return type(e)(f"kernel cache at {self.address}: {e}")

    def _error_text(self, text: str) -> WarmserveError:
        from services.errors import Unavailable

        return Unavailable(f"kernel cache at {self.address}: {text}")

    def _unary(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise self._error(err) from None

    # ---------------------------------------------------------------- reads

    def lookup(self, name: str, fingerprint: str) -> EntryInfo | None:
        """The entry's info on a HIT, ``None`` on a MISS (``UNKNOWN`` is always a MISS)."""
        validate_key(name, fingerprint)
        if self._store is not None:
            return self._store.lookup(name, fingerprint)
        resp = self._unary(self._stub.Lookup, pb.LookupRequest(key=pb.ProgramKey(name=name, fingerprint=fingerprint)))
        return entry_from_proto(resp.entry) if resp.status == pb.LookupResponse.STATUS_HIT else None

    def fetch(self, name: str, fingerprint: str, dest: str | Path, *, chunk_bytes: int = 0) -> EntryInfo | None:
        """Write the entry at ``dest`` atomically: the file, or the directory restored from its tar
        (an existing ``dest`` directory is swapped out). ``None`` on a MISS, including an entry
        found corrupt (the store quarantines it) or bytes that fail the sha256 check in transit.
        ``chunk_bytes``: stream chunk size asked of the daemon (0 = its default, 1 MiB).
        With ``trusted_keys``, raises ``Untrusted`` (nothing written) for an entry whose signature
        is missing, malformed, by an untrusted key or wrong.
        """
        validate_key(name, fingerprint)
        check = None if self.trusted_keys is None else self._check_signature
        if self._store is not None:
            return self._store.fetch(name, fingerprint, dest, check)
        request = pb.FetchRequest(key=pb.ProgramKey(name=name, fingerprint=fingerprint), chunk_bytes=chunk_bytes)
        responses = self._stub.Fetch(request)
        try:
            try:
                first = next(responses)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                raise self._error(err) from None
            info = entry_from_proto(first.entry)
            install = install_stream if check is None else install_verified
            if check is not None:
                check(info)
            try:
                install(self._verified(info, first.data, responses), info.format, dest)
            except CorruptArtifact:
                return None
            return info
        finally:
            responses.cancel()

    def _check_signature(self, info: EntryInfo) -> str:
        """The key id that signed ``info``; ``Untrusted`` (recorded in :attr:`refusals`) otherwise."""
        try:
            return self.trusted_keys.verify(info.signed_payload(), info.signature,
                                            f"program {info.name}/{info.fingerprint[:12]}")
        except Untrusted as e:
            self.refusals.append(str(e))
            raise

    def _verified(self, info: EntryInfo, first: bytes, responses) -> Iterator[bytes]:
        sha, size = hashlib.sha256(first), len(first)
        yield first
        try:
            for msg in responses:
                sha.update(msg.data)
                size += len(msg.data)
                yield msg.data
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # found corrupt by the daemon at the end
                raise CorruptArtifact(err.details()) from None
            raise self._error(err) from None
        if size != info.size_bytes or sha.hexdigest() != info.sha256:
            raise CorruptArtifact(f"{info.name}/{info.fingerprint}: bytes received do not match the entry")

    def list(self, prefix: str = "", *, with_parts: bool = False) -> list[EntryInfo]:
        """Entries whose name starts with ``prefix``, sorted by name then fingerprint; with
        ``with_parts``, each with its fingerprint parts record (``EntryInfo.parts``, ``""`` when
        it has none; a daemon sends at most 4 MiB of them per answer)."""
        validate_prefix(prefix)
        if self._store is not None:
            return self._store.list(prefix, with_parts)
        resp = self._unary(self._stub.List, pb.ListRequest(name_prefix=prefix, with_parts=with_parts))
        return [entry_from_proto(e) for e in resp.entries]

    def explain(self, name: str, fingerprint: str, wanted: dict, limit: int = DEFAULT_NEAREST) -> Explanation:
        """How the parts record ``wanted`` of ``name``/``fingerprint`` differs from those of the
        stored entries of ``name`` (:func:`kernel_cache_service.explain.explain`: the ``limit``
        nearest). Raises ``InvalidArgument`` for a bad key."""
        validate_key(name, fingerprint)
        return explain(name, fingerprint, wanted, self.list(name, with_parts=True), limit)

    def stat(self) -> dict:
        """``root``, ``entries``, ``total_bytes``, ``max_bytes``, the counters since the store /
        daemon started (:data:`kernel_cache_service.counters.COUNTERS`: hits, misses, publishes,
        evictions, quarantined, claims, waits, builds, takeovers) and ``leases`` held now."""
        if self._store is not None:
            return self._store.stat()
        resp = self._unary(self._stub.Stat, pb.StatRequest())
        return {f.name: getattr(resp, f.name) for f in pb.StatResponse.DESCRIPTOR.fields}

    # ---------------------------------------------------------------- single-flight builds

    def claim(self, name: str, fingerprint: str, *, holder: str = "", ttl_s: float | None = None) -> ClaimHandle:
        """Ask for the right to build ``name``/``fingerprint``: HIT, OWNER (a lease of ``ttl_s``
        seconds, default 30, naming ``holder``; renew it with :meth:`renew` every third of it)
        or WAIT (the builder's lease; :meth:`ClaimHandle.wait` for the end of the build). Raises
        ``InvalidArgument`` for a bad key, an ``UNKNOWN`` fingerprint or a bad TTL."""
        validate_key(name, fingerprint)
        ttl = validate_ttl(ttl_s)
        if self._store is not None:
            store = self._store
            claim = store.claim(name, fingerprint, holder or _default_producer(), ttl)
            return ClaimHandle(claim, lambda: store.wait_build(name, fingerprint))
        request = pb.ClaimRequest(key=pb.ProgramKey(name=name, fingerprint=fingerprint),
                                  holder=holder or _default_producer(), ttl_s=ttl)
        responses = self._stub.Claim(request)

        def next_event() -> Claim:
            try:
                return claim_from_proto(next(responses))
            except StopIteration:
                raise self._error_text("the Claim stream ended without an event") from None
            except grpc.RpcError as err:
                raise self._error(err) from None

        first = next_event()
        if first.status != WAIT:
            responses.cancel()
            return ClaimHandle(first)
        return ClaimHandle(first, next_event, responses.cancel)

    def renew(self, lease: Lease) -> Lease | None:
        """``lease`` extended by its TTL from now, ``None`` when it is no longer held."""
        if self._store is not None:
            return self._store.renew(lease)
        resp = self._unary(self._stub.RenewLease, pb.RenewLeaseRequest(lease=lease_to_proto(lease)))
        return lease_from_proto(resp.lease) if resp.held else None

    def release(self, lease: Lease) -> bool:
        """Give ``lease`` up without publishing; ``False`` when it was no longer held."""
        if self._store is not None:
            return self._store.release(lease)
        return self._unary(self._stub.ReleaseLease, pb.ReleaseLeaseRequest(lease=lease_to_proto(lease))).held

    def get_or_build(self, name: str, fingerprint: str, fetch: Callable[[], tuple[T, EntryInfo] | None],
                     build: Callable[[], T], *, holder: str, ttl_s: float | None = None,
                     progress: Callable[[str], None] | None = None) -> Flight[T]:
        """Fetch ``name``/``fingerprint`` or build it once across every claimant of the key
        (:func:`kernel_cache_service.single_flight.get_or_build`)."""
        return single_flight.get_or_build(self, name, fingerprint, fetch, build, holder=holder, ttl_s=ttl_s,
                                          progress=progress)

    # ---------------------------------------------------------------- writes

    def publish(self, name: str, fingerprint: str, path: str | Path, *, producer: str = "",
                parts: str | None = None) -> str:
        """Publish the file or directory at ``path``: ``"PUBLISHED"``, ``"ALREADY_PRESENT"`` or
        ``"REJECTED"`` (see :meth:`publish_result` for the reason and ``parts``)."""
        return self.publish_result(name, fingerprint, path, producer=producer, parts=parts).status

    def publish_result(self, name: str, fingerprint: str, path: str | Path, *, producer: str = "",
                       parts: str | None = None) -> PublishResult:
        """Like :meth:`publish` but returns the whole :class:`PublishResult` (status, reason, entry);
        signed with :attr:`signing_key` when the client has one. ``parts``: the key's fingerprint
        parts record (JSON); ``None`` takes the one this process computed for ``fingerprint``
        (:func:`~kernel_cache_service.fingerprint.known_parts`), if any; ``""`` sends none.

        Raises ``InvalidArgument`` for a bad key, a parts record the store refuses (nothing is
        stored) or a ``path`` that is neither file nor directory.
        """
        path = Path(path)
        validate_key(name, fingerprint)
        if not (path.is_file() or path.is_dir()):
            raise InvalidArgument(f"{path} is not a file or a directory")
        parts = known_parts(fingerprint) if parts is None else parts
        if self._store is not None:
            return self._store.publish(name, fingerprint, path, producer=producer or _default_producer(),
                                       signer=self.signing_key, parts=parts)
        if fingerprint == UNKNOWN:
            return PublishResult(REJECTED, "the fingerprint is UNKNOWN; unknown keys are never stored")
        present = self.lookup(name, fingerprint)
        if present is not None:
            return PublishResult(ALREADY_PRESENT, "", present)
        if path.is_file():
            size, sha = hash_file(path)
            return self._stream_publish(name, fingerprint, path, size, sha, "file", producer, parts)
        with tempfile.TemporaryDirectory(prefix="warmserve-publish-") as tmp:
            tar_path = Path(tmp) / "artifact.tar"
            with open(tar_path, "wb") as f:
                sink = HashingWriter(f)
                pack_directory(path, sink)
            return self._stream_publish(name, fingerprint, tar_path, sink.size, sink.sha256, "dir", producer, parts)

    def _stream_publish(self, name: str, fingerprint: str, blob: Path, size: int, sha: str,
                        fmt: str, producer: str, parts: str) -> PublishResult:
        producer = producer or _default_producer()
        signature = ""
        if self.signing_key is not None:
            unsigned = EntryInfo(name, fingerprint, size, sha, created=0.0, producer=producer, format=fmt)
            signature = self.signing_key.sign(unsigned.signed_payload()).to_text()
        header = pb.PublishHeader(key=pb.ProgramKey(name=name, fingerprint=fingerprint), size_bytes=size,
                                  sha256=sha, producer=producer, format=fmt, signature=signature,
                                  fingerprint_parts=parts)

        def requests():
            yield pb.PublishRequest(header=header)
            for block in iter_file(blob, CHUNK_BYTES):
                yield pb.PublishRequest(chunk=block)

        try:
            resp = self._stub.Publish(requests())
        except grpc.RpcError as err:
            raise self._error(err) from None
        return publish_from_proto(resp)

    def evict(self, name: str | None = None, fingerprint: str | None = None, *, all: bool = False) -> tuple[int, int]:
        """Evict one entry, every fingerprint of ``name``, or everything with ``all``; entries being
        read are skipped. Returns ``(entries evicted, bytes freed)``."""
        if self._store is not None:
            return self._store.evict(name, fingerprint, all=all)
        request = pb.EvictRequest(key=pb.ProgramKey(name=name or "", fingerprint=fingerprint or ""), all=all)
        resp = self._unary(self._stub.Evict, request)
        return resp.evicted, resp.freed_bytes

    def close(self) -> None:
        """Close the channel (no-op for an embedded store)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> KernelCacheClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _default_producer() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"
