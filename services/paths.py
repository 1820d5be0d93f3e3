"""Default on-disk locations. Everything lives under ``$WARMSERVE_HOME`` (default
``~/.cache/warmserve``) unless a flag names another directory; tests always pass ``tmp_path``."""

from __future__ import annotations

import os
from pathlib import Path


def warmserve_home() -> Path:
    """``$WARMSERVE_HOME`` or ``~/.cache/warmserve`` (not created here)."""
    env = os.environ.get("WARMSERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "warmserve"


def default_sidecar_root() -> Path:
    """Where prepacked weight sidecars are stored by default."""
    return warmserve_home() / "sidecars"


def default_kernel_cache_root() -> Path:
    """Where the kernel-cache store keeps compiled programs by default."""
    return warmserve_home() / "kernel-cache"


def default_programs_dir() -> Path:
    """Where a runner keeps the programs it fetched or compiled, and the fingerprint parts record
    of each key it wanted (``warmserve cache explain`` reads them), by default."""
    return warmserve_home() / "programs"
