"""Fuzzing a runner's ``warmserve.v1.Generation`` (``Generate``, ``ModelInfo``) over real gRPC
on loopback, on a tiny random Llama behind a word-level tokenizer: random and adversarial
prompts, token ids, sampling values and enum values, streams cancelled after their first token,
messages over the size limit. Each answer is a documented status, the runner keeps serving, and
its KV blocks in use return to their starting count (no sequence left behind)."""

from __future__ import annotations

import pytest
from fuzz_harness import (
    C,
    Case,
    assert_serving,
    batches,
    cases,
    check_status,
    fuzz_channel,
    fuzz_settings,
    run_case,
    wait_until,
)
from generation_hints import GENERATION_HINTS
from hypothesis import given
from proto_fuzz import field_bytes
from runner_tiny import kv_bytes, tiny_args, tiny_config
from weights_tiny import write_word_tokenizer

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.servicer import GenerationServicer
from runner_service.tokenizer import Tokenizer
from services.bootstrap import ServerConfig, ServiceServer
from services.generation_client import GENERATION_SERVICE
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
ARGS = tiny_args(vocab=128, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16, max_pos=64, eos=(2,))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("runner-fuzz-tokenizer")
    write_word_tokenizer(tok_dir, 127)  # 127 words and [UNK]: 128 ids, the model's vocabulary
    cfg = tiny_config(max_num_seqs=4, max_model_len=64, kv_cache_bytes=kv_bytes(ARGS, 24))
    engine = LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=1), cfg, Tokenizer.from_dir(tok_dir), model="tiny-fuzz")
    engine.start()
    server = ServiceServer(ServerConfig(service="runner-fuzz", max_streams=64), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, "r-fuzz"),
         GENERATION_SERVICE)])
    server.start()
    channel = fuzz_channel(server.address)
    try:
        yield channel, engine
    finally:
        channel.close()
        server.stop()
        engine.close()


def idle(engine: LLMEngine, blocks_used: int) -> bool:
    """No sequence running or waiting, ``blocks_used`` KV blocks in use, every penalty slot free."""
    s = engine.stats()
    return (s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == blocks_used
            and engine.penalties.num_free_slots == engine.config.max_num_seqs)


@given(batch=batches(cases(SERVICE, GENERATION_HINTS)))
@fuzz_settings(2000)
def test_every_runner_rpc_answers_a_documented_status_and_frees_its_kv_blocks(runner, batch):
    channel, engine = runner
    for case in batch:
        start = engine.stats()["kv_blocks_used"]
        code, _, cancelled = run_case(channel, case)
        check_status("warmserve.v1.Generation@runner", case, code, cancelled)
        assert_serving(channel, GENERATION_SERVICE)
        assert wait_until(lambda start=start: idle(engine, start)), f"{case!r} left {engine.stats()}"


def test_a_message_over_the_size_limit_is_resource_exhausted(runner):
    channel, engine = runner
    big = field_bytes(2, "w1 " * (6 << 20))  # an 18 MiB prompt
    code, _, cancelled = run_case(channel, Case(SERVICE.methods_by_name["Generate"], (big,)))
    assert code == C.RESOURCE_EXHAUSTED and not cancelled
    assert_serving(channel, GENERATION_SERVICE)
    assert idle(engine, 0)
