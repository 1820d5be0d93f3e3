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

from services.errors import InvalidArgument, Overloaded, abort_with
from services.handlers import behaviour_of, non_blocking, wrap_behaviour
from services.scopes import scope_of


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


#: Streams of open methods (reflection's ``ServerReflectionInfo``; a health ``Watch`` that is not
#: callback-style) one server serves at once. They need no token, so this bounds the pool
#: threads an unauthenticated peer can hold; the pool is sized with them on top
#: (:attr:`services.bootstrap.ServerConfig.pool_threads`).
OPEN_STREAMS = 4


class OpenStreamLimit(grpc.ServerInterceptor):
    """Gives the open streaming methods (:func:`services.scopes.scope_of` is ``None``) at most
    ``limit`` threads: stream ``limit + 1`` is refused at once as ``Overloaded``
    (``open_streams``, counted in ``refusals`` when given). A callback-style behaviour
    (:func:`services.handlers.non_blocking`, ``grpc_health``'s ``Watch``) holds no thread and
    passes untouched."""

    def __init__(self, owner: str, limit: int = OPEN_STREAMS, refusals=None) -> None:
        self.slots = StreamSlots(limit, f"{owner} (open methods)")
        self._refusals = refusals

    def intercept_service(self, continuation, handler_call_details):
        """gRPC interceptor protocol."""
        handler = continuation(handler_call_details)
        if (handler is None or scope_of(handler_call_details.method) is not None
                or not (handler.request_streaming or handler.response_streaming)
                or non_blocking(behaviour_of(handler))):
            return handler
        slots, refusals = self.slots, self._refusals

        def bind(fn, _streaming: bool):
            def inner(request, context):
                try:
                    slots.take(context)
                except Overloaded as e:
                    e.reason = "open_streams"
                    if refusals is not None:
                        refusals.count(e)
                    abort_with(context, e)
                return fn(request, context)
            return inner

        return wrap_behaviour(handler, bind)
