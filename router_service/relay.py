"""One request's trip through the router: pick a runner, relay its token stream, retry or fail.

:class:`RelayStream` is an iterator of ``GenerateResponse`` messages:

- it picks a runner with the request's policy (counting it busy until the call ends), and calls
  the runner's ``Generate`` with the *remaining* deadline;
- it reads the runner's stream only as fast as it is consumed (each ``next()`` pulls one message
  from the runner), so a slow client slows the runner's stream down through gRPC flow control
  instead of buffering in the router (backpressure);
- while no token has reached the consumer, an ``UNAVAILABLE`` runner is ejected and the request
  goes to another runner (``max_attempts`` failed runners at most); a runner that answers
  :class:`~services.errors.Overloaded` (busy: all its stream slots held) is not ejected nor
  counted as failed, the request just goes to another runner, and when no runner takes it and
  one of those tried was busy it ends ``Overloaded``; once a token has been relayed, a failing
  runner ends the stream with ``UNAVAILABLE`` naming it, never a retry (the client would
  see duplicated text);
- :meth:`RelayStream.cancel` (wired to the client's cancellation) cancels the runner's call, which
  makes the runner free the sequence's KV blocks;
- a call that relays nothing within ``first_token_timeout_s`` is cancelled, its runner ejected
  and the request retried; and when a runner is ejected or leaves the table for any reason,
  :meth:`InFlight.abandon` cancels its calls that have not streamed output yet, which are
  retried too, so a frozen runner holds no request until its lease lapses.

Errors raised while iterating are :class:`services.errors.WarmserveError` with the gRPC code to
return: ``UNAVAILABLE`` (no runner ready / runner died; ``Overloaded``: every runner busy),
``DEADLINE_EXCEEDED``, ``CANCELLED``, or
the runner's own status (e.g. ``INVALID_ARGUMENT``) passed through with its message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from router_service.channels import ChannelPool
from router_service.registry import Chooser, Runner, RunnerRegistry
from services.errors import (
    Cancelled,
    DeadlineExceeded,
    Overloaded,
    Unavailable,
    WarmserveError,
    from_rpc_error,
    is_overloaded,
)
from services.proto import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)


def upstream_error(err: grpc.RpcError, runner: Runner) -> WarmserveError:
    """A runner's error status as a :class:`WarmserveError` with the same code and message."""
    out = from_rpc_error(err)
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    if out.code != code:
        out = WarmserveError(err.details() if hasattr(err, "details") else str(err))
        out.code = code
    log.debug("runner error", extra={"runner_id": runner.runner_id, "code": code.name})
    return out


class InFlight:
    """The relays calling each runner now (thread-safe), so that when the router ejects a runner
    it can :meth:`abandon` the calls that have not streamed output yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_runner: dict[str, set[RelayStream]] = {}

    def add(self, runner_id: str, relay: RelayStream) -> None:
        """``relay`` is calling ``runner_id``."""
        with self._lock:
            self._by_runner.setdefault(runner_id, set()).add(relay)

    def discard(self, runner_id: str, relay: RelayStream) -> None:
        """``relay``'s call to ``runner_id`` ended."""
        with self._lock:
            relays = self._by_runner.get(runner_id)
            if relays is not None:
                relays.discard(relay)
                if not relays:
                    del self._by_runner[runner_id]

    def abandon(self, runner_id: str, why: str) -> int:
        """Cancel every call to ``runner_id`` that has streamed nothing yet (each relay then
        retries on another runner); returns how many."""
        with self._lock:
            relays = list(self._by_runner.get(runner_id, ()))
        return sum(relay.abandon(runner_id, why) for relay in relays)


def _carries_output(resp: generation_pb2.GenerateResponse) -> bool:
    return bool(resp.token_ids or resp.text or resp.finish_reason)


