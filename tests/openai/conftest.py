"""A runner, a router and an OpenAI door in this process on loopback, over a tiny random Llama
checkpoint with a word-level tokenizer (token ``i`` is the word ``w{i}``, and the chat template
concatenates the messages' contents), for the tests of the OpenAI-compatible HTTP API."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from weights_tiny import write_tiny_checkpoint

from openai_service.config import OpenAIConfig
from openai_service.daemon import OpenAIServer
from router_service.config import RouterConfig
from router_service.servicer import RouterServer
from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine
from runner_service.servicer import GenerationServicer
from services.bootstrap import ServerConfig, ServiceServer
from services.generation_client import GENERATION_SERVICE
from services.proto import generation_pb2_grpc, router_pb2, router_pb2_grpc
from weight_service.prepare import prepare

#: The tiny model's context in tokens: long enough for a stream that outlives a disconnect.
MAX_MODEL_LEN = 1024
VOCAB = 96


@dataclass
class Door:
    """The door's base URL (``http://127.0.0.1:PORT/v1``), the router's address, the engine
    behind the runner, the model's source (the checkpoint directory) and its context length."""

    url: str
    router: str
    engine: LLMEngine
    model_source: str
    max_model_len: int
    server: OpenAIServer


@pytest.fixture(scope="package")
def door(tmp_path_factory) -> Iterator[Door]:
    tmp: Path = tmp_path_factory.mktemp("openai-stack")
    ckpt = tmp / "tiny-llama"
    write_tiny_checkpoint(ckpt, tokenizer=True, vocab=VOCAB, extra_config={"max_position_embeddings": MAX_MODEL_LEN})
    sidecar = prepare(str(ckpt), root=tmp / "sidecars").path
    engine = LLMEngine.from_sidecar(sidecar, EngineConfig(max_num_seqs=4, block_size=4, max_model_len=MAX_MODEL_LEN,
                                                          kv_cache_bytes=4 << 20, warmup=False, num_threads=1),
                                    model=str(ckpt))
    runner = router = http = None
    try:
        engine.start()
        runner = ServiceServer(ServerConfig(service="runner"), [
            (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, "runner-0"),
             GENERATION_SERVICE)])
        runner.start()
        router = RouterServer(RouterConfig(health_interval_s=0.2), ServerConfig(service="router", port=0))
        router.start()
        with grpc.insecure_channel(router.address) as channel:
            router_pb2_grpc.RouterControlStub(channel).RegisterRunner(router_pb2.RegisterRunnerRequest(
                runner_id="runner-0", address=runner.address, model=str(ckpt), max_num_seqs=4, lease_seconds=300),
                timeout=10)
        http = OpenAIServer(OpenAIConfig(router=router.address, port=0))
        http.start()
        yield Door(http.url, router.address, engine, str(ckpt), MAX_MODEL_LEN, http)
    finally:
        if http is not None:
            http.stop()
        if router is not None:
            router.stop()
        if runner is not None:
            runner.stop()
        engine.close()
