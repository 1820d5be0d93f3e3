"""Which model a door publishes, shared by both doors (``docs/architecture.md`` §10, §13): the
operator's ``--served-model-name``, else :func:`services.model_name.served_model_name` of the
runners' model source, and the router's last ``ModelInfo`` reused for a TTL. The KServe door
(:mod:`kserve_service.names`, sync) and the OpenAI door (:mod:`openai_service.served_model`,
async) each ask the router their own way and keep the answer here.
"""

from __future__ import annotations

import threading
import time

from services.model_name import served_model_name
from services.proto import generation_pb2


def published_name(configured: str | None, source: str) -> str:
    """The model id a door publishes: ``configured`` when given (not ``None`` or ``""``), else
    the default name of the model ``source`` (e.g. ``smollm2-135m-instruct``)."""
    return configured if configured else served_model_name(source)


class CachedModelInfo:
    """The router's last ``ModelInfoResponse``, fresh for ``ttl_s`` seconds (monotonic clock);
    thread-safe."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._info: generation_pb2.ModelInfoResponse | None = None
        self._at = 0.0

    def fresh(self) -> generation_pb2.ModelInfoResponse | None:
        """The last answer when at most ``ttl_s`` seconds old, else ``None``."""
        with self._lock:
            if self._info is not None and time.monotonic() - self._at <= self._ttl_s:
                return self._info
        return None

    def last(self) -> generation_pb2.ModelInfoResponse | None:
        """The last answer however old (``None`` before the first)."""
        with self._lock:
            return self._info

    def store(self, info: generation_pb2.ModelInfoResponse) -> None:
        """Keep ``info``, fresh from now."""
        with self._lock:
            self._info, self._at = info, time.monotonic()