class RelayStream:
    """Iterate to relay one ``Generate`` call (see the module docstring); iterate only once.

    ``deadline`` is an absolute ``time.monotonic()`` value, or ``None`` for no deadline.
    """

    def __init__(self, request: generation_pb2.GenerateRequest, chooser: Chooser, *,
                 registry: RunnerRegistry, channels: ChannelPool, max_attempts: int,
                 deadline: float | None, first_token_timeout_s: float = 0.0,
                 in_flight: InFlight | None = None) -> None:
        self._request = request
        self._chooser = chooser
        self._registry = registry
        self._channels = channels
        self._max_attempts = max_attempts
        self._deadline = deadline
        self._first_token_timeout_s = first_token_timeout_s
        self._first_token_missed = False  # this attempt's call was cancelled for want of a first token
        self._abandoned = ""  # why this attempt's call was cancelled by abandon() ("" = it was not)
        self._in_flight = in_flight
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self._cancelled = False
        self.attempts: list[tuple[str, str]] = []  # (runner_id, why it failed) per failed attempt
        self.busy = 0                               # attempts a runner refused as Overloaded
        self.runner_id = ""                         # the runner that served (or last tried)
        self.tokens_relayed = 0                     # tokens handed to the consumer
        self.messages_relayed = 0                   # messages handed to the consumer

    def cancel(self) -> None:
        """Cancel the request (idempotent, any thread): the runner's call is cancelled now."""
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def abandon(self, runner_id: str, why: str) -> bool:
        """Cancel the call to ``runner_id`` if it is this relay's current one and nothing has been
        relayed yet (the relay then retries elsewhere); ``True`` when it was cancelled."""
        with self._lock:
            call = self._call
            if call is None or self.runner_id != runner_id or self.messages_relayed or self._cancelled:
                return False
            self._abandoned = why
        call.cancel()
        return True

    def __iter__(self) -> Iterator[generation_pb2.GenerateResponse]:
        return self._run()

    def _remaining(self) -> float | None:
        if self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(self._with_attempts("the request's deadline passed before a runner answered"))
        return left

    def _with_attempts(self, message: str) -> str:
        if not self.attempts:
            return message
        return message + "; tried " + "; ".join(f"{rid}: {why}" for rid, why in self.attempts)

    def _run(self) -> Iterator[generation_pb2.GenerateResponse]:
        tried: set[str] = set()
        while True:
            if self._cancelled:
                raise Cancelled("the client cancelled the request")
            timeout = self._remaining()
            runner = self._registry.acquire(self._chooser, exclude=frozenset(tried))
            if runner is None:
                if not self.attempts:
                    raise Unavailable(f"no runner is ready ({self._registry.describe()})")
                raise self._exhausted("no runner could serve the request")
            tried.add(runner.runner_id)
            self.runner_id = runner.runner_id
            try:
                retry = yield from self._relay_from(runner, timeout)
            finally:
                self._registry.release(runner.runner_id)
            if not retry:
                return
            if len(tried) - self.busy >= self._max_attempts:
                raise self._exhausted(f"no runner could serve the request in {len(tried)} attempts")

    def _exhausted(self, message: str) -> WarmserveError:
        """The error that ends a request no runner served: ``Overloaded`` when a runner tried was
        busy (the fleet is at capacity: retry later), else ``Unavailable``."""
        if self.busy:
            return Overloaded(self._with_attempts("every runner that could serve the request is busy; retry later"))
        return Unavailable(self._with_attempts(message))

    def _relay_from(self, runner: Runner, timeout: float | None):
        """Relay ``runner``'s stream; returns ``True`` when the request should go to another runner."""
        held: list[generation_pb2.GenerateResponse] = []
        watchdog = None
        self._first_token_missed = False
        self._abandoned = ""
        if self._in_flight is not None:
            self._in_flight.add(runner.runner_id, self)
        try:
            stub = generation_pb2_grpc.GenerationStub(self._channels.get(runner.address))
            call = stub.Generate(self._request, timeout=timeout)
            with self._lock:
                self._call = call
                cancelled = self._cancelled
            if cancelled:
                call.cancel()
            elif not self._registry.is_ready(runner.runner_id):  # ejected before the call was known
                self.abandon(runner.runner_id, "it was ejected")
            if self._first_token_timeout_s > 0 and not self.messages_relayed:
                watchdog = threading.Timer(self._first_token_timeout_s, self._no_first_token, args=(call,))
                watchdog.daemon = True
                watchdog.start()
            for resp in call:
                if not resp.runner_id:
                    resp.runner_id = runner.runner_id
                if not _carries_output(resp) and self.messages_relayed == 0:
                    held.append(resp)  # nothing the client could act on yet: a retry may drop it
                    continue
                if watchdog is not None:
                    watchdog.cancel()
                    watchdog = None
                yield from held
                held.clear()
                self.tokens_relayed += len(resp.token_ids)
                self.messages_relayed += 1
                yield resp
            yield from held  # a stream that ended without output: pass its messages on as they were
            return False
        except grpc.RpcError as e:
            return self._on_error(e, runner)
        except GeneratorExit:
            self.cancel()  # the consumer stopped reading: stop the runner too
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            with self._lock:
                self._call = None
            if self._in_flight is not None:
                self._in_flight.discard(runner.runner_id, self)

    def _no_first_token(self, call: grpc.Call) -> None:
        """The first-token watchdog fired: nothing usable came within the timeout; cancel the
        call (its iteration then ends with CANCELLED, which :meth:`_on_error` retries)."""
        with self._lock:
            if self._call is not call or self.messages_relayed:
                return
            self._first_token_missed = True
        call.cancel()

    def _on_error(self, e: grpc.RpcError, runner: Runner) -> bool:
        code = e.code()
        details = e.details() or code.name
        if self._cancelled:
            raise Cancelled("the client cancelled the request") from e
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise DeadlineExceeded(
                f"the request's deadline passed while runner {runner.runner_id} ({runner.address}) "
                f"was generating ({self.tokens_relayed} tokens relayed)") from e
        # A closed channel (runner dropped meanwhile) reads as CANCELLED without a client cancel.
        if self._abandoned:
            details = f"cancelled before its first token: {self._abandoned}"
        elif self._first_token_missed:
            details = f"no first token within {self._first_token_timeout_s:g} s (first-token timeout)"
        elif is_overloaded(e) and not self.messages_relayed:  # busy, not broken: no eject, no failure
            self.busy += 1
            self.attempts.append((runner.runner_id, f"{runner.address} busy: {details}"))
            log.debug("runner busy; trying another", extra={"runner_id": runner.runner_id})
            return True
        elif code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            raise upstream_error(e, runner) from e
        self._registry.eject(runner.runner_id, f"{code.name}: {details}")
        why = f"{runner.address} {code.name}: {details}"
        if self.messages_relayed:
            raise Unavailable(
                f"runner {runner.runner_id} ({runner.address}) failed after {self.tokens_relayed} tokens "
                f"were streamed ({code.name}: {details}); the request was not retried") from e
        self.attempts.append((runner.runner_id, why))
        log.info("retrying on another runner", extra={"runner_id": runner.runner_id, "error": why})
        return True
