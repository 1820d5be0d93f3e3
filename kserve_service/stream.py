"""``ModelStreamInfer``'s session: every request of one bidirectional stream run concurrently,
answered by ``id``, errors as in-stream responses (``docs/architecture.md`` §10; the RPC itself
is :meth:`kserve_service.servicer.KServeServicer.ModelStreamInfer`). A stream holds one stream
slot, so it may have at most :attr:`RouterConfig.max_stream_requests
<router_service.config.RouterConfig>` requests in flight; one more is answered, in the stream,
with :class:`~services.errors.Overloaded` (reason ``stream_in_flight``)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import grpc

from kserve_service.inference import Plan, plan, responses
from kserve_service.names import ModelNames
from kserve_service.tensors import request_label
from router_service.deadline import time_left
from router_service.relay import RelayStream
from router_service.router import Router
from services.errors import Internal, Overloaded, WarmserveError
from services.proto.triton import grpc_service_pb2 as kserve_pb2

log = logging.getLogger(__name__)

#: Responses a stream holds for a slow client before its runner calls wait (backpressure).
STREAM_QUEUE = 256


def error_response(request: kserve_pb2.ModelInferRequest, err: WarmserveError, *,
                    started: bool) -> kserve_pb2.ModelStreamInferResponse:
    """An in-stream error as Triton writes one: ``error_message`` and the request's ``id``; one
    that happened after the request started also names the model and is flagged final."""
    resp = kserve_pb2.ModelStreamInferResponse(error_message=str(err))
    resp.infer_response.id = request.id
    if started:
        resp.infer_response.model_name = request.model_name
        resp.infer_response.model_version = request.model_version
        resp.infer_response.parameters["triton_final_response"].bool_param = True
    return resp


_END = object()


class StreamSession:
    """One ``ModelStreamInfer`` call: a reader thread takes requests off the stream and starts a
    thread per request, which relays its answer into a bounded queue that the RPC's response
    iterator drains. Errors travel as ``(request, error, started)`` items."""

    def __init__(self, router: Router, names: ModelNames, context: grpc.ServicerContext) -> None:
        self._router = router
        self._names = names
        self._context = context
        self._queue: queue.Queue = queue.Queue(maxsize=STREAM_QUEUE)
        self._lock = threading.Lock()
        self._relays: set[RelayStream] = set()
        self._pending = 0
        self._limit = router.config.max_stream_requests
        self._reading = True
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """The call ended (client cancel, deadline, or done): cancel every runner call left."""
        self._cancelled.set()
        with self._lock:
            relays = list(self._relays)
        for relay in relays:
            relay.cancel()

    def _put(self, item) -> bool:
        while not self._cancelled.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _finish_one(self) -> None:
        with self._lock:
            self._pending -= 1
            done = not self._reading and self._pending == 0
        if done:
            self._put(_END)

    def read(self, request_iterator) -> None:
        """Start each request as it arrives; when the client closes its side, end the response
        stream once the requests in flight are answered."""
        try:
            for request in request_iterator:
                if self._cancelled.is_set():
                    break
                self._start(request)
        except Exception as e:  # the client went away: the call's callback cancels the rest
            log.debug("stream read ended", extra={"error": str(e)})
        finally:
            with self._lock:
                self._reading = False
                done = self._pending == 0
            if done:
                self._put(_END)

    def _start(self, request: kserve_pb2.ModelInferRequest) -> None:
        with self._lock:
            full = self._pending >= self._limit
            if not full:
                self._pending += 1
        if full:
            self._put((request, Overloaded(
                f"{request_label(request)} this ModelStreamInfer stream already has {self._limit} requests in "
                f"flight (--max-stream-requests); send more once some are answered", reason="stream_in_flight"),
                False))
            return
        try:
            request_plan = plan(self._names, request)
            relay = self._router.generate(request_plan.generate, timeout_s=time_left(self._context))
        except Exception as e:  # WarmserveError: a bad request; anything else must not hang the stream
            if not isinstance(e, WarmserveError):
                log.exception("stream request failed")
                e = Internal("the router failed to start the request; see its log")
            self._put((request, e, False))
            self._finish_one()
            return
        with self._lock:
            self._relays.add(relay)
        if self._cancelled.is_set():
            relay.cancel()
        threading.Thread(target=self._run, args=(request_plan, relay), name="kserve-stream-infer", daemon=True).start()

    def _run(self, request_plan: Plan, relay: RelayStream) -> None:
        try:
            for response in responses(request_plan, relay, stream_rpc=True):
                if not self._put(kserve_pb2.ModelStreamInferResponse(infer_response=response)):
                    relay.cancel()
                    break
        except WarmserveError as e:
            self._put((request_plan.request, e, True))
        except Exception:  # a bug here must not leave the stream hanging
            log.exception("stream request failed")
            self._put((request_plan.request, Internal("the router failed to relay the answer; see its log"), True))
        finally:
            with self._lock:
                self._relays.discard(relay)
            self._finish_one()

    def items(self) -> Iterator:
        """What to send, in order, until every request is answered or the call is cancelled."""
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._cancelled.is_set():
                    return
                continue
            if item is _END:
                return
            yield item
