"""The bounded pool ``Prepare`` runs on (``weights serve --prepare-workers``;
``docs/architecture.md`` §4, "Model roots and limits"): at most ``workers`` Prepares pack at
once, the others wait for a worker. Waiting Prepares are queued, not refused: a fleet's runners
starting together all ask at once, and a refusal would fail their start-up; the queue is bounded
by the server's stream slots, since each waiting Prepare holds one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from services.errors import InvalidArgument

#: Prepares working at once (``--prepare-workers``).
DEFAULT_PREPARE_WORKERS = 2


class PreparePool:
    """At most ``workers`` (>= 1, else ``InvalidArgument``) jobs running at once."""

    def __init__(self, workers: int = DEFAULT_PREPARE_WORKERS) -> None:
        if workers < 1:
            raise InvalidArgument(f"--prepare-workers must be >= 1, got {workers}")
        self.workers = workers
        self._slots = threading.BoundedSemaphore(workers)

    def submit(self, job: Callable[[], None], gone: threading.Event) -> None:
        """Run ``job`` in a daemon thread once a worker is free, unless ``gone`` (the client left)
        is set by then. A job that started runs to its end (a pack publishes its sidecar)."""

        def work() -> None:
            with self._slots:
                if not gone.is_set():
                    job()

        threading.Thread(target=work, name="weights-prepare", daemon=True).start()
