"""Files that hold secrets (services/fsmode.py): write_secret never follows a planted symlink, and
the checks refuse a directory or secret file another user could have planted or changed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from services.errors import InvalidArgument
from services.fsmode import check_private_dir, check_secret_file, private_dir, write_secret

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")


def test_write_secret_never_writes_through_a_planted_temp_symlink(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    # the temp names the old code used (".NAME.PID.tmp", O_CREAT|O_TRUNC: follows a symlink)
    for pid in {os.getpid(), os.getppid()}:
        (tmp_path / f".token.{pid}.tmp").symlink_to(target)
    write_secret(tmp_path / "token", "wst_secret\n")
    assert target.read_text() == "precious\n"
    assert (tmp_path / "token").read_text() == "wst_secret\n"
    assert stat.S_IMODE((tmp_path / "token").lstat().st_mode) == 0o600
    left = {p.name for p in tmp_path.iterdir()} - {"victim", "token"}
    assert all((tmp_path / n).is_symlink() for n in left)  # only the planted links; no temp left behind


def test_write_secret_replaces_a_symlink_at_the_name_and_never_its_target(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (tmp_path / "key").symlink_to(target)
    write_secret(tmp_path / "key", b"k", 0o644)
    assert target.read_text() == "precious\n"
    assert not (tmp_path / "key").is_symlink() and (tmp_path / "key").read_bytes() == b"k"
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o644  # exact, whatever the umask
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        write_secret(tmp_path / "dangling", "x", exclusive=True)
    assert not (tmp_path / "nowhere").exists()


def test_a_private_secret_file_passes_and_others_are_refused(tmp_path: Path) -> None:
    good = tmp_path / "good.token"
    write_secret(good, "wst_x\n")
    check_secret_file(good)
    loose = tmp_path / "loose.token"
    loose.write_text("wst_x\n")
    for mode in (0o666, 0o640, 0o604, 0o601):
        loose.chmod(mode)
        with pytest.raises(InvalidArgument, match=f"refusing the secret file {loose}: group or others.*{mode:04o}"):
            check_secret_file(loose)
    link = tmp_path / "link.token"
    link.symlink_to(good)
    with pytest.raises(InvalidArgument, match=f"{link}: it is a symbolic link"):
        check_secret_file(link)
    fifo = tmp_path / "fifo.token"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        check_secret_file(fifo)


def test_a_private_directory_passes_and_group_or_world_writable_ones_are_refused(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"  # like /tmp: world-writable and sticky
    sticky.mkdir()
    sticky.chmod(0o1777)
    home = sticky / "host-a"
    home.mkdir()
    home.chmod(0o700)
    check_private_dir(home)  # a parent anyone may write is fine: the home itself is private
    check_private_dir(tmp_path)
    for mode in (0o777, 0o1777, 0o770, 0o702):
        home.chmod(mode)
        with pytest.raises(InvalidArgument, match=f"refusing the home {home}: it is writable by group or others"):
            check_private_dir(home, "the home")
    (tmp_path / "linkdir").symlink_to(home)
    with pytest.raises(InvalidArgument, match="symbolic link"):
        check_private_dir(tmp_path / "linkdir")
    with pytest.raises(InvalidArgument, match="not a directory"):
        check_private_dir(_a_file(tmp_path))
    made = private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def _a_file(tmp_path: Path) -> Path:
    f = tmp_path / "plain"
    f.write_text("")
    return f


@as_root
def test_files_and_directories_of_another_user_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(InvalidArgument, match=f"{d}: it is owned by uid {OTHER_UID}, not by this user"):
        check_private_dir(d)
    with pytest.raises(InvalidArgument, match=f"owned by uid {OTHER_UID}"):
        private_dir(d)
    f = tmp_path / "theirs.token"
    write_secret(f, "wst_x\n")
    os.chown(f, OTHER_UID, OTHER_UID)
    with pytest.raises(InvalidArgument, match=f"{f}: it is owned by uid {OTHER_UID}"):
        check_secret_file(f)
