"""Page-cache residency of a file: ``mincore(2)`` over a shared read-only mapping.

:func:`probe_residency` maps the file with libc ``mmap`` (through ``ctypes``; nothing is read,
so no page is faulted in), asks ``mincore`` which pages are resident, and returns the resident
fraction in ``[0, 1]``: over the whole file when it is at most ``whole_file_below`` bytes, else
over ``windows`` evenly spaced windows of ``window_bytes`` each. Any failure (no libc, a failing
syscall, an empty file) gives ``None``: residency unknown, treated as cold by the caller.
:func:`advise_willneed` asks the kernel to start reading the file in (readahead).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

#: A sidecar is hot when at least this fraction of its pages is resident.
HOT_THRESHOLD = 0.95

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


def _load_libc() -> ctypes.CDLL:
    """libc with ``mmap``/``munmap``/``mincore`` typed; raises ``OSError`` when unavailable."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def _windows(size: int, page: int, window_bytes: int, windows: int, whole_file_below: int) -> list[tuple[int, int]]:
    """Page-aligned ``(offset, length)`` windows covering the file or sampling it evenly."""
    if size <= whole_file_below or windows * window_bytes >= size:
        return [(0, size)]
    window = max(page, window_bytes - window_bytes % page)
    last = (size - window) // page  # last page index a window may start at
    starts = sorted({(last * i // (windows - 1)) * page for i in range(windows)}) if windows > 1 else [0]
    return [(s, min(window, size - s)) for s in starts]


def probe_residency(path: Path, *, window_bytes: int = 1 << 20, windows: int = 64,
                    whole_file_below: int = 64 << 20) -> float | None:
    """Fraction of ``path``'s probed pages resident in the page cache, or ``None`` on failure.

    ``window_bytes`` and ``whole_file_below`` are bytes; the probe touches no page itself.
    """
    try:
        libc = _load_libc()
        page = mmap.PAGESIZE
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                return None
            try:
                resident = total = 0
                for offset, length in _windows(size, page, window_bytes, windows, whole_file_below):
                    pages = (length + page - 1) // page
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(ctypes.c_void_p(addr + offset), length, vec) != 0:
                        return None
                    resident += sum(b & 1 for b in bytes(vec))
                    total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    except (OSError, AttributeError, ValueError):
        return None
    return resident / total if total else None


def advise_willneed(path: Path) -> bool:
    """``posix_fadvise(POSIX_FADV_WILLNEED)`` over the whole file: the kernel starts readahead in
    the background. Returns ``False`` when the advice could not be given."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False
    return True
