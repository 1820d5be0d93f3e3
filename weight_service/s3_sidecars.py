"""Sidecars in an object store (S3 API): upload what this host packed, fetch what another host
packed, so a second host packs nothing (``warmserve weights serve --store s3://BUCKET/PREFIX``).

Objects, under ``PREFIX/sidecars/``::

    <sidecar dir>/<pack key>/manifest.json        the commit point, written with If-None-Match: *
    <sidecar dir>/<pack key>/<upload id>/<file>   config.json, ..., model.safetensors (weights last)

``<sidecar dir>`` is the local directory name (source slug, source path hash, family, dtype);
the *pack key* (:func:`pack_key`) hashes what decides the sidecar's bytes: the sidecar format
version, the family and its pack-spec version, the weights dtype and the checkpoint's source
fingerprint (file names, sizes, mtimes, config bytes: :func:`weight_service.sources.source_fingerprint`).
So a host finds another host's sidecar exactly when the same validation as today would accept
it: same checkpoint path, sizes and mtimes (one image, one volume, or a copy that keeps mtimes),
same code. Every file object carries ``size-bytes`` and ``sha256`` metadata, and the manifest
(JSON: ``version``, ``upload_id``, ``fingerprint``, ``source_fingerprint``, ``producer``,
``created``, ``files: {name: {size_bytes, sha256}}``) names them all.

- **Upload** (after a pack): the files go under a fresh upload id, then the manifest is written
  conditionally. Exactly one of N hosts racing on a key wins; a loser deletes its files. Until the
  manifest exists nothing refers to the files, so a reader never sees a half-uploaded sidecar.
- **Fetch** (a Prepare whose sidecar is not on this host): each file is streamed into a temp
  file beside its final name while it is hashed, checked against the manifest's size and sha256
  and the object's own metadata, then all are renamed into place (weights last, as a pack
  publishes), and the sidecar is validated with the local checkpoint's source fingerprint
  (:func:`weight_service.sidecar.validate_sidecar`). A mismatch, a missing file or a sidecar that
  does not validate is never kept: the remote sidecar is dropped (its manifest deleted,
  conditionally on its ETag; then its files) and the caller packs as it would have without a store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from model_families.family import ModelFamily
from services.errors import WarmserveError
from services.s3 import ObjectStore
from services.s3_errors import CorruptObject
from services.s3_meta import hash_stream
from weight_service.catalog import sidecar_files
from weight_service.sidecar import (
    FORMAT_VERSION,
    SIDECAR_FILES,
    WEIGHTS_FILE,
    InvalidSidecar,
    SidecarInfo,
    finish_temp_file,
    new_temp_file,
    publish,
    validate_sidecar,
)

log = logging.getLogger(__name__)

#: The weight service's folder under the ``--store`` prefix.
FOLDER = "sidecars"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def pack_key(family: ModelFamily, dtype: str, source_fingerprint: str) -> str:
    """32 hex digits of sha256 over the sidecar format version, ``family``'s name and pack-spec
    version, the weights ``dtype`` and the checkpoint's ``source_fingerprint``."""
    text = (f"format={FORMAT_VERSION}\nfamily={family.name}\nspec={family.pack_version}\ndtype={dtype}\n"
            f"source={source_fingerprint}")
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RemoteManifest:
    """A parsed manifest: ``upload_id`` (32 hex), ``files`` name -> (size in bytes, sha256 hex)."""

    upload_id: str
    files: dict[str, tuple[int, str]]
    fingerprint: str

    @classmethod
    def parse(cls, raw: bytes) -> RemoteManifest:
        """Raises ``ValueError`` for anything but a version-1 manifest naming sidecar files only
        (``model.safetensors`` among them) with sizes and sha256 digests."""
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
            raise ValueError("not a version-1 sidecar manifest")
        upload_id, files = doc.get("upload_id"), doc.get("files")
        if not isinstance(upload_id, str) or len(upload_id) != 32 or not all(c in "0123456789abcdef" for c in upload_id):
            raise ValueError("garbled upload_id")
        if not isinstance(files, dict) or WEIGHTS_FILE not in files or set(files) - set(SIDECAR_FILES):
            raise ValueError(f"the manifest names {sorted(files) if isinstance(files, dict) else files!r}")
        out = {}
        for name, meta in files.items():
            size, sha = meta.get("size_bytes"), meta.get("sha256")
            if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or len(sha) != 64:
                raise ValueError(f"garbled size or sha256 for {name}")
            out[name] = (size, sha)
        return cls(upload_id, out, str(doc.get("fingerprint", "")))


