"""The router's KServe v2 / Open Inference Protocol door: ``inference.GRPCInferenceService``, the
gRPC API of Triton Inference Server, on the router's own port beside ``warmserve.v1``.

The model looks like a vLLM model on Triton (backend ``vllm``, decoupled, the vLLM backend's
tensors: :mod:`router_service.kserve_convert`), so a client written for one works unchanged:
``tritonclient.grpc`` ``is_server_live`` / ``is_model_ready`` / ``get_model_metadata`` /
``start_stream`` + ``async_stream_infer``. The servicer only validates and translates; each
inference is one :meth:`router_service.router.Router.generate` call (routing, retries before the
first token, deadlines and cancellation are the relay's).

RPCs and their behaviour:

- ``ServerLive``: always live. ``ServerReady``: a runner is READY.
- ``ModelReady``: ready when a runner is READY; ``ready=false`` while no runner has told the
  router which model it serves (and no ``--served-model-name`` names it), and for a model or
  version it does not serve (as Triton's ``ModelIsReady``: not an error).
- ``ServerMetadata``: name ``warmserve``, the package's version, extensions
  ``model_configuration`` and ``parameters``.
- ``ModelMetadata`` / ``ModelConfig``: the served name, version ``1``, platform/backend ``vllm``,
  the inputs and outputs, ``max_batch_size`` 0, decoupled transaction policy.
- ``RepositoryIndex``: the one model, ``READY`` or ``UNAVAILABLE``.
- ``ModelInfer`` (unary): the whole answer in one response (a warmserve extension: Triton
  refuses unary calls to a decoupled model); ``stream`` true is ``INVALID_ARGUMENT``.
- ``ModelStreamInfer`` (bidirectional): requests on one stream run concurrently, each answered
  by its ``id``. With ``stream`` true one response per text delta (a runner message without new
  text is skipped, except the last), the last carrying the parameter
  ``triton_final_response: true`` (false on the others), as Triton's frontend marks every
  response of a decoupled model; without it one response with the whole answer. An error is a
  response with ``error_message`` (and ``id``) and the stream goes on, as Triton does; a client
  that sends the ``triton_grpc_error: true`` header gets the error as the stream's gRPC status
  instead (Triton's opt-in). The client closing its side lets requests in flight finish;
  cancelling the call cancels every runner call of the stream.
- the rest (statistics, repository load/unload, shared memory, trace and log settings):
  ``UNIMPLEMENTED`` (:data:`UNIMPLEMENTED_RPCS`).

The model name: :attr:`RouterConfig.served_model_name <router_service.config.RouterConfig>` (the
router's ``--served-model-name``), else :func:`services.model_name.served_model_name` of the
runners' model source; a request may name either that or the source itself
(:func:`services.model_name.names_model`), anything else is ``NOT_FOUND``. Model version ``""``,
``-1`` or ``1``; another number is ``NOT_FOUND``, anything else ``INVALID_ARGUMENT``.

Status codes: a malformed request ``INVALID_ARGUMENT``; an unknown model ``NOT_FOUND``; no
runner ``UNAVAILABLE``; a runner's own status passes through (``INVALID_ARGUMENT`` for too many
``max_tokens``, ``RESOURCE_EXHAUSTED``, ...); the client's deadline ``DEADLINE_EXCEEDED``; a
generation that failed inside the runner ``INTERNAL``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from router_service.deadline import time_left
from router_service.kserve_convert import (
    BACKEND,
    INPUTS,
    MODEL_VERSION,
    OUTPUTS,
    InferInputs,
    decode_inputs,
    generate_request,
    infer_response,
    model_config,
    prepend_input,
    requested_outputs,
    sampling_from_request,
    tensor_metadata,
)
from router_service.registry import RunnerState
from router_service.relay import RelayStream
from router_service.router import Router
from services.bootstrap import ServerConfig
from services.errors import InvalidArgument, NotFound, Unavailable, WarmserveError, abort_with
from services.model_name import names_model, served_model_name
from services.proto import generation_pb2
from services.proto.triton import grpc_service_pb2 as kserve_pb2
from services.proto.triton import grpc_service_pb2_grpc as kserve_pb2_grpc
from services.stream_slots import StreamSlots

log = logging.getLogger(__name__)

#: The service's full name (health checks, reflection).
SERVICE_NAME = "inference.GRPCInferenceService"
#: ``ServerMetadata.name``.
SERVER_NAME = "warmserve"
#: ``ServerMetadata.extensions``: the KServe v2 / Triton protocol extensions this door honours.
EXTENSIONS = ("model_configuration", "parameters")
#: RPCs answered ``UNIMPLEMENTED`` on purpose (nothing in warmserve to report or change).
UNIMPLEMENTED_RPCS = frozenset({
    "ModelStatistics", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
    "TraceSetting", "LogSettings",
})
#: The header with which a Triton client asks for stream errors as the gRPC status.
GRPC_ERROR_HEADER = "triton_grpc_error"
#: Responses a stream holds for a slow client before its runner calls wait (backpressure).
_STREAM_QUEUE = 256
#: How long a model source learnt through ``ModelInfo`` is trusted (seconds).
_SOURCE_TTL_S = 5.0
def server_version() -> str:
    """The installed ``warmserve`` distribution's version (``0+unknown`` when not installed)."""
    try:
        return importlib.metadata.version("warmserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Internal(WarmserveError):
    """Generation failed inside the runner (gRPC ``INTERNAL``)."""

    code = grpc.StatusCode.INTERNAL


class ModelNames:
    """Which model name the door answers to (see the module docstring); thread-safe.

    The source comes from the router's table (a registered runner says what it serves), else
    from a READY runner's ``ModelInfo`` (static runners), kept :data:`_SOURCE_TTL_S` seconds."""

    def __init__(self, router: Router, configured: str = "") -> None:
        self._router = router
        self._configured = configured
        self._lock = threading.Lock()
        self._cached: tuple[str, float] | None = None  # (source, monotonic time learnt)

    def source(self) -> str:
        """The runners' model source, or ``""`` when no runner has said it (never raises)."""
        runners = self._router.registry.snapshot()
        ready = [r for r in runners if r.state is RunnerState.READY]
        for r in ready:
            if r.model:
                return r.model
        with self._lock:
            cached = self._cached
        if cached is not None and time.monotonic() - cached[1] < _SOURCE_TTL_S:
            return cached[0]
        if ready:
            try:
                source = self._router.model_info(timeout_s=5.0).model
            except WarmserveError as e:
                log.debug("model source unknown", extra={"error": str(e)})
            else:
                with self._lock:
                    self._cached = (source, time.monotonic())
                return source
        return next((r.model for r in runners if r.model), cached[0] if cached else "")

    def current(self) -> tuple[str, str] | None:
        """``(served name, source)``; ``None`` while neither is known (no runner, no configured name)."""
        source = self.source()
        if self._configured:
            return self._configured, source
        if not source:
            return None
        return served_model_name(source), source

    def resolve(self, requested: str, version: str = "") -> str:
        """The served name when ``requested`` (and ``version``) name the model. Raises
        ``NotFound`` for another name or version, ``InvalidArgument`` for a version that is not
        a number, ``Unavailable`` when the name cannot be known yet."""
        names = self.current()
        if names is None:
            raise Unavailable(f"no runner is ready ({self._router.registry.describe()}), so the model's name is not "
                              f"known yet (the router's --served-model-name would fix it)")
        served, source = names
        if not requested or not names_model(requested, served_name=served, source=source or served):
            raise NotFound(f"Request for unknown model: '{requested}' is not found (this server serves '{served}')")
        check_version(served, version)
        return served


def check_version(model: str, version: str) -> None:
    """Accept ``""``, ``-1`` (latest) and ``1``. Raises ``InvalidArgument`` for a version that
    is not an integer and ``NotFound`` for another one."""
    text = version.strip()
    if text in ("", "-1", MODEL_VERSION):
        return
    try:
        int(text)
    except ValueError:
        raise InvalidArgument(f"failed to get model version from specified version string '{version}'") from None
    raise NotFound(f"Request for unknown model: '{model}' version {text} is not found (it has version "
                   f"{MODEL_VERSION})")


@dataclass(frozen=True)
class _Plan:
    """One validated inference request, ready to run."""

    request: kserve_pb2.ModelInferRequest
    model: str
    inputs: InferInputs
    wanted: frozenset[str] | None
    stream: bool
    prepend: bool
    generate: generation_pb2.GenerateRequest


class KServeServicer(kserve_pb2_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over a :class:`Router` (see the module docstring)."""

    def __init__(self, router: Router, slots: StreamSlots | None = None) -> None:
        """``slots`` caps the ``ModelInfer``/``ModelStreamInfer`` calls served at once, shared with
        the router's other doors (:mod:`services.stream_slots`; default: its own cap)."""
        self._router = router
        self.names = ModelNames(router, router.config.served_model_name)
        self._slots = slots or StreamSlots(ServerConfig.max_streams, "the router")

    # -- health and metadata ---------------------------------------------------------------

    def ServerLive(self, request, context):
        """Always live while the router serves."""
        return kserve_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        """Ready when a runner is READY."""
        return kserve_pb2.ServerReadyResponse(ready=self._router.ready_count() > 0)

    def ModelReady(self, request, context):
        """Ready when the name is the model's and a runner is READY; ``ready=false`` while the
        name is not known yet and for another model or version (as Triton); a malformed version
        is ``INVALID_ARGUMENT``."""
        if self.names.current() is None:
            return kserve_pb2.ModelReadyResponse(ready=False)
        try:
            self.names.resolve(request.name, request.version)
        except NotFound:  # as Triton: an unknown model or version is not ready, not an error
            return kserve_pb2.ModelReadyResponse(ready=False)
        except WarmserveError as e:
            abort_with(context, e)
        return kserve_pb2.ModelReadyResponse(ready=self._router.ready_count() > 0)

    def ServerMetadata(self, request, context):
        """Name ``warmserve``, the package version, :data:`EXTENSIONS`."""
        return kserve_pb2.ServerMetadataResponse(name=SERVER_NAME, version=server_version(),
                                                 extensions=list(EXTENSIONS))

    def ModelMetadata(self, request, context):
        """The model's name, version, platform and tensors."""
        try:
            name = self.names.resolve(request.name, request.version)
        except WarmserveError as e:
            abort_with(context, e)
        return kserve_pb2.ModelMetadataResponse(name=name, versions=[MODEL_VERSION], platform=BACKEND,
                                                inputs=tensor_metadata(INPUTS), outputs=tensor_metadata(OUTPUTS))

    def ModelConfig(self, request, context):
        """The model's configuration, as a Triton vLLM model reports it."""
        try:
            name = self.names.resolve(request.name, request.version)
        except WarmserveError as e:
            abort_with(context, e)
        return kserve_pb2.ModelConfigResponse(config=model_config(name))

    def RepositoryIndex(self, request, context):
        """The one model with its state (``ready`` true lists it only when READY)."""
        names = self.names.current()
        if names is None:
            return kserve_pb2.RepositoryIndexResponse()
        ready = self._router.ready_count() > 0
        if request.ready and not ready:
            return kserve_pb2.RepositoryIndexResponse()
        entry = kserve_pb2.RepositoryIndexResponse.ModelIndex(
            name=names[0], version=MODEL_VERSION, state="READY" if ready else "UNAVAILABLE",
            reason="" if ready else "no runner is ready")
        return kserve_pb2.RepositoryIndexResponse(models=[entry])

    # -- inference -------------------------------------------------------------------------

    def _plan(self, request: kserve_pb2.ModelInferRequest) -> _Plan:
        model = self.names.resolve(request.model_name, request.model_version)
        inputs = decode_inputs(request, model)
        wanted = requested_outputs(request, model)
        stream = bool(inputs.stream)
        prepend = prepend_input(inputs, stream=stream)
        sampling = sampling_from_request(inputs, request)
        return _Plan(request, model, inputs, wanted, stream, prepend, generate_request(inputs, sampling))

    def _responses(self, plan: _Plan, relay: RelayStream, *, stream_rpc: bool) -> Iterator[kserve_pb2.ModelInferResponse]:
        """The responses of one request (one per text delta when ``plan.stream``, else one with
        the whole answer); ``stream_rpc`` adds ``triton_final_response``. Raises
        ``WarmserveError`` from the relay, ``Internal`` for a generation that failed inside the
        runner or a runner stream that ended without a finish reason."""
        parts: list[str] = []
        tokens = 0  # tokens since the last response sent
        for msg in relay:
            tokens += len(msg.token_ids)
            final = msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
            if msg.finish_reason == generation_pb2.FINISH_REASON_ABORTED:
                raise Internal(f"generation failed inside runner {msg.runner_id or relay.runner_id} after "
                               f"{relay.tokens_relayed} tokens")
            if plan.stream:
                if not msg.text and not final:
                    continue
                yield infer_response(plan.request, plan.model, text=msg.text, inputs=plan.inputs, wanted=plan.wanted,
                                     finish_reason=msg.finish_reason if final else None,
                                     prompt_tokens=msg.usage.prompt_tokens if final else None,
                                     output_tokens=tokens, final_flag=final)
                tokens = 0
            else:
                parts.append(msg.text)
            if final:
                if not plan.stream:
                    text = (plan.inputs.text_input if plan.prepend else "") + "".join(parts)
                    yield infer_response(plan.request, plan.model, text=text, inputs=plan.inputs, wanted=plan.wanted,
                                         finish_reason=msg.finish_reason, prompt_tokens=msg.usage.prompt_tokens,
                                         output_tokens=tokens, final_flag=True if stream_rpc else None)
                return
        raise Internal(f"runner {relay.runner_id}'s stream ended without a finish reason")

    def ModelInfer(self, request, context):
        """Run one request to the end; the whole answer in one response."""
        try:
            self._slots.take(context)
            plan = self._plan(request)
            if plan.stream:
                raise InvalidArgument("input 'stream' is true: a streamed answer needs ModelStreamInfer "
                                      "(ModelInfer returns one response)")
            relay = self._router.generate(plan.generate, timeout_s=time_left(context))
        except WarmserveError as e:
            abort_with(context, e)
        context.add_callback(relay.cancel)  # client cancel / deadline -> cancel the runner's call
        try:
            for response in self._responses(plan, relay, stream_rpc=False):
                return response
        except WarmserveError as e:
            abort_with(context, e)
        abort_with(context, Internal("the runner's answer had no final response"))

    def ModelStreamInfer(self, request_iterator, context):
        """Serve every request of the stream concurrently (see the module docstring)."""
        grpc_errors = dict(context.invocation_metadata() or ()).get(GRPC_ERROR_HEADER, "").lower() == "true"
        try:
            self._slots.take(context)
        except WarmserveError as e:
            abort_with(context, e)
        session = _StreamSession(self, context)
        context.add_callback(session.cancel)
        reader = threading.Thread(target=session.read, args=(request_iterator,), name="kserve-stream-read",
                                  daemon=True)
        reader.start()
        for item in session.items():
            if isinstance(item, kserve_pb2.ModelStreamInferResponse):
                yield item
                continue
            request, err, started = item
            if grpc_errors:
                session.cancel()
                abort_with(context, err)
            yield _error_response(request, err, started=started)


def _error_response(request: kserve_pb2.ModelInferRequest, err: WarmserveError, *,
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


class _StreamSession:
    """One ``ModelStreamInfer`` call: a reader thread takes requests off the stream and starts a
    thread per request, which relays its answer into a bounded queue that the RPC's response
    iterator drains. Errors travel as ``(request, error, started)`` items."""

    def __init__(self, servicer: KServeServicer, context: grpc.ServicerContext) -> None:
        self._servicer = servicer
        self._context = context
        self._queue: queue.Queue = queue.Queue(maxsize=_STREAM_QUEUE)
        self._lock = threading.Lock()
        self._relays: set[RelayStream] = set()
        self._pending = 0
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
            self._pending += 1
        try:
            plan = self._servicer._plan(request)
            relay = self._servicer._router.generate(plan.generate, timeout_s=time_left(self._context))
        except Exception as e:  # WarmserveError: a bad request; anything else must not hang the stream
            if not isinstance(e, WarmserveError):
                log.exception("stream request failed")
                e = Internal(f"the router failed to start the request: {e}")
            self._put((request, e, False))
            self._finish_one()
            return
        with self._lock:
            self._relays.add(relay)
        if self._cancelled.is_set():
            relay.cancel()
        threading.Thread(target=self._run, args=(plan, relay), name="kserve-stream-infer", daemon=True).start()

    def _run(self, plan: _Plan, relay: RelayStream) -> None:
        try:
            for response in self._servicer._responses(plan, relay, stream_rpc=True):
                if not self._put(kserve_pb2.ModelStreamInferResponse(infer_response=response)):
                    relay.cancel()
                    break
        except WarmserveError as e:
            self._put((plan.request, e, True))
        except Exception as e:  # a bug here must not leave the stream hanging
            log.exception("stream request failed")
            self._put((plan.request, Internal(f"the router failed to relay the answer: {e}"), True))
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


def _unimplemented(name: str):
    def method(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"warmserve does not implement {SERVICE_NAME}/{name}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}``: ``UNIMPLEMENTED`` on purpose (:data:`UNIMPLEMENTED_RPCS`)."
    return method


for _name in sorted(UNIMPLEMENTED_RPCS):
    setattr(KServeServicer, _name, _unimplemented(_name))
