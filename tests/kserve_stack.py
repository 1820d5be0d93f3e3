"""A router in front of one in-process runner of a tiny random Llama checkpoint with a word-level
tokenizer (token ``i`` is the word ``w{i}``), or the byte-level one of ``tests/structured_tiny.py``
that structured output's grammar engine reads, both on loopback, for the KServe v2 door's tests
and the clients' (test helper)."""

from __future__ import annotations

import time
from pathlib import Path

from structured_tiny import EOS_ID, write_byte_tokenizer
from weights_tiny import write_tiny_checkpoint

from kserve_service.door import router_server
from router_service.config import RouterConfig
from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine
from runner_service.servicer import GenerationServicer
from services.bootstrap import ServerConfig, ServiceServer
from services.generation_client import GENERATION_SERVICE, GenerationClient, sampling_params, text_request
from services.proto import generation_pb2_grpc
from services.stream_slots import StreamSlots
from weight_service.prepare import prepare

#: The checkpoint directory's name, so the default served model name.
MODEL_DIR = "tiny-llama"
#: The model's vocabulary with the byte-level tokenizer (which has 270 ids: the rest are padding).
BYTES_VOCAB = 320


class TinyStack:
    """``runner-0`` (eager, 4 sequences, 128-token context) as a static runner of a router on a
    free port; :attr:`address` is the router's. ``served_model_name`` goes to the router's
    config, ``runner_streams`` caps the runner's ``Generate`` streams. ``tokenizer``: ``"words"``
    (token ``i`` is ``w{i}``; structured output is refused, llguidance cannot read it) or
    ``"bytes"`` (:func:`structured_tiny.byte_tokenizer`, EOS ``<eos>``; prompts are any text).
    Call :meth:`close`."""

    def __init__(self, tmp: Path, *, served_model_name: str = "",
                 runner_streams: int = ServerConfig.max_streams, tokenizer: str = "words") -> None:
        self.ckpt = tmp / MODEL_DIR
        if tokenizer == "words":
            write_tiny_checkpoint(self.ckpt, tokenizer=True, vocab=96)
        elif tokenizer == "bytes":
            write_tiny_checkpoint(self.ckpt, vocab=BYTES_VOCAB, extra_config={"eos_token_id": EOS_ID,
                                                                              "bos_token_id": None})
            write_byte_tokenizer(self.ckpt)
        else:
            raise ValueError(f"tokenizer must be 'words' or 'bytes', got {tokenizer!r}")
        sidecar = prepare(str(self.ckpt), root=tmp / "sidecars").path
        config = EngineConfig(max_num_seqs=4, block_size=4, max_model_len=128, warmup=False)
        self.engine = LLMEngine.from_sidecar(sidecar, config, model=str(self.ckpt))
        self.engine.start()
        self.runner = ServiceServer(ServerConfig(service="runner"), [
            (generation_pb2_grpc.add_GenerationServicer_to_server,
             GenerationServicer(self.engine, "runner-0", StreamSlots(runner_streams, "runner runner-0")),
             GENERATION_SERVICE)])
        self.runner.start()
        self.server = router_server(
            RouterConfig(static_runners=(self.runner.address,), health_interval_s=0.1, health_timeout_s=1.0,
                         served_model_name=served_model_name),
            ServerConfig(service="router", port=0))
        self.server.start()
        if not self.server.router.wait_ready(1, 20):
            self.close()
            raise RuntimeError("the runner never became READY at the router")

    @property
    def address(self) -> str:
        """The router's ``host:port``."""
        return self.server.address

    def greedy(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        """The warmserve.v1 ``Generate`` path's greedy answer to ``prompt`` through the router
        (EOS ignored, special-token text recognised as Triton's vLLM backend does): ``(text,
        prompt tokens)``; the reference the KServe door must reproduce."""
        request = text_request(prompt, sampling_params(max_tokens=max_tokens, temperature=0.0),
                               allow_special_tokens=True)
        request.sampling.ignore_eos = True
        with GenerationClient(self.address) as client:
            result = client.complete(request, timeout_s=60)
        assert result.finish_reason == "LENGTH" and result.completion_tokens == max_tokens, result
        return result.text, result.prompt_tokens

    def slow_decode(self, seconds: float) -> None:
        """Make every decode step take at least ``seconds`` (for cancellation tests)."""
        runner = self.engine.runner

        def slow(*inputs):
            time.sleep(seconds)
            return runner.decode_step(*inputs)

        runner.decode = slow

    def fast_decode(self) -> None:
        """Undo :meth:`slow_decode`."""
        vars(self.engine.runner).pop("decode", None)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until the runner holds no sequence and no KV block; ``False`` on timeout."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            stats = self.engine.stats()
            if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.server.stop()
        self.runner.stop()
        self.engine.close()
