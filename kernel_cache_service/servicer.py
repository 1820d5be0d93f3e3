"""The KernelCache servicer: a thin adapter from ``warmserve.v1.KernelCache`` to a
:class:`kernel_cache_service.store_api.KernelStoreAPI` (disk or S3), and :func:`build_server`, which puts it behind
the server bootstrap with the store's metrics.

The servicer validates and translates only: store errors become gRPC statuses
(:func:`services.errors.abort_with`), :class:`EntryInfo` becomes the proto message
(:mod:`kernel_cache_service.convert`). Fetch streams the blob from disk in chunks
(``chunk_bytes`` from the request, default 1 MiB, at most 4 MiB), the first message carrying the
entry info; Publish writes the incoming chunks straight into the store's temp file. Neither ever
holds a whole artifact in memory.

Claim answers from the store's single-flight leases (:mod:`kernel_cache_service.leases`); after
a WAIT its stream stays open, polling the store, until the entry is published or the builder's
lease ends (the store is shared with other processes, so there is nothing to be notified by).

With ``--auth-file`` every RPC needs its scope (:mod:`services.scopes`: Lookup/Fetch/List/Stat
``read``, Publish/Claim/leases ``publish``, Evict ``admin``).

Limits: Publish, Fetch and Claim each hold one of ``--max-streams`` stream slots
(:mod:`services.stream_slots`; one more is ``UNAVAILABLE``), so streams never take the threads
Lookup and health checks need; a Publish whose client sends nothing for ``--publish-idle-timeout``
seconds is cancelled (:mod:`services.idle_streams`); headers and holders are checked
(:mod:`kernel_cache_service.limits`) before anything is written. Each refusal counts in
``warmserve_refused_total{reason}``.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kernel_cache_service.artifact import CorruptArtifact
from kernel_cache_service.convert import (
    claim_to_proto,
    entry_to_proto,
    lease_from_proto,
    lease_to_proto,
    publish_to_proto,
)
from kernel_cache_service.counters import COUNTERS
from kernel_cache_service.entry import PublishResult
from kernel_cache_service.leases import WAIT
from kernel_cache_service.limits import (
    DEFAULT_PUBLISH_IDLE_S,
    MAX_LIST_PARTS_BYTES,
    check_publish_header,
    check_text,
)
from kernel_cache_service.store_api import KernelStoreAPI
from services.bootstrap import ServerConfig, ServiceServer
from services.errors import InvalidArgument, NotFound, Unavailable, WarmserveError, abort_with
from services.idle_streams import IdleStreams
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc
from services.refusals import Refusals
from services.stream_slots import StreamSlots

SERVICE_NAME = "warmserve.v1.KernelCache"
#: Seconds between two looks at the store while a Claim stream waits for a build.
WAIT_POLL_S = 0.1
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20



class KernelCacheServicer(pb_grpc.KernelCacheServicer):
    """``warmserve.v1.KernelCache`` over ``store``: at most ``max_streams`` Publish/Fetch/Claim
    streams at once; a Publish idle for ``publish_idle_s`` seconds is cancelled; refusals count
    in ``refused``."""

    def __init__(self, store: KernelStoreAPI, *, max_streams: int = ServerConfig.max_streams,
                 publish_idle_s: float = DEFAULT_PUBLISH_IDLE_S) -> None:
        self.store = store
        #: ``warmserve_refused_total{reason}``; :func:`build_server` registers it on the server's registry.
        self.refused = Refusals()
        self.slots = StreamSlots(max_streams, "the kernel cache")
        self.idle = IdleStreams(publish_idle_s, "Publish", lambda: self.refused.add("idle_stream"))
        #: Set when the server drains: waiting Claim streams end at once with UNAVAILABLE (their
        #: clients then build or claim elsewhere) instead of holding the drain for its whole grace.
        self.draining = threading.Event()

    def _take_slot(self, context) -> None:
        try:
            self.slots.take(context)
        except Unavailable:
            self.refused.add("stream_slots")
            raise

    def _fail(self, context, error: WarmserveError) -> None:
        if isinstance(error, InvalidArgument):
            self.refused.add("invalid_argument")
        abort_with(context, error)

    def Lookup(self, request, context):
        """HIT with the entry's info, or MISS."""
        try:
            info = self.store.lookup(request.key.name, request.key.fingerprint)
        except WarmserveError as e:
            abort_with(context, e)
        if info is None:
            return pb.LookupResponse(status=pb.LookupResponse.STATUS_MISS)
        return pb.LookupResponse(status=pb.LookupResponse.STATUS_HIT, entry=entry_to_proto(info))

    def Fetch(self, request, context):
        """Stream the entry's blob in chunks, the first one carrying its info; NOT_FOUND on a miss."""
        chunk_bytes = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        key = request.key
        try:
            self._take_slot(context)
            reader = self.store.open(key.name, key.fingerprint)
        except WarmserveError as e:
            self._fail(context, e)
        if reader is None:
            abort_with(context, NotFound(f"no entry {key.name}/{key.fingerprint}"))
        with reader:
            entry = entry_to_proto(reader.info)
            sent_first = False
            try:
                for block in reader.chunks(chunk_bytes):
                    if sent_first:
                        yield pb.FetchResponse(data=block)
                    else:
                        yield pb.FetchResponse(entry=entry, data=block)
                        sent_first = True
            except CorruptArtifact as e:
                abort_with(context, e)
            if not sent_first:  # an empty artifact still announces itself
                yield pb.FetchResponse(entry=entry)

    def Publish(self, request_iterator, context):
        """Store the streamed artifact (a header, then chunks) under its key."""
        try:
            self._take_slot(context)
            return publish_to_proto(self._publish(self.idle.guard(request_iterator, context)))
        except WarmserveError as e:
            self._fail(context, e)

    def _publish(self, request_iterator) -> PublishResult:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("the first Publish message must be a PublishHeader")
        h = first.header
        if not h.sha256:
            raise InvalidArgument("the PublishHeader must carry the sha256 of the artifact")
        fmt, sha256 = h.format or "file", h.sha256.lower()
        parts = check_publish_header(h.key.name, h.key.fingerprint, fmt=fmt, producer=h.producer, sha256=sha256,
                                     parts=h.fingerprint_parts)
        early = self.store.precheck(h.key.name, h.key.fingerprint, h.size_bytes)
        if early is not None:
            return early
        with self.store.begin_publish(h.key.name, h.key.fingerprint, fmt=fmt, producer=h.producer,
                                      size=h.size_bytes, sha256=sha256, signature=h.signature,
                                      parts=parts) as pending:
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise InvalidArgument("only chunks may follow the PublishHeader")
                pending.write(msg.chunk)
                if pending.overflowed:  # refused at the first byte past the size: nothing is kept
                    self.refused.add("past_declared_size")
                    break
            return pending.commit()

    def List(self, request, context):
        """Entries whose name starts with the prefix (with their parts records when asked, up to
        :data:`~kernel_cache_service.limits.MAX_LIST_PARTS_BYTES` of them)."""
        try:
            entries = self.store.list(request.name_prefix, with_parts=request.with_parts)
        except WarmserveError as e:
            abort_with(context, e)
        budget = MAX_LIST_PARTS_BYTES
        out = []
        for e in entries:
            if e.parts and len(e.parts) > budget:
                e = replace(e, parts="")
            budget -= len(e.parts)
            out.append(entry_to_proto(e))
        return pb.ListResponse(entries=out)

    def Stat(self, request, context):
        """Store totals and counters."""
        s = self.store.stat()
        return pb.StatResponse(**s)

    def Evict(self, request, context):
        """Remove one entry, every fingerprint of a name, or everything."""
        try:
            count, freed = self.store.evict(request.key.name or None, request.key.fingerprint or None,
                                            all=request.all)
        except WarmserveError as e:
            abort_with(context, e)
        return pb.EvictResponse(evicted=count, freed_bytes=freed)


    def Claim(self, request, context):
        """HIT, OWNER or WAIT; after WAIT, PUBLISHED or LEASE_EXPIRED when the build ends."""
        key = request.key
        try:
            self._take_slot(context)
            check_text(request.holder, "the holder")
            claim = self.store.claim(key.name, key.fingerprint, request.holder, request.ttl_s or None)
        except WarmserveError as e:
            self._fail(context, e)
        yield claim_to_proto(claim)
        if claim.status != WAIT:
            return
        while context.is_active():
            if self.draining.is_set():
                abort_with(context, Unavailable("the kernel cache is shutting down; claim again"))
            event = self.store.wait_build(key.name, key.fingerprint, timeout_s=0.5, poll_s=WAIT_POLL_S)
            if event is not None:
                yield claim_to_proto(event)
                return

    def RenewLease(self, request, context):
        """The lease extended by its TTL, or held=false when it is no longer held."""
        try:
            renewed = self.store.renew(lease_from_proto(request.lease))
        except WarmserveError as e:
            abort_with(context, e)
        if renewed is None:
            return pb.RenewLeaseResponse(held=False)
        return pb.RenewLeaseResponse(held=True, lease=lease_to_proto(renewed))

    def ReleaseLease(self, request, context):
        """Give the lease up (held=false when it was no longer held)."""
        try:
            return pb.ReleaseLeaseResponse(held=self.store.release(lease_from_proto(request.lease)))
        except WarmserveError as e:
            abort_with(context, e)


