"""A cap on the long-lived streaming RPCs a gRPC server serves at once.

grpcio's synchronous server runs every RPC on one thread of one pool, and a streaming RPC
(``Generate``, ``ModelStreamInfer``) holds its thread for the whole answer. Once streams hold
every thread, the short calls that keep a fleet together -- a runner's lease ``Heartbeat``, the
router's ``Health.Check`` of a runner, ``ModelInfo`` -- wait in the pool's queue behind them, time
out, and the router expires a lease and cancels every stream on that runner. So a server gives
streams at most ``max_streams`` threads (:class:`StreamSlots`) and sizes its pool
``max_streams + control_threads`` (:class:`services.bootstrap.ServerConfig`): the rest stay free
for control calls, and stream number ``max_streams + 1`` is refused at once as
:class:`~services.errors.Overloaded` (``UNAVAILABLE``, marked busy: retry later, or another
router/runner, which the router does without ejecting the runner) instead of queueing.
"""

from __future__ import annotations

import threading

import grpc

from services.errors import InvalidArgument, Overloaded


class StreamSlots:
    """At most ``limit`` streaming RPCs at once; ``owner`` names the server in the refusal
    ("the router", "runner runner-0"). Thread-safe. Raises ``InvalidArgument`` for ``limit < 1``."""

    def __init__(self, limit: int, owner: str) -> None:
        if limit < 1:
            raise InvalidArgument(f"the stream limit must be >= 1, got {limit}")
        self.limit = limit
        self.owner = owner
        self._lock = threading.Lock()
        self._in_use = 0

    @property
    def in_use(self) -> int:
        """Slots held now."""
        with self._lock:
            return self._in_use

    def take(self, context: grpc.ServicerContext) -> None:
        """Hold one slot until the RPC of ``context`` ends (it is released by the RPC's
        termination callback: done, cancelled or past its deadline). Raises ``Overloaded`` when
        all ``limit`` slots are held."""
        with self._lock:
            if self._in_use >= self.limit:
                raise Overloaded(f"{self.owner} is serving its maximum of {self.limit} concurrent streams "
                                  f"(--max-streams); retry later")
            self._in_use += 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._lock:
                    self._in_use -= 1

        if not context.add_callback(release):  # the RPC has already ended
            release()
