"""The KServe v2 / Open Inference Protocol door: ``inference.GRPCInferenceService``, the
gRPC API of Triton Inference Server, on the router's own port beside ``warmserve.v1``.

The model looks like a vLLM model on Triton (backend ``vllm``, decoupled, the vLLM backend's
tensors: :mod:`kserve_service.model`, :mod:`kserve_service.tensors`), so a client written for one works unchanged:
``tritonclient.grpc`` ``is_server_live`` / ``is_model_ready`` / ``get_model_metadata`` /
``start_stream`` + ``async_stream_infer``. The servicer only validates and translates (:mod:`kserve_service.inference`,
:mod:`kserve_service.stream`); each inference is one :meth:`router_service.router.Router.generate` call (routing, retries before the
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

The model's name and versions: :mod:`kserve_service.names`.

Status codes: a malformed request ``INVALID_ARGUMENT`` (invalid Unicode included); an unknown
model ``NOT_FOUND``; no runner ``UNAVAILABLE``; every runner busy, the router's streams all
taken, or a stream's requests in flight at their cap (``--max-stream-requests``)
:class:`~services.errors.Overloaded` (``UNAVAILABLE`` marked ``warmserve-overloaded: 1``);
refusals are counted in ``warmserve_refused_total``; a runner's own status passes through (``INVALID_ARGUMENT`` for too many
``max_tokens``, ``RESOURCE_EXHAUSTED``, ...); the client's deadline ``DEADLINE_EXCEEDED``; a
generation that failed inside the runner ``INTERNAL``.
"""

from __future__ import annotations

import importlib.metadata
import threading

import grpc

from kserve_service.inference import plan, responses
from kserve_service.model import BACKEND, INPUTS, MODEL_VERSION, OUTPUTS, model_config, tensor_metadata
from kserve_service.names import ModelNames
from kserve_service.stream import StreamSession, error_response
from router_service.deadline import time_left
from router_service.router import Router
from services.bootstrap import ServerConfig
from services.errors import Internal, InvalidArgument, NotFound, WarmserveError, abort_with
from services.proto.triton import grpc_service_pb2 as kserve_pb2
from services.proto.triton import grpc_service_pb2_grpc as kserve_pb2_grpc
from services.stream_slots import StreamSlots

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


def server_version() -> str:
    """The installed ``warmserve`` distribution's version (``0+unknown`` when not installed)."""
    try:
        return importlib.metadata.version("warmserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


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

    def ModelInfer(self, request, context):
        """Run one request to the end; the whole answer in one response."""
        try:
            self._slots.take(context)
            request_plan = plan(self.names, request)
            if request_plan.stream:
                raise InvalidArgument("input 'stream' is true: a streamed answer needs ModelStreamInfer "
                                      "(ModelInfer returns one response)")
            relay = self._router.generate(request_plan.generate, timeout_s=time_left(context))
        except WarmserveError as e:
            self._router.refusals.abort(context, e)
        context.add_callback(relay.cancel)  # client cancel / deadline -> cancel the runner's call
        try:
            for response in responses(request_plan, relay, stream_rpc=False):
                return response
        except WarmserveError as e:
            self._router.refusals.abort(context, e)
        abort_with(context, Internal("the runner's answer had no final response"))

    def ModelStreamInfer(self, request_iterator, context):
        """Serve every request of the stream concurrently (see the module docstring)."""
        grpc_errors = dict(context.invocation_metadata() or ()).get(GRPC_ERROR_HEADER, "").lower() == "true"
        try:
            self._slots.take(context)
        except WarmserveError as e:
            self._router.refusals.abort(context, e)
        session = StreamSession(self._router, self.names, context)
        context.add_callback(session.cancel)
        reader = threading.Thread(target=session.read, args=(request_iterator,), name="kserve-stream-read",
                                  daemon=True)
        reader.start()
        for item in session.items():
            if isinstance(item, kserve_pb2.ModelStreamInferResponse):
                yield item
                continue
            request, err, started = item
            self._router.refusals.count(err)
            if grpc_errors:
                session.cancel()
                abort_with(context, err)
            yield error_response(request, err, started=started)


def _unimplemented(name: str):
    def method(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"warmserve does not implement {SERVICE_NAME}/{name}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}``: ``UNIMPLEMENTED`` on purpose (:data:`UNIMPLEMENTED_RPCS`)."
    return method


for _name in sorted(UNIMPLEMENTED_RPCS):
    setattr(KServeServicer, _name, _unimplemented(_name))
