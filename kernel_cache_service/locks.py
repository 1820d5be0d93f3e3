"""Inter-process coordination on one host, built on ``flock(2)`` (released by the kernel when a
process dies, so a SIGKILL never leaves a stale lock).

- :func:`entry_lock`: a ``filelock.FileLock`` per entry (``locks/<name>/<fingerprint>.lock``)
  that serialises publish, evict and quarantine of one key across processes and threads.
- Read leases: a reader holds ``LOCK_SH`` on the entry's blob for as long as it reads; an evictor
  must get ``LOCK_EX | LOCK_NB`` on the same blob, so an entry being read is never evicted
  (:func:`try_exclusive`).
- :class:`OwnedTempDir`: a private directory under ``tmp/`` whose creator holds ``LOCK_EX`` on
  it; :func:`sweep_unowned` removes only entries nobody holds, i.e. leftovers of dead writers,
  so a process starting up never deletes another live process's in-progress publish.

``flock`` locks belong to an open file description, so two threads of one process that each open
the file exclude each other exactly like two processes do.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import filelock


def entry_lock(path: Path) -> filelock.FileLock:
    """A fresh lock object for ``path`` (its parent directories are created on acquire)."""
    return filelock.FileLock(path, thread_local=False)


def try_exclusive(fd: int) -> bool:
    """Take ``LOCK_EX`` on ``fd`` without waiting; ``False`` if anyone holds a lock on the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_shared(fd: int) -> None:
    """Take ``LOCK_SH`` on ``fd`` (a read lease), waiting for a brief exclusive holder to finish."""
    fcntl.flock(fd, fcntl.LOCK_SH)


class OwnedTempDir:
    """A new directory under ``parent`` locked (``LOCK_EX``) by this object until :meth:`release`.

    ``path`` is the directory. Creation retries if a concurrent :func:`sweep_unowned` removed the
    directory between ``mkdtemp`` and the lock. Raises ``OSError`` if ``parent`` is unusable.
    """

    def __init__(self, parent: Path, prefix: str = "") -> None:
        while True:
            path = Path(tempfile.mkdtemp(dir=parent, prefix=f"{prefix}{os.getpid()}-"))
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                alive = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                alive = False
            if alive:
                self.path, self._fd = path, fd
                return
            os.close(fd)

    def release(self) -> None:
        """Drop the lock (the directory itself is left to the caller)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Delete the directory (if still there) and drop the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def sweep_unowned(parent: Path) -> int:
    """Remove every child of ``parent`` that no live process holds locked; returns how many."""
    removed = 0
    try:
        children = list(parent.iterdir())
    except FileNotFoundError:
        return 0
    for child in children:
        try:
            fd = os.open(child, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone already, or a symlink / unreadable: remove the name only
            if child.is_symlink():
                child.unlink(missing_ok=True)
            continue
        try:
            if not try_exclusive(fd):
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    return removed