class StoreCollector:
    """Prometheus collector: the store's counters and its size, read at scrape time."""

    def __init__(self, store: KernelStoreAPI) -> None:
        self.store = store

    def collect(self):
        """Prometheus collector protocol: the metrics, read now."""
        s = self.store.stat()
        for name in COUNTERS:
            c = CounterMetricFamily(f"warmserve_kernel_cache_{name}", f"kernel-cache {name} since start")
            c.add_metric([], s[name])
            yield c
        for name, unit in (("entries", ""), ("total_bytes", " in bytes"), ("max_bytes", " in bytes (0 = none)"),
                           ("leases", " (build leases held now)")):
            g = GaugeMetricFamily(f"warmserve_kernel_cache_{name}", f"kernel-cache {name}{unit}")
            g.add_metric([], s[name])
            yield g


def build_server(store: KernelStoreAPI, config: ServerConfig, *,
                 publish_idle_s: float = DEFAULT_PUBLISH_IDLE_S) -> ServiceServer:
    """A not-yet-started :class:`ServiceServer` serving ``store`` (with its metrics registered),
    its streams capped at ``config.max_streams``, a Publish idle for ``publish_idle_s`` seconds
    cancelled."""
    servicer = KernelCacheServicer(store, max_streams=config.max_streams, publish_idle_s=publish_idle_s)
    server = ServiceServer(config, [(pb_grpc.add_KernelCacheServicer_to_server, servicer, SERVICE_NAME)],
                           refusals=servicer.refused)
    server.registry.register(StoreCollector(store))
    server.on_drain.append(servicer.draining.set)
    return server
