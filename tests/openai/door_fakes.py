"""A fake router for tests of the OpenAI door's own surface (guards, schema, TLS): a
``Generation`` service in this process that answers every ``Generate`` with two tokens
(``"ok"``, with logprobs when asked) and a final LENGTH message for each of its ``n`` choices
(interleaved, each message naming its choice), or, with ``overloaded`` set,
with the router's capacity signal (UNAVAILABLE + ``warmserve-overloaded: 1``), or, with
``crash`` set, with an exception (gRPC's UNKNOWN, whose details carry the exception's text)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from services.bootstrap import ServerConfig, ServiceServer
from services.errors import OVERLOADED_METADATA
from services.generation_client import GENERATION_SERVICE
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc
from services.tls import TLSFiles

FAKE_MODEL = "fake-model"


class FakeRouterGeneration(generation_pb2_grpc.GenerationServicer):
    """The fake's servicer; ``calls`` counts ``Generate`` calls."""

    def __init__(self) -> None:
        self.overloaded = False
        self.crash: str | None = None  # raise RuntimeError(crash): gRPC answers UNKNOWN with its text
        self.calls = 0
        self.authorization: str | None = None  # the last call's authorization metadata

    def Generate(self, request, context):
        self.calls += 1
        self.authorization = dict(context.invocation_metadata()).get("authorization")
        if self.crash is not None:
            raise RuntimeError(self.crash)
        if self.overloaded:
            context.set_trailing_metadata((OVERLOADED_METADATA,))
            context.abort(grpc.StatusCode.UNAVAILABLE, "every runner is busy: 4 of 4 streams in use")
        n = request.sampling.logprobs
        choices = range(request.sampling.n or 1)
        for token_id, text in ((5, "o"), (6, "k")):
            logprobs = [pb.TokenLogprob(token_id=token_id, token=text, logprob=-0.5,
                                        top=[pb.TopLogprob(token_id=token_id, token=text, logprob=-0.5)] * n)] if n else []
            for index in choices:
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[token_id], text=text,
                                          logprobs=logprobs, runner_id="fake-0", index=index)
        for index in choices:
            yield pb.GenerateResponse(request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH,
                                      runner_id="fake-0", usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
                                      index=index)

    def ModelInfo(self, request, context):
        return pb.ModelInfoResponse(runner_id="fake-0", model=FAKE_MODEL, family="fake", vocab_size=256,
                                    max_num_seqs=4, max_model_len=64)


@contextmanager
def fake_router(port: int = 0, tls: TLSFiles | None = None) -> Iterator[tuple[str, FakeRouterGeneration]]:
    """``(address, servicer)`` of a fake router on loopback ``port`` (0: a free one), serving
    TLS with ``tls`` (mTLS when it has a CA)."""
    servicer = FakeRouterGeneration()
    server = ServiceServer(ServerConfig(service="fake-router", port=port, tls=tls), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, servicer, GENERATION_SERVICE)])
    server.start()
    try:
        yield server.address, servicer
    finally:
        server.stop()
