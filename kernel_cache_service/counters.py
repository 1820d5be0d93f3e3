"""The counters a store keeps since it was made (the daemon's: since it started); ``cache stat``
and the Prometheus collector report them (``docs/architecture.md`` §6)."""

from __future__ import annotations

import threading
from collections import Counter

#: Counters since the store object was made (the daemon's: since it started).
COUNTERS = ("hits", "misses", "publishes", "evictions", "quarantined", "claims", "waits", "builds", "takeovers")


class Counters:
    """Thread-safe event counts by name (:data:`COUNTERS`)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to ``what``."""
        with self._lock:
            self._counts[what] += n

    def get(self, what: str) -> int:
        """The count of ``what`` now."""
        with self._lock:
            return self._counts[what]

    def snapshot(self) -> dict[str, int]:
        """Every counter of :data:`COUNTERS` by name, read at once."""
        with self._lock:
            return {k: self._counts[k] for k in COUNTERS}
