"""Client of the ``Weights`` service: prepare a sidecar remotely, fetch one into a local cache."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from services.channel import ClientSecurity, open_channel
from services.errors import FailedPrecondition, WarmserveError, from_rpc_error
from services.proto import weights_pb2, weights_pb2_grpc
from weight_service.catalog import find_sidecar
from weight_service.convert import handle_from_proto, progress_from_proto
from weight_service.prepare import SidecarHandle, sidecar_lock
from weight_service.progress import ProgressEvent
from weight_service.sidecar import (
    SIDECAR_FILES,
    finish_temp_file,
    new_temp_file,
    publish,
    remove_temp_files,
    validate_sidecar,
)


class WeightsClient:
    """Talks to a ``Weights`` server at ``address`` (``host:port``). Errors come back as
    :class:`services.errors.WarmserveError` subclasses (``from_rpc_error``)."""

    def __init__(self, address: str, *, security: ClientSecurity | None = None,
                 ready_timeout_s: float | None = 10.0) -> None:
        self._channel = open_channel(address, security=security, ready_timeout_s=ready_timeout_s)
        self._stub = weights_pb2_grpc.WeightsStub(self._channel)

    def prepare(self, source: str, dtype: str = "f32", force: bool = False,
                progress: Callable[[ProgressEvent], None] | None = None,
                cold_policy: str = "accept") -> SidecarHandle:
        """Prepare on the server; ``progress`` gets each streamed event. Returns the final handle
        (its ``path`` is on the server's host)."""
        request = weights_pb2.PrepareRequest(source=source, dtype=dtype, force=force, cold_policy=cold_policy)
        try:
            for event in self._stub.Prepare(request):
                if event.HasField("handle"):
                    return handle_from_proto(event.handle)
                if progress is not None:
                    progress(progress_from_proto(event.progress))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        raise WarmserveError("the Prepare stream ended without a handle")

    def fetch(self, fingerprint_or_handle: str | SidecarHandle, dest_root: Path, *, chunk_bytes: int = 0,
              refresh: bool = False) -> Path:
        """Download a sidecar into ``dest_root/<sidecar dir name>/`` and validate it; returns that
        directory. A valid local copy with the same fingerprint is returned without a download,
        unless ``refresh`` (a runner that refused the local copy's signature downloads again).
        The signed manifest (``manifest.json``, ``manifest.sig``) travels like any sidecar file.

        Every file is streamed to a temp file, checked against the handle's size and sha256, then
        published atomically (weights last). Raises ``FailedPrecondition`` on a checksum or
        validation mismatch (nothing published), ``NotFound`` when the server lacks the sidecar.
        """
        fingerprint = (fingerprint_or_handle.fingerprint if isinstance(fingerprint_or_handle, SidecarHandle)
                       else fingerprint_or_handle)
        dest_root = Path(dest_root)
        try:
            if not refresh:
                return find_sidecar(dest_root, fingerprint).path
        except WarmserveError:
            pass
        request = weights_pb2.WeightsFetchRequest(fingerprint=fingerprint, chunk_bytes=chunk_bytes)
        stream = self._stub.Fetch(request)
        try:
            first = next(stream)
            files = {f.name: f for f in first.handle.files}
            name = Path(first.handle.path).name
            if not name or name.startswith(".") or "/" in name or not files or set(files) - set(SIDECAR_FILES):
                raise FailedPrecondition(f"the server sent an unusable sidecar handle ({name!r}, {sorted(files)})")
            directory = dest_root / name
            dest_root.mkdir(parents=True, exist_ok=True)
            with sidecar_lock(dest_root, name):
                directory.mkdir(exist_ok=True)
                remove_temp_files(directory)
                self._receive(stream, directory, files)
                return validate_sidecar(directory, fingerprint=fingerprint).path
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        finally:
            stream.cancel()

    @staticmethod
    def _receive(stream, directory: Path, files: dict) -> None:
        temps: dict[str, Path] = {}
        fds: dict[str, int] = {}
        hashes: dict = {}
        sizes: dict[str, int] = {}
        try:
            for name in files:
                fds[name], temps[name] = new_temp_file(directory, name)
                hashes[name], sizes[name] = hashlib.sha256(), 0
            for chunk in stream:
                if chunk.file not in fds or chunk.offset != sizes[chunk.file]:
                    raise FailedPrecondition(f"unexpected chunk for {chunk.file!r} at offset {chunk.offset}")
                view = memoryview(chunk.data)
                while view:
                    view = view[os.write(fds[chunk.file], view):]
                hashes[chunk.file].update(chunk.data)
                sizes[chunk.file] += len(chunk.data)
            for name, meta in files.items():
                if sizes[name] != meta.size_bytes or hashes[name].hexdigest() != meta.sha256:
                    raise FailedPrecondition(f"fetched {name} does not match the server's size and sha256")
                finish_temp_file(fds.pop(name), temps[name])
            publish(directory, temps)
            temps.clear()
        finally:
            for fd in fds.values():
                os.close(fd)
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)

    def list(self) -> list[SidecarHandle]:
        """Every valid sidecar on the server."""
        try:
            response = self._stub.List(weights_pb2.WeightsListRequest())
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return [handle_from_proto(h) for h in response.sidecars]

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> WeightsClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
