"""Publishing into a kernel-cache store: the checks a publish needs no bytes for, the temp
entry that bytes stream into while counted and hashed, and its verification; the disk and S3
stores share all of it and differ only in how a verified entry is installed
(``docs/architecture.md`` §6, "atomic publish")."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kernel_cache_service.artifact import HashingWriter, iter_file, pack_directory
from kernel_cache_service.entry import REJECTED, EntryInfo, PublishResult
from kernel_cache_service.fingerprint import UNKNOWN
from kernel_cache_service.keys import validate_key
from kernel_cache_service.layout import BLOB, MANIFEST, PARTS_FILE
from kernel_cache_service.limits import check_parts, check_publish_header
from kernel_cache_service.locks import OwnedTempDir
from services.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, WarmserveError
from services.fsmode import default_dir_mode, default_file_mode
from services.signing import Signature, SigningKey

#: Installs a verified temp entry directory as its key: PUBLISHED, ALREADY_PRESENT or REJECTED.
Install = Callable[[Path, EntryInfo], PublishResult]
UNKNOWN_REJECTED = "the fingerprint is UNKNOWN; unknown keys are never stored"


def storage_error(e: OSError, what: str) -> WarmserveError:
    """The error a client sees for a failed write into the store (nothing of it is kept): a full
    disk or quota (``ENOSPC``, ``EDQUOT``) is ``ResourceExhausted``; anything else (a read-only
    root, permissions, I/O) ``FailedPrecondition``; one sentence naming ``what`` and the cause."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{what}: no space left on the kernel-cache disk ({e.strerror}); nothing was stored")
    return FailedPrecondition(f"{what}: cannot write the kernel-cache store ({e.strerror or e}); nothing was stored")


def empty_artifact(name: str, fingerprint: str) -> InvalidArgument:
    """The refusal of a 0-byte artifact (no program is empty)."""
    return InvalidArgument(f"{name}/{fingerprint[:12]}: an empty artifact (0 bytes) is not a program; "
                           "nothing was stored")


def over_budget(size: int, max_bytes: int) -> str | None:
    """Why an artifact of ``size`` bytes can never fit a budget of ``max_bytes`` (0 = none)."""
    if max_bytes and size > max_bytes:
        return f"artifact of {size} bytes exceeds the store budget of {max_bytes} bytes"
    return None


def early_rejection(name: str, fingerprint: str, size: int | None, max_bytes: int) -> PublishResult | None:
    """REJECTED for a publish no bytes can make good (an UNKNOWN key, an announced ``size`` over
    the budget of ``max_bytes`` bytes), else ``None``. Raises ``InvalidArgument`` for a bad key or
    an announced ``size`` of 0 bytes (an empty artifact)."""
    validate_key(name, fingerprint)
    if fingerprint == UNKNOWN:
        return PublishResult(REJECTED, UNKNOWN_REJECTED)
    if size == 0:
        raise empty_artifact(name, fingerprint)
    reason = over_budget(size, max_bytes) if size is not None else None
    return PublishResult(REJECTED, reason) if reason else None


def finish_temp_entry(directory: Path, info: EntryInfo) -> None:
    """Make ``directory`` (holding the verified ``blob``) a complete entry for ``info``: write
    its manifest (mtime = ``info.created``: last access = creation, same clock) and, when it has
    one, its parts record, and give blob, manifest, record and directory the default modes.
    Raises ``OSError`` when the disk refuses."""
    if info.parts:
        (directory / PARTS_FILE).write_text(info.parts)
        os.chmod(directory / PARTS_FILE, default_file_mode())
    manifest = directory / MANIFEST
    manifest.write_bytes(info.manifest_bytes())
    os.utime(manifest, (info.created, info.created))
    os.chmod(manifest, default_file_mode())
    os.chmod(directory / BLOB, default_file_mode())
    os.chmod(directory, default_dir_mode())


