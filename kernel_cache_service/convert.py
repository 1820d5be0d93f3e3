"""Convert the kernel cache's core objects to and from the ``warmserve.v1`` messages: an
:class:`~kernel_cache_service.entry.EntryInfo` <-> ``EntryInfo``, a
:class:`~kernel_cache_service.entry.PublishResult` <-> ``PublishResponse``, a
:class:`~kernel_cache_service.leases.Lease` <-> ``Lease``, a
:class:`~kernel_cache_service.leases.Claim` <-> ``ClaimResponse``."""

from __future__ import annotations

from kernel_cache_service.entry import EntryInfo, PublishResult
from kernel_cache_service.leases import Claim, Lease
from services.proto import kernel_cache_pb2 as pb

#: Status enum values carry their type's prefix in the proto (``STATUS_PUBLISHED``); the core
#: objects use the bare names (``PUBLISHED``).
_STATUS_PREFIX = "STATUS_"


def entry_to_proto(info: EntryInfo) -> pb.EntryInfo:
    """:class:`EntryInfo` as the ``warmserve.v1.EntryInfo`` message."""
    return pb.EntryInfo(
        key=pb.ProgramKey(name=info.name, fingerprint=info.fingerprint),
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        created_unix_s=info.created,
        last_access_unix_s=info.last_access,
        producer=info.producer,
        format=info.format,
        signature=info.signature,
        fingerprint_parts=info.parts,
    )


def entry_from_proto(msg: pb.EntryInfo) -> EntryInfo:
    """The inverse of :func:`entry_to_proto`."""
    return EntryInfo(
        name=msg.key.name,
        fingerprint=msg.key.fingerprint,
        size_bytes=msg.size_bytes,
        sha256=msg.sha256,
        created=msg.created_unix_s,
        producer=msg.producer,
        format=msg.format,
        last_access=msg.last_access_unix_s,
        signature=msg.signature,
        parts=msg.fingerprint_parts,
    )


def publish_to_proto(result: PublishResult) -> pb.PublishResponse:
    """:class:`PublishResult` as the ``warmserve.v1.PublishResponse`` message."""
    return pb.PublishResponse(
        status=pb.PublishResponse.Status.Value(_STATUS_PREFIX + result.status),
        reason=result.reason,
        entry=entry_to_proto(result.entry) if result.entry else None,
    )


def publish_from_proto(msg: pb.PublishResponse) -> PublishResult:
    """The inverse of :func:`publish_to_proto`."""
    return PublishResult(
        status=pb.PublishResponse.Status.Name(msg.status).removeprefix(_STATUS_PREFIX),
        reason=msg.reason,
        entry=entry_from_proto(msg.entry) if msg.HasField("entry") else None,
    )


def lease_to_proto(lease: Lease) -> pb.Lease:
    """:class:`Lease` as the ``warmserve.v1.Lease`` message."""
    return pb.Lease(key=pb.ProgramKey(name=lease.name, fingerprint=lease.fingerprint), lease_id=lease.lease_id,
                    holder=lease.holder, expires_unix_s=lease.expires, ttl_s=lease.ttl_s)


def lease_from_proto(msg: pb.Lease) -> Lease:
    """The inverse of :func:`lease_to_proto`."""
    return Lease(msg.key.name, msg.key.fingerprint, msg.lease_id, msg.holder, msg.expires_unix_s, msg.ttl_s)


def claim_to_proto(claim: Claim) -> pb.ClaimResponse:
    """:class:`Claim` as the ``warmserve.v1.ClaimResponse`` message."""
    return pb.ClaimResponse(status=pb.ClaimResponse.Status.Value(_STATUS_PREFIX + claim.status),
                         entry=entry_to_proto(claim.entry) if claim.entry else None,
                         lease=lease_to_proto(claim.lease) if claim.lease else None, takeover=claim.takeover)


def claim_from_proto(msg: pb.ClaimResponse) -> Claim:
    """The inverse of :func:`claim_to_proto`."""
    return Claim(pb.ClaimResponse.Status.Name(msg.status).removeprefix(_STATUS_PREFIX),
                 entry=entry_from_proto(msg.entry) if msg.HasField("entry") else None,
                 lease=lease_from_proto(msg.lease) if msg.HasField("lease") else None, takeover=msg.takeover)
