"""The OpenAI-compatible application: FastAPI routes over the router's ``Generation`` service.

=====================================  ============================================================
route                                  answer
=====================================  ============================================================
``GET /health``                        200 ``{"status": "ok"}`` when the router has a READY runner
                                       (its ``ModelInfo`` answers), else 503 in OpenAI's error
                                       shape; both carry the ``warmserve-pid`` header
``GET /v1/models``                     the one served model (:mod:`openai_service.served_model`)
``GET /v1/models/{model}``             that model, or 404 ``model_not_found``
``POST /v1/completions``               a completion, or with ``stream`` server-sent chunks
``POST /v1/chat/completions``          a chat completion, or with ``stream`` server-sent chunks
``GET /metrics``                       Prometheus text: ``warmserve_refused_total{reason}``, what
                                       this door refused at a limit (``host``, ``api_key``,
                                       ``body_bytes``, ``unicode``, ``overloaded``); open, as vLLM's
=====================================  ============================================================

Each generation request is one ``Generate`` call to the router, ``n`` choices included (the
runner streams them interleaved, each message naming its choice in ``index``). Non-streaming,
the call is read to its end and answered with each choice's text, logprobs and finish reason
(``choices`` in index order) and the usage: the prompt's tokens once, the completion tokens
summed over the choices (as OpenAI counts them). Streaming, the first message is awaited before
the HTTP status is sent, so a request the runner refuses (e.g. a prompt over the context length)
is an HTTP error as with vLLM, not a stream; then each message becomes one chunk whose one
choice has the message's ``index`` (each choice ends with its own ``finish_reason``), a chat
stream starting with the assistant role's chunk for each choice, ``stream_options.include_usage``
adding a last chunk with ``choices: []`` and the usage, and ``data: [DONE]`` ending it once every
choice has finished. An error after the first chunk is sent as one
``data: {"error": ...}`` event before ``[DONE]`` (as vLLM does). A client that disconnects, while
waiting or mid-stream, cancels its ``Generate`` call.

Every error is OpenAI's ``{"error": {...}}`` (:mod:`openai_service.errors`), including a body
that fails validation (HTTP 400, not FastAPI's 422), unknown routes (404), a method a route
does not take (405, with ``Allow``) and an unexpected failure (500, whose text stays in the log).
:class:`~openai_service.guard.RequestGuard` checks the ``Host``, the API key and the body size
before any route runs; ``/docs``, ``/redoc`` and ``/openapi.json`` exist only with
``enable_docs`` (the schema, :mod:`openai_service.openapi`, is ``app.openapi()`` either way).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from openai_service.config import OpenAIConfig
from openai_service.convert import (
    CompletionLogprobsBuilder,
    chat_logprobs,
    chat_to_proto,
    chat_tools,
    completion_to_proto,
    finish_reason,
    structured_param,
    usage,
)
from openai_service.errors import OpenAIError, from_rpc_error, from_validation_error
from openai_service.guard import DOCS_PATHS, OPEN_PATHS, RequestGuard
from openai_service.openapi import HEALTH_STATUSES, V1_STATUSES, error_responses, ok_response, openapi_schema
from openai_service.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaMessage,
    Health,
    ModelCard,
    ModelList,
)
from openai_service.router_client import RouterClient
from openai_service.served_model import ServedModel
from openai_service.sse import DONE, EventStream, event, unless_disconnected
from openai_service.tools import ToolStream, tool_calls
from services.deltas import merge_by_choice
from services.healthcheck import PID_METADATA_KEY
from services.procs import serving_pid
from services.proto import generation_pb2
from services.refusals import Refusals

log = logging.getLogger(__name__)

#: The status logged (never sent: nobody is left) for a request whose client disconnected.
CLIENT_CLOSED = 499


def _json(model) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _error(err: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers={**(err.headers or {}), **(headers or {})})


def _ignored(body) -> None:
    extra = sorted(body.model_extra or ())
    if extra:
        log.warning("request fields ignored", extra={"fields": extra})


class _Call:
    """One ``Generate`` call read message by message (``grpc.aio``'s ``read()``), with gRPC
    errors raised as :class:`OpenAIError` (``fields``: the request's names for the fields the
    runner's sentences are about, see :func:`from_rpc_error`)."""

    def __init__(self, client: RouterClient, request: generation_pb2.GenerateRequest,
                 fields: dict[str, str]) -> None:
        self.call = client.generate(request)
        self.fields = fields

    async def next(self) -> generation_pb2.GenerateResponse | None:
        """The next message, ``None`` at the end of the stream."""
        try:
            msg = await self.call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.fields) from e
        return None if msg is grpc.aio.EOF else msg

    async def batches(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The messages from here to the end, each merged with those of its choice that arrived
        while the consumer was busy with the one before (:func:`~services.deltas.merge_by_choice`): a
        task reads the call as fast as the router sends, the consumer takes everything read so
        far whenever it asks, waiting only when nothing is. An error is raised after the
        messages read before it."""
        buffer: deque[generation_pb2.GenerateResponse] = deque()
        arrived = asyncio.Event()
        ended: list[BaseException | None] = []  # [None] at the end of the stream, [error]

        async def read() -> None:
            try:
                while (msg := await self.next()) is not None:
                    buffer.append(msg)
                    arrived.set()
                ended.append(None)
            except (Exception, asyncio.CancelledError) as e:
                ended.append(e)
            arrived.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                if buffer:
                    msgs = list(buffer)
                    buffer.clear()
                    for msg in merge_by_choice(msgs):
                        yield msg
                elif ended:
                    if ended[0] is not None:
                        raise ended[0]
                    return
                else:
                    arrived.clear()
                    await arrived.wait()
        finally:
            reader.cancel()

    async def all(self) -> list[generation_pb2.GenerateResponse]:
        """Every message to the end of the stream."""
        out = []
        try:
            while (msg := await self.next()) is not None:
                out.append(msg)
        finally:
            self.call.cancel()  # no-op once finished; stops the request when this task is cancelled
        return out

    def cancel(self) -> None:
        """Stop the request (the router cancels the runner's call, freeing its KV blocks)."""
        self.call.cancel()


def _choices(messages: list[generation_pb2.GenerateResponse],
             n: int) -> list[tuple[list[generation_pb2.GenerateResponse], generation_pb2.GenerateResponse]]:
    """A whole stream's messages choice by choice: ``(its messages, its final message)`` for
    choices 0..n-1. Raises :class:`OpenAIError` (502) when a choice has no final message, or a
    message names a choice outside ``[0, n)``."""
    by_index: list[list[generation_pb2.GenerateResponse]] = [[] for _ in range(n)]
    for m in messages:
        if m.index >= n:
            raise OpenAIError(502, f"the router's stream has a message of choice {m.index} (n={n})")
        by_index[m.index].append(m)
    if not all(msgs and msgs[-1].finish_reason for msgs in by_index):
        raise OpenAIError(502, "the router's stream ended without a final message for every choice")
    return [(msgs, msgs[-1]) for msgs in by_index]


#: Stands for a chunk's text in :func:`_text_event`'s template (ASCII: JSON leaves it as it is).
_TEXT_MARK = "@@warmserve-chunk-text@@"


def _text_event(render: Callable[[str], str]) -> Callable[[str], str] | None:
    """The server-sent event of a chunk with text only, without building it each time:
    ``render(text)`` is the chunk's JSON (pydantic's), rendered once with a mark for the text;
    the returned function puts a text's JSON string in its place, the same bytes as ``render``'s
    (UTF-8 left as it is, the same escapes). ``None`` when the mark is not there exactly once."""
    head, *tail = render(_TEXT_MARK).split(json.dumps(_TEXT_MARK))
    if len(tail) != 1:
        return None
    prefix, suffix = "data: " + head, tail[0] + "\n\n"
    return lambda text: prefix + json.dumps(text, ensure_ascii=False) + suffix


async def _events(call: _Call, first: generation_pb2.GenerateResponse, *, chunk: Callable[..., BaseModel],
                  choice: Callable[[generation_pb2.GenerateResponse, str | None], BaseModel], include_usage: bool,
                  n: int = 1, opening: Callable[[int], BaseModel] | None = None,
                  plain: bool = True) -> AsyncIterator[str]:
    """A stream's server-sent events, from its ``first`` message on: for each of the ``n``
    choices the ``opening(index)`` choice's chunk when given, one chunk per message with text,
    logprobs or a finish reason (``chunk([choice(msg, reason)])``, the choice of the message's
    ``index``; the messages of a choice that arrived while the last chunk was being sent as one,
    see :meth:`_Call.batches`), the usage chunk when ``include_usage`` (the prompt's tokens once,
    the completion tokens of every choice), an error event for an :class:`OpenAIError` raised
    meanwhile, then ``[DONE]``. ``plain``: the request asked for no logprobs, so a chunk with
    text only is the same but for its text (:func:`_text_event`, one template per choice)."""
    skip = None if include_usage else {"usage"}
    templates: dict[int, Callable[[str], str] | None] = {}

    def text_event(index: int) -> Callable[[str], str] | None:
        if index not in templates:
            templates[index] = _text_event(lambda text: chunk([choice(generation_pb2.GenerateResponse(
                text=text, index=index), None)]).model_dump_json(exclude=skip))
        return templates[index]

    finals: list[generation_pb2.GenerateResponse] = []
    # The first message is sent alone, at once; the rest as they come.
    messages = None if first.finish_reason and n == 1 else call.batches()
    msg: generation_pb2.GenerateResponse | None = first
    try:
        if opening is not None:
            for index in range(n):
                yield event(chunk([opening(index)]).model_dump_json(exclude=skip))
        while msg is not None:
            reason = finish_reason(msg)
            fast = text_event(msg.index) if plain and not reason and not msg.logprobs else None
            if fast is not None:
                if msg.text:
                    yield fast(msg.text)
            elif msg.text or msg.logprobs or reason:
                yield event(chunk([choice(msg, reason)]).model_dump_json(exclude=skip))
            if reason:
                finals.append(msg)
            msg = None if messages is None else await anext(messages, None)
        if len(finals) != n:
            raise OpenAIError(502, "the router's stream ended without a final message for every choice")
        if include_usage:
            yield event(chunk([], usage=usage(*finals)).model_dump_json())
    except OpenAIError as e:
        yield event(e.body())
    finally:
        if messages is not None:
            await messages.aclose()  # stops its reader task
    yield DONE


def create_app(config: OpenAIConfig) -> FastAPI:
    """The application for ``config`` (see the module docstring). Its lifespan opens the async
    channel to ``config.router`` and closes it; nothing is dialled before the first request."""
    client = RouterClient(config.router, config.router_security)
    served = ServedModel(client, config.served_model_name, ttl_s=config.model_info_ttl_s)
    pid_header = {PID_METADATA_KEY: str(serving_pid())}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await client.open()
        try:
            yield
        finally:
            await client.close()

    docs = config.enable_docs
    app = FastAPI(title="warmserve OpenAI-compatible API", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.openapi = lambda: openapi_schema(app, api_key=config.api_key is not None)  # type: ignore[method-assign]
    refusals = Refusals()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(refusals)
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       allowed_hosts=config.allowed_hosts, refusals=refusals,
                       open_paths=OPEN_PATHS + (DOCS_PATHS if docs else ()))
    app.state.refusals = refusals
    app.state.client = client
    app.state.served = served
    v1_errors = error_responses(V1_STATUSES)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        refusals.count(exc)
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = from_validation_error(list(exc.errors()), request.headers.get("content-type"))
        refusals.count(err)
        return _error(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {(exc.headers or {}).get('Allow')})"
        return _error(OpenAIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")  # the exception's text stays here, never in the answer
        return _error(OpenAIError(500, "internal error in the OpenAI door (see its log)"))

    @app.get("/health", responses={**ok_response(Health, headers={PID_METADATA_KEY: {"schema": {"type": "string"}}}),
                                   **error_responses(HEALTH_STATUSES)})
    async def health() -> Response:
        try:
            info = await client.model_info(timeout_s=5.0)
        except OpenAIError as e:
            return _error(OpenAIError(503, e.message), headers=pid_header)
        return JSONResponse({"status": "ok", "runner_id": info.runner_id}, headers=pid_header)

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text exposition", "content": {CONTENT_TYPE_LATEST: {
                 "schema": {"type": "string"}}}}, **error_responses((400, 413))})
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def _card() -> ModelCard:
        info = await served.info()
        return ModelCard(id=await served.name(), created=served.created, root=info.model,
                         max_model_len=info.max_model_len or None)

    @app.get("/v1/models", responses={**ok_response(ModelList), **v1_errors})
    async def list_models() -> Response:
        return _json(ModelList(data=[await _card()]))

    @app.get("/v1/models/{model:path}", responses={**ok_response(ModelCard), **v1_errors})
    async def retrieve_model(model: str) -> Response:
        await served.check(model)
        return _json(await _card())

    async def _first(request: Request, call: _Call) -> generation_pb2.GenerateResponse | None:
        """The stream's first message, awaited before any HTTP status is sent; ``None`` when the
        client left meanwhile (the call is cancelled then)."""
        try:
            first = await unless_disconnected(request, call.next())
        except BaseException:
            call.cancel()
            raise
        if first is None:
            call.cancel()
        return first

    @app.post("/v1/completions", responses={**ok_response(Completion, chunk=Completion), **v1_errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _ignored(body)
        model = await served.check(body.model)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        call = _Call(client, completion_to_proto(body, rid), {"prompt": "prompt", "max_tokens": "max_tokens",
                                                              "structured": structured_param(body)})
        top_n = body.logprobs

        def chunk(choices, **kw) -> Completion:
            return Completion(id=rid, created=created, model=model, choices=choices, **kw)

        if not body.stream:
            messages = await unless_disconnected(request, call.all())
            if messages is None:
                return Response(status_code=CLIENT_CLOSED)
            choices, finals = [], []
            for index, (msgs, final) in enumerate(_choices(messages, body.n)):
                logprobs = None
                if top_n is not None:
                    logprobs, builder = CompletionLogprobs(), CompletionLogprobsBuilder(top_n)
                    for m in msgs:
                        builder.add(m.logprobs, logprobs)
                choices.append(CompletionChoice(index=index, text="".join(m.text for m in msgs), logprobs=logprobs,
                                                finish_reason=finish_reason(final)))
                finals.append(final)
            return _json(chunk(choices, usage=usage(*finals)))

        first = await _first(request, call)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        builders = {i: CompletionLogprobsBuilder(top_n) for i in range(body.n)} if top_n is not None else None

        def stream_choice(msg: generation_pb2.GenerateResponse, reason: str | None) -> CompletionChoice:
            logprobs = builders[msg.index].add(msg.logprobs) if builders is not None else None
            return CompletionChoice(index=msg.index, text=msg.text, logprobs=logprobs, finish_reason=reason)

        events = _events(call, first, chunk=chunk, choice=stream_choice, include_usage=include_usage, n=body.n,
                         plain=builders is None)
        return EventStream(events, on_close=call.cancel)

    @app.post("/v1/chat/completions", responses={**ok_response(ChatCompletion, chunk=ChatCompletionChunk), **v1_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _ignored(body)
        model = await served.check(body.model)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        _, tool_plan = chat_tools(body)
        call = _Call(client, chat_to_proto(body, rid), {
            "prompt": "messages",
            "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            "structured": structured_param(body) or ("tools" if tool_plan.constrained else None)})
        top_n = (body.top_logprobs or 0) if body.logprobs else None

        def answer(msgs, final) -> ChatChoice:
            content, calls = tool_calls(tool_plan, "".join(m.text for m in msgs))
            reason = finish_reason(final)
            if calls and tool_plan.mode != "named" and reason == "stop":
                reason = "tool_calls"
            return ChatChoice(index=final.index, message=AssistantMessage(content=content, tool_calls=calls or None),
                              logprobs=logprobs_of(msgs), finish_reason=reason)

        def logprobs_of(msgs) -> ChatLogprobs | None:
            if top_n is None:
                return None
            return ChatLogprobs(content=[entry for m in msgs for entry in chat_logprobs(m.logprobs, top_n)])

        if not body.stream:
            messages = await unless_disconnected(request, call.all())
            if messages is None:
                return Response(status_code=CLIENT_CLOSED)
            choices = _choices(messages, body.n)
            return _json(ChatCompletion(id=rid, created=created, model=model, choices=[
                answer(msgs, final) for msgs, final in choices], usage=usage(*(final for _, final in choices))))

        first = await _first(request, call)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices, **kw) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **kw)

        splitters = [ToolStream(tool_plan) for _ in range(body.n)]

        def stream_choice(msg: generation_pb2.GenerateResponse, reason: str | None) -> ChatChunkChoice:
            if tool_plan.mode == "none":
                return ChatChunkChoice(index=msg.index, delta=DeltaMessage(content=msg.text),
                                       logprobs=logprobs_of([msg]), finish_reason=reason)
            splitter = splitters[msg.index]
            content, calls = splitter.feed(msg.text, final=reason is not None)
            if splitter.called and tool_plan.mode != "named" and reason == "stop":
                reason = "tool_calls"
            return ChatChunkChoice(index=msg.index, delta=DeltaMessage(content=content or None, tool_calls=calls or None),
                                   logprobs=logprobs_of([msg]), finish_reason=reason)

        events = _events(call, first, chunk=chunk, choice=stream_choice, include_usage=include_usage, n=body.n,
                         opening=lambda index: ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                               content="")),
                         plain=top_n is None and tool_plan.mode == "none")
        return EventStream(events, on_close=call.cancel)

    return app
