"""File modes for atomically published files (mkstemp/mkdtemp create 0o600/0o700; a published
file should get what a plain ``open``/``mkdir`` would give under the process umask)."""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask, read from ``/proc/self/status`` (no mutation) or, failing that, with
    the set-and-restore ``os.umask`` idiom (racy across threads, hence the last resort)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """``0o666 & ~umask``: the mode ``open(path, "w")`` would give a new file."""
    return 0o666 & ~current_umask()


def default_dir_mode() -> int:
    """``0o777 & ~umask``: the mode ``mkdir`` would give a new directory."""
    return 0o777 & ~current_umask()


def write_secret(path: str | Path, data: str | bytes, mode: int = 0o600, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` with ``mode`` (default 0600: keys, tokens) atomically: a temp file
    beside it, made with that mode from the start (never readable by others in between), then
    ``os.replace``. With ``exclusive``, raises ``FileExistsError`` when ``path`` exists (a key
    that must never be overwritten) and links instead of replacing."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)  # the umask may have narrowed a public file's mode
        if exclusive:
            os.link(tmp, p)  # FileExistsError when present; atomic either way
        else:
            os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
