"""Which checkpoints a weight service packs and serves: the bundled model
(:data:`weight_service.sources.BUNDLED_SMOLLM2`) and paths under the model roots it was given at
start-up (``weights serve --model-root DIR``, repeatable); see ``docs/architecture.md`` §4,
"Model roots and limits".

A source path is resolved first (``~``, then every symlink and ``..``, :func:`os.path.realpath`),
so a link or a ``..`` cannot lead out of a root. Anything else is refused with
:class:`NotServed` and one sentence that is the same whether the path exists or not, and the
check runs before anything looks at the path itself, so a refusal never tells a caller what
exists on the host. Inside a root the usual errors apply (``does not exist``, ``not a .gguf``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from services.errors import PermissionDenied
from weight_service.sources import BUNDLED_SMOLLM2

log = logging.getLogger(__name__)


class NotServed(PermissionDenied):
    """A model source outside the weight service's model roots (gRPC ``PERMISSION_DENIED``)."""


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


class ModelRoots:
    """The allow-list: ``roots`` (directories; empty strings are ignored) resolved once, here.
    A root that does not exist yet is kept (a volume may appear later) and logged."""

    def __init__(self, roots: Iterable[str | Path] = ()) -> None:
        self.roots = tuple(dict.fromkeys(_real(r) for r in roots if str(r).strip()))
        for root in self.roots:
            if not root.is_dir():
                log.warning("model root is not a directory (yet)", extra={"model_root": str(root)})

    def check(self, source: str) -> None:
        """Return when ``source`` may be served: the bundled model's name, an empty source (its
        own ``InvalidArgument`` comes from :func:`~weight_service.sources.resolve_source`), or a
        path that resolves to a root or below one. Raises :class:`NotServed` otherwise."""
        if not source.strip() or source.strip().lower() == BUNDLED_SMOLLM2:
            return
        try:
            real = _real(source)
        except (ValueError, OSError):  # an embedded NUL byte, a name too long: no path
            real = None
        if real is not None and any(real == root or real.is_relative_to(root) for root in self.roots):
            return
        raise NotServed(f"model source {source[:200]!r} is not served here: this weight service serves "
                        f"{BUNDLED_SMOLLM2} and checkpoints under its --model-root directories only")


def root_for(source: str) -> str | None:
    """The ``--model-root`` a stack gives its weight service so that it serves ``source``:
    ``None`` for the bundled model, the directory of a ``.gguf`` file, a checkpoint directory
    itself. Left relative when ``source`` is (the weight service resolves both from its own
    working directory, as it does the source); reads nothing on disk."""
    if source.strip().lower() == BUNDLED_SMOLLM2:
        return None
    path = Path(source).expanduser()
    return str(path.parent if path.suffix.lower() == ".gguf" else path)