class PendingPublish:
    """An artifact on its way into a store; get one from :func:`begin_publish`.

    :meth:`write` bytes (any chunking), then :meth:`commit`. Leaving the ``with`` block without a
    commit discards everything. Bytes beyond the announced size are dropped and make the commit
    REJECTED; so do a size or sha256 different from the announced ones, or a size over
    ``max_bytes`` (0 = no budget). The bytes go to a private directory under ``tmp_root``; a
    verified entry is handed to ``install``. The entry keeps ``signature`` (the sender's, as
    given) or, with ``signer``, its signature over the entry made at commit (embedded publishes),
    and ``parts``, its checked canonical fingerprint parts record (``""``: none).
    """

    def __init__(self, tmp_root: Path, max_bytes: int, install: Install, name: str, fingerprint: str, *,
                 fmt: str, producer: str, size: int | None, sha256: str | None, signature: str = "",
                 signer: SigningKey | None = None, parts: str = "") -> None:
        self.name, self.fingerprint, self.fmt, self.producer = name, fingerprint, fmt, producer
        self.parts = parts
        self.signature, self._signer = signature, signer
        self._expected_size, self._expected_sha = size, sha256
        self._max_bytes, self._install = max_bytes, install
        self._what = f"publishing {name}/{fingerprint[:12]}"
        self._tmp = None
        try:
            self._tmp = OwnedTempDir(tmp_root)
            self._file = open(self._tmp.path / BLOB, "wb")  # closed by commit/abort
        except OSError as e:
            if self._tmp is not None:
                self._tmp.remove()
            raise storage_error(e, self._what) from e
        self._sink = HashingWriter(self._file)
        self.overflowed = False
        self._finished = False

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._sink.size

    def write(self, data: bytes) -> int:
        """Append ``data``; returns ``len(data)`` (file-like, so ``pack_directory`` can write here)."""
        if self._expected_size is not None and self._sink.size + len(data) > self._expected_size:
            self.overflowed = True
        if not self.overflowed:
            try:
                self._sink.write(data)
            except OSError as e:
                self.abort()
                raise storage_error(e, self._what) from e
        return len(data)

    def _rejection(self) -> str | None:
        size, sha = self._sink.size, self._sink.sha256
        if self.fingerprint == UNKNOWN:
            return UNKNOWN_REJECTED
        if self.overflowed:
            return f"more bytes arrived than the {self._expected_size} announced"
        if self._expected_size is not None and size != self._expected_size:
            return f"received {size} bytes, {self._expected_size} were announced"
        if self._expected_sha is not None and sha != self._expected_sha:
            return f"sha256 of the received bytes is {sha}, {self._expected_sha} was announced"
        return over_budget(size, self._max_bytes)

    def commit(self) -> PublishResult:
        """Verify and make the entry visible; PUBLISHED, ALREADY_PRESENT or REJECTED (with reason).
        Raises ``InvalidArgument`` for an empty artifact (0 bytes received, as announced), which
        is discarded like a rejected one."""
        if self._finished:
            raise RuntimeError("publish already finished")
        self._finished = True
        try:
            try:
                self._file.close()
            except OSError as e:  # buffered bytes hit a full disk
                raise storage_error(e, self._what) from e
            reason = self._rejection()
            if reason is not None:
                return PublishResult(REJECTED, reason)
            if self._sink.size == 0:
                raise empty_artifact(self.name, self.fingerprint)
            info = EntryInfo(self.name, self.fingerprint, self._sink.size, self._sink.sha256,
                             created=time.time(), producer=self.producer, format=self.fmt,
                             signature=self.signature, parts=self.parts)
            if self._signer is not None:
                info = replace(info, signature=self._signer.sign(info.signed_payload()).to_text())
            try:
                finish_temp_entry(self._tmp.path, info)
                return self._install(self._tmp.path, info)
            except OSError as e:
                raise storage_error(e, self._what) from e
        finally:
            self._tmp.remove()

    def abort(self) -> None:
        """Discard the bytes written so far."""
        if not self._finished:
            self._finished = True
            try:
                self._file.close()
            except OSError:  # the buffered tail could not be written: it is discarded anyway
                pass
            finally:
                self._tmp.remove()

    def __enter__(self) -> PendingPublish:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


def begin_publish(tmp_root: Path, max_bytes: int, install: Install, name: str, fingerprint: str, *,
                  fmt: str, producer: str, size: int | None, sha256: str | None, signature: str = "",
                  signer: SigningKey | None = None, parts: str = "") -> PendingPublish:
    """A :class:`PendingPublish` of ``fmt`` (``"file"`` or ``"dir"``, i.e. a tar) bytes;
    ``size`` (bytes) and ``sha256`` (hex), when given, are what the sender announced and are
    verified at commit. ``signature`` (``KEYID:BASE64``) is kept with the entry as given (the
    store trusts no key: verifiers check it); ``signer`` signs the entry at commit instead.
    ``parts``: the key's fingerprint parts record (JSON text, ``""`` for none), kept beside the
    entry in canonical form. Raises ``InvalidArgument`` for a bad key, format, producer, size,
    sha256, parts record (:func:`kernel_cache_service.limits.check_publish_header`) or a
    malformed signature."""
    parts = check_publish_header(name, fingerprint, fmt=fmt, producer=producer, sha256=sha256, parts=parts)
    if size is not None and size < 0:
        raise InvalidArgument(f"size must be >= 0 bytes, got {size}")
    if signature:
        try:
            Signature.from_text(signature)
        except WarmserveError as e:
            raise InvalidArgument(f"publishing {name}/{fingerprint[:12]}: {e}") from None
    return PendingPublish(tmp_root, max_bytes, install, name, fingerprint, fmt=fmt, producer=producer,
                          size=size, sha256=sha256, signature=signature, signer=signer, parts=parts)


def publish_path(store, name: str, fingerprint: str, path: str | Path, producer: str,
                 signer: SigningKey | None = None, parts: str = "") -> PublishResult:
    """Publish the file or directory at ``path`` (a directory as one tar) into ``store`` (its
    ``precheck`` and ``begin_publish``; signed by ``signer`` when given; with the fingerprint
    ``parts`` record when given). Raises ``InvalidArgument`` for a bad key, a bad ``parts``
    record or a ``path`` that is neither a file nor a directory; otherwise PUBLISHED,
    ALREADY_PRESENT or REJECTED."""
    path = Path(path)
    validate_key(name, fingerprint)
    check_parts(parts, name, fingerprint)
    if not (path.is_file() or path.is_dir()):
        raise InvalidArgument(f"{path} is not a file or a directory")
    early = store.precheck(name, fingerprint)
    if early is not None:
        return early
    fmt = "dir" if path.is_dir() else "file"
    with store.begin_publish(name, fingerprint, fmt=fmt, producer=producer, signer=signer, parts=parts) as pending:
        if fmt == "file":
            for block in iter_file(path):
                pending.write(block)
        else:
            pack_directory(path, pending)
        return pending.commit()
