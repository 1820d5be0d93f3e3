"""The ``Weights`` gRPC servicer (thin: validate, call the core, translate errors) and
:func:`build_server`, which puts it behind the server bootstrap.

- ``Prepare`` runs :func:`weight_service.prepare.prepare` in a worker thread and streams its
  progress events, then the handle (``files`` with names and sizes).
- ``Fetch`` streams every file of a sidecar (config, tokenizer files, weights last) in chunks; the
  first chunk carries the handle with each file's size and sha256. Files are opened once up front,
  so a repack that replaces them mid-stream does not mix versions.
- ``List`` returns every valid sidecar under the root with its current residency.

Limits: ``Prepare`` and ``Fetch`` each hold one of ``--max-streams`` stream slots
(:mod:`services.stream_slots`; one more is ``UNAVAILABLE``); Prepares run on a bounded pool
(:mod:`weight_service.prepare_pool`), those beyond it waiting for a worker.
A source outside the model roots (:mod:`weight_service.model_roots`) is ``PERMISSION_DENIED``.
Each refusal counts in ``warmserve_refused_total{reason}``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from services.bootstrap import ServerConfig, ServiceServer
from services.errors import InvalidArgument, NotFound, Unavailable, WarmserveError, abort_with
from services.proto import weights_pb2, weights_pb2_grpc
from services.refusals import Refusals
from services.stream_slots import StreamSlots
from weight_service.catalog import find_sidecar, list_sidecars, sha256_of, sidecar_files
from weight_service.convert import handle_to_proto, progress_to_proto
from weight_service.model_roots import ModelRoots, NotServed
from weight_service.prepare import SidecarHandle, locate_sidecar, prepare, residency_state
from weight_service.prepare_pool import DEFAULT_PREPARE_WORKERS, PreparePool
from weight_service.residency import probe_residency
from weight_service.sidecar import WEIGHTS_FILE, InvalidSidecar, SidecarInfo, validate_sidecar
from weight_service.sources import source_fingerprint

if TYPE_CHECKING:
    from weight_service.s3_sidecars import RemoteSidecars

SERVICE_NAME = "warmserve.v1.Weights"
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
_DONE = object()


def _current_handle(info: SidecarInfo) -> SidecarHandle:
    residency = probe_residency(info.path / WEIGHTS_FILE)
    return SidecarHandle.from_info(info, residency=residency, state=residency_state(residency), seconds=0.0)


class WeightsServicer(weights_pb2_grpc.WeightsServicer):
    """Serves the sidecars under ``root`` (a directory; created on first Prepare) of the
    checkpoints ``model_roots`` allows. ``remote``: an object store Prepare fetches sidecars from
    instead of packing, and uploads packs to (:mod:`weight_service.s3_sidecars`). At most
    ``max_streams`` Prepare/Fetch streams at once and ``prepare_workers`` (>= 1) Prepares
    working at once; refusals count in ``refused``."""

    def __init__(self, root: Path, remote: RemoteSidecars | None = None, *, model_roots: ModelRoots | None = None,
                 max_streams: int = ServerConfig.max_streams, prepare_workers: int = DEFAULT_PREPARE_WORKERS) -> None:
        self.root = Path(root)
        self.remote = remote
        self.model_roots = model_roots or ModelRoots()
        self.slots = StreamSlots(max_streams, "the weight service")
        self.pool = PreparePool(prepare_workers)
        #: ``warmserve_refused_total{reason}``; :func:`build_server` registers it on the server's registry.
        self.refused = Refusals()
        self._sha_cache: dict[tuple, str] = {}
        self._sha_lock = threading.Lock()

    def _admit(self, context, source: str) -> None:
        """Take a stream slot and check ``source`` against the model roots; raises (and counts)
        ``Unavailable`` or :class:`NotServed`."""
        try:
            self.slots.take(context)
        except Unavailable:
            self.refused.add("stream_slots")
            raise
        try:
            self.model_roots.check(source)
        except NotServed:
            self.refused.add("model_root")
            raise

    def Prepare(self, request, context):
        """Prepare the sidecar, streaming progress events, then its handle."""
        try:
            self._admit(context, request.source)
        except WarmserveError as e:
            abort_with(context, e)
        dtype = request.dtype or "f32"
        cold_policy = request.cold_policy or "accept"
        events: queue.Queue = queue.Queue()
        gone = threading.Event()
        if not context.add_callback(gone.set):
            return

        def work() -> None:
            try:
                handle = prepare(request.source, dtype=dtype, root=self.root, force=request.force,
                                 cold_policy=cold_policy, progress=events.put, remote=self.remote)
                events.put((_DONE, handle))
            except WarmserveError as e:
                events.put((_DONE, e))
            except Exception as e:  # an unexpected failure still ends the stream with a status
                events.put((_DONE, WarmserveError(f"prepare failed: {e}")))

        self.pool.submit(work, gone)
        while True:
            try:
                item = events.get(timeout=0.5)
            except queue.Empty:
                if gone.is_set():  # nobody to answer; a started pack still finishes and publishes
                    return
                continue
            if isinstance(item, tuple) and item[0] is _DONE:
                result = item[1]
                if isinstance(result, WarmserveError):
                    abort_with(context, result)
                files = [(n, (result.path / n).stat().st_size, "") for n in sidecar_files(result.path)]
                yield weights_pb2.PrepareResponse(handle=handle_to_proto(result, files))
                return
            if context.is_active():
                yield weights_pb2.PrepareResponse(progress=progress_to_proto(item))

    def _find(self, request) -> SidecarInfo:
        if request.fingerprint:
            return find_sidecar(self.root, request.fingerprint)
        if not request.source:
            raise InvalidArgument("Fetch needs a fingerprint, or a source and dtype")
        _src, _family, _dtype, directory = locate_sidecar(request.source, request.dtype or "f32", self.root)
        try:
            return validate_sidecar(directory, source_fingerprint=source_fingerprint(_src))
        except InvalidSidecar as e:
            raise NotFound(f"no valid sidecar for {request.source} ({e}); call Prepare first") from e

    def _sha256(self, name: str, f) -> str:
        st = os.fstat(f.fileno())
        key = (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._sha_lock:
            cached = self._sha_cache.get(key)
        if cached is None:
            cached = sha256_of(f)
            with self._sha_lock:
                self._sha_cache[key] = cached
        return cached

    def Fetch(self, request, context):
        """Stream every file of a sidecar, the first chunk carrying the handle."""
        if request.chunk_bytes > MAX_CHUNK_BYTES:
            abort_with(context, InvalidArgument(f"chunk_bytes may be at most {MAX_CHUNK_BYTES}"))
        chunk = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        try:
            self._admit(context, request.source)
            info = self._find(request)
            opened = [(name, open(info.path / name, "rb")) for name in sidecar_files(info.path)]
        except WarmserveError as e:
            abort_with(context, e)
        try:
            files = [(name, os.fstat(f.fileno()).st_size, self._sha256(name, f)) for name, f in opened]
            yield weights_pb2.WeightsFetchResponse(handle=handle_to_proto(_current_handle(info), files))
            for name, f in opened:
                f.seek(0)
                offset = 0
                while context.is_active() and (data := f.read(chunk)):
                    yield weights_pb2.WeightsFetchResponse(file=name, offset=offset, data=data)
                    offset += len(data)
        finally:
            for _, f in opened:
                f.close()

    def List(self, request, context):
        """Every valid sidecar under the root, with its residency now."""
        return weights_pb2.WeightsListResponse(
            sidecars=[handle_to_proto(_current_handle(info)) for info in list_sidecars(self.root)])


def build_server(config: ServerConfig, root: Path, remote: RemoteSidecars | None = None, *,
                 model_roots: Iterable[str | Path] = (), prepare_workers: int = DEFAULT_PREPARE_WORKERS) -> ServiceServer:
    """A :class:`ServiceServer` serving ``Weights`` for the sidecars under ``root`` (shared
    through ``remote`` when given) of the bundled model and the checkpoints under
    ``model_roots``; streams capped at ``config.max_streams``, ``prepare_workers`` Prepares at once."""
    servicer = WeightsServicer(root, remote, model_roots=ModelRoots(model_roots), max_streams=config.max_streams,
                               prepare_workers=prepare_workers)
    server = ServiceServer(config, [(weights_pb2_grpc.add_WeightsServicer_to_server, servicer, SERVICE_NAME)],
                           refusals=servicer.refused)
    return server

