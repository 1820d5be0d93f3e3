"""Convert :class:`~weight_service.prepare.SidecarHandle` and progress events to and from the
``warmserve.v1`` messages (residency ``None`` <-> ``-1``)."""

from __future__ import annotations

from pathlib import Path

from services.proto import weights_pb2
from weight_service.prepare import SidecarHandle
from weight_service.progress import ProgressEvent

_STATES = {"HOT": weights_pb2.SIDECAR_STATE_HOT, "COLD": weights_pb2.SIDECAR_STATE_COLD,
           "BUILT": weights_pb2.SIDECAR_STATE_BUILT, "REBUILT": weights_pb2.SIDECAR_STATE_REBUILT}
_STATE_NAMES = {v: k for k, v in _STATES.items()}


def handle_to_proto(handle: SidecarHandle, files: list[tuple[str, int, str]] = ()) -> weights_pb2.SidecarHandle:
    """The message for ``handle``; ``files`` are ``(name, size in bytes, sha256 hex or "")``."""
    return weights_pb2.SidecarHandle(
        path=str(handle.path), fingerprint=handle.fingerprint, size_bytes=handle.size_bytes,
        residency=-1.0 if handle.residency is None else handle.residency,
        state=_STATES[handle.state], family=handle.family, dtype=handle.dtype, source=handle.source,
        files=[weights_pb2.SidecarFile(name=n, size_bytes=s, sha256=h) for n, s, h in files],
        seconds=handle.seconds,
    )


def handle_from_proto(msg: weights_pb2.SidecarHandle) -> SidecarHandle:
    """The :class:`SidecarHandle` a message describes (``path`` is on the server's host)."""
    return SidecarHandle(
        path=Path(msg.path), fingerprint=msg.fingerprint, size_bytes=msg.size_bytes,
        residency=None if msg.residency < 0 else msg.residency,
        state=_STATE_NAMES.get(msg.state, "COLD"), family=msg.family, dtype=msg.dtype, source=msg.source,
        seconds=msg.seconds,
    )


def progress_to_proto(event: ProgressEvent) -> weights_pb2.PrepareProgress:
    """The ``PrepareProgress`` message for one :class:`ProgressEvent`."""
    return weights_pb2.PrepareProgress(phase=event.phase, layers_done=event.layers_done,
                                       layers_total=event.layers_total, bytes_written=event.bytes_written,
                                       message=event.message)


def progress_from_proto(msg: weights_pb2.PrepareProgress) -> ProgressEvent:
    """The inverse of :func:`progress_to_proto`."""
    return ProgressEvent(phase=msg.phase, layers_done=msg.layers_done, layers_total=msg.layers_total,
                         bytes_written=msg.bytes_written, message=msg.message)
