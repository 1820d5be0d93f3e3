"""File modes for atomically published files (mkstemp/mkdtemp create 0o600/0o700; a published
file should get what a plain ``open``/``mkdir`` would give under the process umask), and files
that hold secrets: :func:`write_secret` writes one, :func:`check_private_dir` and
:func:`check_secret_file` refuse existing ones another user could have planted or changed."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from services.errors import InvalidArgument


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
    of a random name beside it, made by ``tempfile.mkstemp`` (``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600
    from the start: never readable by others in between, never a planted file or symlink), then
    ``os.replace``, which replaces a symlink at ``path`` itself, never its target. With
    ``exclusive``, raises ``FileExistsError`` when ``path`` exists (a key that must never be
    overwritten; a symlink counts) and links instead of replacing."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # exact: the umask does not narrow a public file's mode
            f.write(data.encode() if isinstance(data, str) else data)
        if exclusive:
            os.link(tmp, p)  # FileExistsError when present; atomic either way
        else:
            os.replace(tmp, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _refuse(path: Path, what: str, problem: str) -> InvalidArgument:
    return InvalidArgument(f"refusing {what} {path}: {problem}")


def _check_owner(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse ``path`` (its ``os.lstat`` is ``st``) when the effective uid does not own it."""
    if st.st_uid != os.geteuid():
        raise _refuse(path, what, f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")


def check_private_dir(path: str | Path, what: str = "the directory") -> None:
    """Check that the existing directory ``path``, which holds (or will hold) secrets, is one
    only this process's user can change: a real directory (not a symlink, ``os.lstat``), owned
    by the effective uid, with no group or other write bit. A sticky world-writable *parent*
    (``/tmp``) is fine. Raises ``InvalidArgument`` naming the path and what is wrong."""
    p = Path(path)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(p, what, "it is a symbolic link, not a directory")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(p, what, "it is not a directory")
    _check_owner(p, st, what)
    if st.st_mode & 0o022:
        raise _refuse(p, what, f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                               "chmod go-w it")


def check_secret_file(path: str | Path, what: str = "the secret file") -> None:
    """Check that the existing file ``path`` holding a secret (token, key) is private to this
    user: a regular file (a symlink is refused, ``os.lstat``), owned by the effective uid, with
    no group or other permission bit (0600 or narrower). Its directory must have passed
    :func:`check_private_dir`, so nobody can swap it afterwards. Raises ``InvalidArgument``."""
    p = Path(path)
    st = os.lstat(p)
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise _refuse(p, what, f"it is {kind}")
    _check_owner(p, st, what)
    if st.st_mode & 0o077:
        raise _refuse(p, what, f"group or others may access it (mode {stat.S_IMODE(st.st_mode):04o}); "
                               "remove it (a new one is made) or chmod 600 it if it is yours")


def private_dir(path: str | Path, what: str = "the directory") -> Path:
    """Make ``path`` (mode 0700; missing parents get the umask's mode) or check the existing one
    with :func:`check_private_dir`; then narrow it to 0700. Returns it as a ``Path``. Raises
    ``InvalidArgument``."""
    p = Path(path)
    if not os.path.lexists(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked below like any other
            p.mkdir(mode=0o700)
    check_private_dir(p, what)
    os.chmod(p, 0o700)
    return p
