"""An in-process fake of a runner's Generation service, for router tests.

The token stream is a function of the prompt alone, so the expected output is known from first
principles: for a text prompt the tokens are the prompt's characters' code points (``ord``), one
per message, ``max_tokens`` of them at most (default 8), then a final message with
``finish_reason=LENGTH`` (or ``STOP`` when the prompt ran out) and usage. Token-id prompts are
echoed the same way. Behaviour knobs: per-token delay, failing before the first token or after
N tokens with UNAVAILABLE, answering Overloaded (busy, as a runner whose stream slots are all held),
a gate that holds streams, big padded messages, and NOT_SERVING health.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from services.bootstrap import ServerConfig, ServiceServer
from services.errors import Overloaded, abort_with
from services.proto import generation_pb2, generation_pb2_grpc


def expected_ids(request: generation_pb2.GenerateRequest) -> list[int]:
    """The token ids the fake streams for ``request``."""
    n = request.sampling.max_tokens or 8
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return [ord(c) for c in request.text][:n]
    if kind == "token_ids":
        return list(request.token_ids.ids)[:n]
    return [ord(c) for m in request.chat.messages for c in m.content][:n]


@dataclass
class FakeBehaviour:
    delay_s: float = 0.0               # sleep before each token
    fail_before_first: bool = False    # abort UNAVAILABLE before any token
    fail_after: int | None = None      # abort UNAVAILABLE after this many tokens
    pad_bytes: int = 0                 # extra text per message (backpressure tests)
    gate: threading.Event | None = None  # when set, each token waits for the gate
    invalid: bool = False              # answer INVALID_ARGUMENT
    overloaded: bool = False           # answer Overloaded (UNAVAILABLE marked busy)


@dataclass
class FakeStats:
    requests: int = 0
    produced: int = 0                   # messages handed to gRPC
    cancelled: int = 0                  # streams ended by cancellation
    active: int = 0
    deadlines: list = field(default_factory=list)  # time_remaining() seen per request (s)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, runner_id: str, behaviour: FakeBehaviour, stats: FakeStats, model: str = "fake") -> None:
        self.runner_id = runner_id
        self.model = model
        self.behaviour = behaviour
        self.stats = stats
        self._lock = threading.Lock()

    def Generate(self, request, context):
        b = self.behaviour
        with self._lock:
            self.stats.requests += 1
            self.stats.active += 1
            self.stats.deadlines.append(context.time_remaining())
        finished = False
        aborted = False
        try:
            if b.invalid:
                aborted = True
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the fake refuses this prompt")
            if b.overloaded:
                aborted = True
                abort_with(context, Overloaded(f"{self.runner_id} is serving its maximum of streams"))
            if b.fail_before_first:
                aborted = True
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.runner_id} is going away")
            ids = expected_ids(request)
            for i, tok in enumerate(ids):
                if b.fail_after is not None and i >= b.fail_after:
                    aborted = True
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.runner_id} crashed")
                if b.gate is not None:
                    while not b.gate.wait(0.05):
                        if not context.is_active():
                            return
                if b.delay_s:
                    time.sleep(b.delay_s)
                if not context.is_active():
                    return
                with self._lock:
                    self.stats.produced += 1
                yield generation_pb2.GenerateResponse(
                    request_id=request.request_id or "r", token_ids=[tok],
                    text=chr(tok) + "." * b.pad_bytes, runner_id=self.runner_id)
            n = request.sampling.max_tokens or 8
            reason = generation_pb2.FINISH_REASON_LENGTH if len(ids) == n else generation_pb2.FINISH_REASON_STOP
            finished = True
            yield generation_pb2.GenerateResponse(
                request_id=request.request_id or "r", finish_reason=reason, runner_id=self.runner_id,
                usage=generation_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)))
        finally:
            with self._lock:
                self.stats.active -= 1
                if not finished and not aborted:
                    self.stats.cancelled += 1

    def ModelInfo(self, request, context):
        return generation_pb2.ModelInfoResponse(runner_id=self.runner_id, model=self.model, family="fake",
                                                vocab_size=256, max_num_seqs=4)


class FakeRunner:
    """A fake runner served on 127.0.0.1 at a free port; ``stop()`` kills it at once."""

    def __init__(self, runner_id: str, behaviour: FakeBehaviour | None = None, port: int = 0, *,
                 model: str = "fake", server_config: ServerConfig | None = None) -> None:
        """``model``: what its ``ModelInfo`` names; ``server_config``: e.g. one with an auth table."""
        self.runner_id = runner_id
        self.behaviour = behaviour or FakeBehaviour()
        self.stats = FakeStats()
        self.servicer = FakeGeneration(runner_id, self.behaviour, self.stats, model)
        config = server_config or ServerConfig(service=runner_id, port=port, max_streams=128)
        self.server = ServiceServer(config, [
            (generation_pb2_grpc.add_GenerationServicer_to_server, self.servicer, "warmserve.v1.Generation")])
        self.port = self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        self.server.set_serving(serving)

    def stop(self) -> None:
        self.server.stop()
