"""Artifacts as byte streams: hashing, packing a directory into one tar blob, and installing a
stream of chunks at a destination atomically.

A directory artifact is an uncompressed POSIX (PAX) tar of the directory's contents, members in
sorted order with owner fields cleared; it is unpacked with tarfile's ``"data"`` filter (no
absolute paths, no links or files escaping the destination, no device nodes). Everything here
works chunk by chunk (:data:`CHUNK_BYTES`), so a multi-GB artifact costs a few MiB of memory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from services.errors import InvalidArgument, NotFound
from services.fsmode import default_dir_mode, default_file_mode

CHUNK_BYTES = 1 << 20  # 1 MiB


class CorruptArtifact(NotFound):
    """The bytes read do not match the entry's size or sha256 (reported as a MISS / NOT_FOUND)."""


class HashingWriter:
    """File-like sink: writes to ``f`` while counting bytes (``size``) and hashing (``sha256``)."""

    def __init__(self, f) -> None:
        self._f = f
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        """Write ``data`` to the file and the running hash; returns its length."""
        self._f.write(data)
        self._sha.update(data)
        self.size += len(data)
        return len(data)

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of everything written so far."""
        return self._sha.hexdigest()


class ChunkReader:
    """File-like ``read(n)`` over an iterator of byte chunks (for streaming tar extraction)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = bytearray()
        self._done = False

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that is left when ``n`` < 0); ``b""`` at the end."""
        while not self._done and (n < 0 or len(self._buf) < n):
            try:
                self._buf += next(self._it)
            except StopIteration:
                self._done = True
        if n < 0:
            n = len(self._buf)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def drain(self) -> None:
        """Consume the rest of the iterator (so a verifying iterator reaches its final check)."""
        self._buf.clear()
        for _ in self._it:
            pass
        self._done = True


def hash_file(path: Path) -> tuple[int, str]:
    """``(size_bytes, sha256 hex)`` of a file, read in chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            sha.update(block)
            size += len(block)
    return size, sha.hexdigest()


def iter_file(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of a file in chunks of ``chunk_bytes``."""
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            yield block


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack_directory(src: Path, sink) -> None:
    """Write directory ``src`` as an uncompressed tar stream to ``sink`` (anything with ``write``).

    Members are the directory's contents relative to ``src`` in sorted order; symlinks are stored
    as links. Raises ``InvalidArgument`` for sockets, FIFOs and device nodes.
    """
    src = Path(src)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for name in sorted([*dirnames, *filenames]):
                path = Path(dirpath) / name
                if not (path.is_symlink() or path.is_file() or path.is_dir()):
                    raise InvalidArgument(f"{path} is not a regular file, directory or symlink")
                tar.add(path, arcname=str(path.relative_to(src)), recursive=False, filter=_normalise)


def _temp_sibling(dest: Path, suffix: str) -> str:
    return f".{dest.name}.warmserve-{suffix}-"


def _install_dir(tmp: Path, dest: Path) -> None:
    """Put directory ``tmp`` at ``dest``; an existing ``dest`` is swapped out, then removed."""
    for _ in range(8):
        old = None
        if dest.exists() or dest.is_symlink():
            old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_temp_sibling(dest, "old")))
            os.replace(dest, old / "x")
        try:
            os.replace(tmp, dest)
        except OSError:  # someone else installed dest between our two renames: try again
            continue
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return
    raise FileExistsError(f"{dest} keeps being replaced by another process")


def install_stream(chunks: Iterable[bytes], fmt: str, dest: str | Path) -> None:
    """Write the artifact given as ``chunks`` at ``dest`` atomically.

    ``fmt="file"``: the bytes become the file ``dest`` (mode ``0o666 & ~umask``); ``fmt="dir"``:
    the bytes are a tar unpacked into the directory ``dest``. Work happens in a temp sibling of
    ``dest`` and one ``os.replace`` makes it visible, so ``dest`` is never partial. Whatever
    ``chunks`` raises (e.g. :class:`CorruptArtifact` from a final integrity check) propagates
    after the temp data is removed. Raises ``InvalidArgument`` when ``dest``'s directory is
    missing, or when a file artifact would replace a directory.
    """
    dest = Path(dest)
    if not dest.parent.is_dir():
        raise InvalidArgument(f"directory {dest.parent} does not exist")
    if fmt == "file":
        if dest.is_dir() and not dest.is_symlink():
            raise InvalidArgument(f"{dest} is a directory; the entry is a single file")
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_temp_sibling(dest, "tmp"))
        try:
            with os.fdopen(fd, "wb") as f:
                for block in chunks:
                    f.write(block)
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    if fmt != "dir":
        raise InvalidArgument(f"unknown artifact format {fmt!r}")
    tmp_dir = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_temp_sibling(dest, "tmp")))
    reader = ChunkReader(chunks)
    try:
        try:
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                tar.extractall(tmp_dir, filter="data")
        except tarfile.TarError as e:
            reader.drain()  # a verifying iterator reports damaged bytes here, which explains the error
            raise CorruptArtifact(f"directory artifact for {dest} is not a valid tar: {e}") from e
        reader.drain()
        os.chmod(tmp_dir, default_dir_mode())
        _install_dir(tmp_dir, dest)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def install_verified(chunks: Iterable[bytes], fmt: str, dest: str | Path) -> None:
    """As :func:`install_stream`, but a ``"dir"`` artifact is first written whole to a temp file
    beside ``dest`` (so the verifying ``chunks`` reach their final size/sha256 check) and only
    then unpacked: no byte of an artifact that fails its checks is ever extracted. A ``"file"``
    artifact is already renamed into place only after its last chunk."""
    if fmt != "dir":
        install_stream(chunks, fmt, dest)
        return
    dest = Path(dest)
    if not dest.parent.is_dir():
        raise InvalidArgument(f"directory {dest.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_temp_sibling(dest, "tar"))
    try:
        with os.fdopen(fd, "wb") as f:
            for block in chunks:
                f.write(block)
        install_stream(iter_file(Path(tmp)), "dir", dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
