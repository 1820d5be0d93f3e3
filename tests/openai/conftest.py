"""A runner, a router and an OpenAI door in this process on loopback, over a tiny random Llama
checkpoint with a word-level tokenizer (token ``i`` is the word ``w{i}``, and the chat template
concatenates the messages' contents), for the tests of the OpenAI-compatible HTTP API.
``special_door`` is the same stack over a checkpoint whose tokenizer also has special tokens
(:func:`write_special_word_tokenizer`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
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


#: The special tokens of :func:`write_special_word_tokenizer`, and their ids.
SPECIAL_TOKENS = {"<|im_start|>": VOCAB - 3, "<|im_end|>": VOCAB - 2}


def write_special_word_tokenizer(directory: Path) -> None:
    """A word-level ``tokenizer.json`` whose last ids (inside the model's ``VOCAB``) are the
    special tokens :data:`SPECIAL_TOKENS` and ``[UNK]``, so a prompt is valid however its
    special-token text is tokenized: ``w0``..``w92`` are words, ``<|im_start|>`` one control id,
    and the same text taken plainly the three ``[UNK]`` pieces ``<|``, ``im_start``, ``|>``."""
    vocab_map = {f"w{i}": i for i in range(VOCAB - 3)} | SPECIAL_TOKENS | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "w1"}, "eos_token": "w2",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))


@contextmanager
def stack(tmp: Path, ckpt: Path, sidecar: Path | None = None, kv_cache_bytes: int = 4 << 20) -> Iterator[Door]:
    """Runner, router and door over the checkpoint in ``ckpt`` (or its ``sidecar``, already prepared)."""
    sidecar = sidecar or prepare(str(ckpt), root=tmp / "sidecars").path
    engine = LLMEngine.from_sidecar(sidecar, EngineConfig(max_num_seqs=4, block_size=4, max_model_len=MAX_MODEL_LEN,
                                                          kv_cache_bytes=kv_cache_bytes, warmup=False, num_threads=1),
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


@pytest.fixture(scope="package")
def door(tmp_path_factory) -> Iterator[Door]:
    tmp: Path = tmp_path_factory.mktemp("openai-stack")
    ckpt = tmp / "tiny-llama"
    write_tiny_checkpoint(ckpt, tokenizer=True, vocab=VOCAB, extra_config={"max_position_embeddings": MAX_MODEL_LEN})
    with stack(tmp, ckpt) as d:
        yield d


@pytest.fixture(scope="package")
def special_door(tmp_path_factory) -> Iterator[Door]:
    """The stack over a checkpoint whose tokenizer has :data:`SPECIAL_TOKENS`."""
    tmp: Path = tmp_path_factory.mktemp("openai-special-stack")
    ckpt = tmp / "tiny-llama-special"
    write_tiny_checkpoint(ckpt, vocab=VOCAB, extra_config={"max_position_embeddings": MAX_MODEL_LEN})
    write_special_word_tokenizer(ckpt)
    with stack(tmp, ckpt) as d:
        yield d


@pytest.fixture(scope="package")
def smollm2_door(tmp_path_factory, smollm2_sidecar) -> Iterator[Door]:
    """The stack over the real SmolLM2 (its float32 sidecar; 64 MiB of KV cache, ~1400 tokens)."""
    with stack(tmp_path_factory.mktemp("openai-smollm2-stack"), smollm2_sidecar, smollm2_sidecar,
               kv_cache_bytes=64 << 20) as d:
        yield d