class _FdSink:
    """``write`` to a file descriptor (all of it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        return len(data)


class RemoteSidecars:
    """The sidecars in ``objects`` (an :class:`~services.s3.ObjectStore` at ``PREFIX/sidecars``).

    Methods raise ``Unavailable`` / ``FailedPrecondition`` when the bucket cannot be reached or
    read (callers fall back to packing); corruption is handled here (see the module docstring).
    """

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.url = objects.url()

    @classmethod
    def open_url(cls, url: str, *, check: bool = True, **store_kwargs) -> RemoteSidecars:
        """The sidecars under ``url``/``sidecars`` (``s3://BUCKET/PREFIX``). With ``check`` the
        bucket is probed first; ``InvalidArgument`` for a malformed URL, an unreachable endpoint,
        a missing bucket, denied access or an endpoint that ignores conditional writes."""
        objects = ObjectStore.from_url(url, **store_kwargs)
        if check:
            objects.check()
        return cls(objects.child(FOLDER))

    @staticmethod
    def key(directory: Path, family: ModelFamily, dtype: str, source_fingerprint: str) -> str:
        """The key of a sidecar: ``<sidecar dir name>/<pack key>``."""
        return f"{Path(directory).name}/{pack_key(family, dtype, source_fingerprint)}"

    def has(self, key: str) -> bool:
        """Whether a sidecar's manifest exists under ``key`` (one HEAD)."""
        return self.objects.head(f"{key}/{MANIFEST}") is not None

    def upload(self, key: str, info: SidecarInfo) -> bool:
        """Upload the sidecar ``info`` (every file in its directory, with sha256) under ``key``.
        ``True`` when this upload became the remote sidecar, ``False`` when another one already
        was (this upload's files are deleted again). Call holding the sidecar's lock (the files
        must not change meanwhile). Raises ``Unavailable`` / ``FailedPrecondition``; files of a
        failed upload are deleted (best effort), and without the manifest nothing refers to them."""
        upload_id = uuid.uuid4().hex
        files: dict[str, dict] = {}
        written: list[str] = []
        won = False
        try:
            for name in sidecar_files(info.path):
                path = info.path / name
                with open(path, "rb") as f:
                    size, sha = hash_stream(f)
                obj = f"{key}/{upload_id}/{name}"
                self.objects.put_file(obj, path, sha256=sha, if_absent=True,
                                      what=f"uploading sidecar file {name} to {self.url}")
                written.append(obj)
                files[name] = {"size_bytes": size, "sha256": sha}
            manifest = {"version": MANIFEST_VERSION, "upload_id": upload_id, "fingerprint": info.fingerprint,
                        "source_fingerprint": info.metadata.get("warmserve.source_fingerprint", ""),
                        "sidecar": info.path.name, "producer": f"{socket.gethostname()}:{os.getpid()}",
                        "created": time.time(), "files": files}
            won = self.objects.put_bytes(f"{key}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode(),
                                         what=f"publishing the sidecar manifest to {self.url}")
        finally:
            if not won:
                self._delete_quietly(written)
        if won:
            log.info("uploaded sidecar to the object store", extra={"sidecar": info.path.name, "key": key,
                                                                    "store": self.url, "bytes": info.size_bytes})
        return won

    def fetch(self, key: str, directory: Path, *, source_fingerprint: str) -> SidecarInfo | None:
        """Download the sidecar under ``key`` into ``directory`` (created if absent) and validate
        it against ``source_fingerprint``; its :class:`SidecarInfo`, or ``None`` when the bucket
        has none or it was corrupt or invalid (then dropped from the bucket; ``directory`` may
        hold the invalid files, which the caller's pack replaces). Call holding the sidecar's
        lock. Raises ``Unavailable`` / ``FailedPrecondition`` when the bucket cannot be read,
        ``OSError`` when the local disk refuses (nothing half-written is left in place)."""
        try:
            got = self.objects.get_bytes(f"{key}/{MANIFEST}")
        except CorruptObject as e:
            self._drop(key, e.etag, None, str(e))
            return None
        if got is None:
            return None
        head, raw = got
        try:
            manifest = RemoteManifest.parse(raw)
        except (ValueError, TypeError, AttributeError) as e:
            self._drop(key, head.etag, None, f"unusable manifest: {e}")
            return None
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        temps: dict[str, Path] = {}
        fds: dict[str, int] = {}
        try:
            for name in sorted(manifest.files, key=lambda n: n == WEIGHTS_FILE):
                size, sha = manifest.files[name]
                fds[name], temps[name] = new_temp_file(directory, name)
                obj = self.objects.download(f"{key}/{manifest.upload_id}/{name}", _FdSink(fds[name]),
                                            expect_size=size, expect_sha256=sha)
                if obj is None:
                    raise CorruptObject(f"{self.objects.url(key)} lacks {name}, which its manifest names")
                finish_temp_file(fds.pop(name), temps[name])
            publish(directory, temps)
            temps.clear()
        except CorruptObject as e:
            self._drop(key, head.etag, manifest.upload_id, str(e))
            return None
        finally:
            for fd in fds.values():
                os.close(fd)
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)
        try:
            info = validate_sidecar(directory, source_fingerprint=source_fingerprint)
        except InvalidSidecar as e:
            self._drop(key, head.etag, manifest.upload_id, f"the fetched sidecar does not validate: {e}")
            return None
        log.info("fetched sidecar from the object store", extra={"sidecar": directory.name, "key": key,
                                                                 "store": self.url, "bytes": info.size_bytes})
        return info

    def _drop(self, key: str, etag: str | None, upload_id: str | None, reason: str) -> None:
        """Remove a corrupt or invalid remote sidecar: its manifest (only the version ``etag``
        when given), then its files; log why. Failures are logged, never raised."""
        try:
            deleted = self.objects.delete(f"{key}/{MANIFEST}", etag=etag)
            if deleted and upload_id:
                self._delete_quietly([o.key for o in self.objects.list(f"{key}/{upload_id}/")])
        except WarmserveError as e:
            deleted = False
            log.warning("could not delete a corrupt remote sidecar", extra={"key": key, "error": str(e)})
        log.warning("dropped a corrupt remote sidecar; packing instead",
                    extra={"key": key, "reason": reason, "store": self.url, "deleted": deleted})

    def _delete_quietly(self, keys: list[str]) -> None:
        for obj in keys:
            try:
                self.objects.delete(obj)
            except WarmserveError as e:
                log.warning("could not delete an uploaded sidecar file", extra={"key": obj, "error": str(e)})
