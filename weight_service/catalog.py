"""What a sidecar root holds: list valid sidecars, find one by fingerprint, hash its files."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from services.errors import NotFound
from weight_service.sidecar import SIDECAR_FILES, WEIGHTS_FILE, InvalidSidecar, SidecarInfo, validate_sidecar

log = logging.getLogger(__name__)


def list_sidecars(root: Path) -> list[SidecarInfo]:
    """Every sidecar directory under ``root`` that validates (structure and fingerprint
    consistency; not staleness against its checkpoint), sorted by directory name. Invalid ones
    are skipped (and logged)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for directory in sorted(root.iterdir()):
        if directory.name.startswith(".") or not (directory / WEIGHTS_FILE).is_file():
            continue
        try:
            found.append(validate_sidecar(directory))
        except InvalidSidecar as e:
            log.info("skipping invalid sidecar", extra={"sidecar": str(directory), "reason": str(e)})
    return found


def find_sidecar(root: Path, fingerprint: str) -> SidecarInfo:
    """The valid sidecar under ``root`` with this fingerprint; ``NotFound`` when none."""
    for info in list_sidecars(root):
        if info.fingerprint == fingerprint:
            return info
    raise NotFound(f"no valid sidecar with fingerprint {fingerprint[:16]}... under {root}")


def sidecar_files(directory: Path) -> list[str]:
    """Names of the sidecar files present in ``directory``, weights last."""
    return [name for name in SIDECAR_FILES if (Path(directory) / name).is_file()]


def sha256_of(fileobj, chunk_bytes: int = 1 << 20) -> str:
    """sha256 hex of an open binary file's whole content (reads from offset 0)."""
    fileobj.seek(0)
    h = hashlib.sha256()
    while block := fileobj.read(chunk_bytes):
        h.update(block)
    return h.hexdigest()
