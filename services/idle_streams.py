"""An idle timeout for client-streaming RPCs (an upload such as kernel-cache ``Publish``).

A stream slot (:mod:`services.stream_slots`) bounds how many uploads hold a thread at once, but
a client that opens one and then stops sending, without a deadline, would hold its slot forever.
:class:`IdleStreams` watches every guarded request stream from one daemon thread (started while
there is something to watch) and cancels the RPC whose client has sent nothing for ``idle_s``
seconds; time the server spends on a message it was handed does not count. The blocked handler
then sees its request stream fail and answers :class:`services.errors.DeadlineExceeded`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc

from services.errors import DeadlineExceeded, InvalidArgument


class _Watch:
    __slots__ = ("context", "deadline", "expired")

    def __init__(self, context: grpc.ServicerContext, deadline: float) -> None:
        self.context, self.deadline, self.expired = context, deadline, False


class IdleStreams:
    """Cancels a guarded request stream idle for ``idle_s`` seconds (``> 0``; else
    ``InvalidArgument``). ``what`` names the stream in the error ("Publish");
    ``on_expire`` runs once per cancelled stream (a metrics counter). Thread-safe."""

    def __init__(self, idle_s: float, what: str, on_expire: Callable[[], None] | None = None) -> None:
        if not idle_s > 0:
            raise InvalidArgument(f"the idle timeout must be > 0 seconds, got {idle_s}")
        self.idle_s, self.what, self._on_expire = idle_s, what, on_expire
        self._lock = threading.Lock()
        self._watched: set[_Watch] = set()
        self._thread: threading.Thread | None = None

    def guard(self, requests: Iterable, context: grpc.ServicerContext) -> Iterator:
        """The messages of ``requests`` (the RPC's request iterator) as they arrive; raises
        ``DeadlineExceeded`` once the RPC was cancelled for ``idle_s`` seconds without one."""
        watch = _Watch(context, math.inf)
        with self._lock:
            self._watched.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"idle-{self.what}", daemon=True)
                self._thread.start()
        source = iter(requests)
        try:
            while True:
                watch.deadline = time.monotonic() + self.idle_s
                try:
                    message = next(source)
                except StopIteration:
                    break
                except grpc.RpcError:
                    if watch.expired:
                        raise self._expired() from None
                    raise
                watch.deadline = math.inf  # the server's own work on a message is not idle time
                yield message
        finally:
            with self._lock:
                self._watched.discard(watch)
        if watch.expired:
            raise self._expired()

    def _expired(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no {self.what} message arrived for {self.idle_s:g} s; the stream was cancelled "
                                "and nothing was stored")

    def _run(self) -> None:
        period = min(self.idle_s / 4, 1.0)
        while True:
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                now = time.monotonic()
                expired = [w for w in self._watched if not w.expired and w.deadline <= now]
                for w in expired:
                    w.expired = True
            for w in expired:
                w.context.cancel()
                if self._on_expire is not None:
                    self._on_expire()
            time.sleep(period)
