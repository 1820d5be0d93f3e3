"""The runner's Generation service over real gRPC on loopback (a tiny random model behind
SmolLM2's real tokenizer): streaming, ModelInfo, health, metrics, INVALID_ARGUMENT for bad
input while the runner keeps serving, RESOURCE_EXHAUSTED, client cancellation and deadlines
freeing the sequence's KV blocks."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from runner_tiny import kv_bytes, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.output_processor import RequestOutput, RequestStream
from runner_service.sampler import TokenLogprobs
from runner_service.sequence import FinishReason
from runner_service.servicer import GenerationServicer, RunnerCollector
from runner_service.tokenizer import Tokenizer
from services.bootstrap import ServerConfig, ServiceServer
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args(vocab=49152, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16, eos=(2,))
KV_BLOCKS = 30  # 29 usable blocks of 4 tokens = 116 tokens; the context is 128


@pytest.fixture(scope="module")
def served(smollm2_sidecar):
    tok = Tokenizer.from_dir(smollm2_sidecar)
    cfg = tiny_config(max_num_seqs=4, max_model_len=128, kv_cache_bytes=kv_bytes(ARGS, KV_BLOCKS), warmup=True)
    engine = LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=1), cfg, tok, model="tiny-random")
    engine.start()
    server = ServiceServer(ServerConfig(service="runner"), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, "r-test"),
         "warmserve.v1.Generation")])
    server.registry.register(RunnerCollector(engine))
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield generation_pb2_grpc.GenerationStub(channel), engine, server, channel
    finally:
        channel.close()
        server.stop()
        engine.close()


def _greedy(n, **kw):
    return pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_generate_streams_token_deltas_then_finish_and_usage(served):
    stub, engine, _, _ = served
    msgs = list(stub.Generate(pb.GenerateRequest(text="Hello there", sampling=_greedy(8, logprobs=2))))
    # A message carries the tokens produced since the last was sent: one each when the reader
    # keeps up, several when it fell behind.
    assert sum(len(m.token_ids) for m in msgs) == 8
    assert all(m.token_ids and m.runner_id == "r-test" for m in msgs)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    prompt_ids = engine.tokenizer.encode("Hello there")
    assert last.usage.prompt_tokens == len(prompt_ids) and last.usage.completion_tokens == 8
    ids = [t for m in msgs for t in m.token_ids]
    assert "".join(m.text for m in msgs) == engine.tokenizer.decode(ids)
    assert all([lp.token_id for lp in m.logprobs] == list(m.token_ids) and all(len(lp.top) == 2 for lp in m.logprobs)
               for m in msgs)
    # The same prompt as token ids, chat prompts, and a request id given by the client.
    again = list(stub.Generate(pb.GenerateRequest(request_id="mine", token_ids=pb.TokenIds(ids=prompt_ids),
                                                  sampling=_greedy(8))))
    assert [t for m in again for t in m.token_ids] == ids and again[0].request_id == "mine"
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")])
    out = list(stub.Generate(pb.GenerateRequest(chat=chat, sampling=_greedy(3))))
    assert out[-1].usage.prompt_tokens == len(engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))


def test_special_token_text_in_a_raw_prompt_is_plain_unless_allowed(served):
    """``<|im_end|>`` is one control id (2 in SmolLM2's vocabulary) only with ``allow_special_tokens``;
    otherwise its 10 characters are tokenized as text (several ids, none of them 2)."""
    stub, engine, _, _ = served
    plain = list(stub.Generate(pb.GenerateRequest(text="<|im_end|>", sampling=_greedy(1))))
    allowed = list(stub.Generate(pb.GenerateRequest(text="<|im_end|>", allow_special_tokens=True,
                                                    sampling=_greedy(1))))
    assert allowed[-1].usage.prompt_tokens == 1
    assert plain[-1].usage.prompt_tokens > 1
    assert 2 not in engine.tokenizer.encode("<|im_end|>")


def test_max_tokens_zero_means_the_default(served):
    stub, engine, _, _ = served
    msgs = list(stub.Generate(pb.GenerateRequest(text="a", sampling=pb.SamplingParams(ignore_eos=True))))
    assert msgs[-1].usage.completion_tokens == engine.config.default_max_tokens
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_default_max_tokens_stands_in_for_an_unset_max_tokens(served):
    stub, engine, _, _ = served

    def tokens(**sampling):
        msgs = list(stub.Generate(pb.GenerateRequest(
            text="a", sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True, **sampling))))
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        return msgs[-1].usage.completion_tokens

    assert tokens(default_max_tokens=5) == 5  # set: instead of the model's default
    assert tokens() == engine.sampling_defaults.max_tokens  # unset: the model's
    assert tokens(max_tokens=3, default_max_tokens=5) == 3  # max_tokens given wins
    assert tokens(max_tokens=0, default_max_tokens=5) == 5  # max_tokens 0 is unset
    # (capped to what the context leaves: tests/runner/test_runner_engine.py and tests/openai)
    for bad in (0, -4):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="a", sampling=pb.SamplingParams(default_max_tokens=bad))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (f"default_max_tokens must be >= 1 when set (leave it unset for the "
                                       f"engine's default), got {bad}")


BAD = {
    "empty text": pb.GenerateRequest(text="", sampling=_greedy(2)),
    "no prompt": pb.GenerateRequest(sampling=_greedy(2)),
    "empty token ids": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), sampling=_greedy(2)),
    "token id = vocab": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, ARGS.vocab_size]), sampling=_greedy(2)),
    "negative token id": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-3]), sampling=_greedy(2)),
    "prompt longer than the context": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 200), sampling=_greedy(2)),
    "max_tokens < 0": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=-1)),
    "default_max_tokens 0": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(default_max_tokens=0)),
    "max_tokens beyond the context": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 100),
                                                        sampling=pb.SamplingParams(max_tokens=100_000_000)),
    "temperature < 0": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-0.5)),
    "temperature NaN": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
    "top_p > 1": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5)),
    "top_p < 0": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=-0.1)),
    "top_k < 0": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-1)),
    "logprobs > 20": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logprobs=21)),
    "unknown chat role": pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="robot", content="x")])),
    "no chat messages": pb.GenerateRequest(chat=pb.ChatPrompt(messages=[])),
    "only empty chat messages": pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=" ")])),
    "unknown routing value": pb.GenerateRequest(text="hi", routing=99, sampling=_greedy(2)),
    "presence_penalty > 2": pb.GenerateRequest(text="hi", sampling=_greedy(2, presence_penalty=2.5)),
    "frequency_penalty NaN": pb.GenerateRequest(text="hi", sampling=_greedy(2, frequency_penalty=float("nan"))),
    "repetition_penalty 0": pb.GenerateRequest(text="hi", sampling=_greedy(2, repetition_penalty=0.0)),
    "logit_bias id = vocab": pb.GenerateRequest(text="hi", sampling=_greedy(2, logit_bias={ARGS.vocab_size: 1.0})),
    "logit_bias > 100": pb.GenerateRequest(text="hi", sampling=_greedy(2, logit_bias={5: 101.0})),
    "min_tokens > max_tokens": pb.GenerateRequest(text="hi", sampling=_greedy(2, min_tokens=3)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument_and_the_runner_keeps_serving(served, case):
    stub, engine, _, _ = served
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(BAD[case]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.value.details()) > 10
    ok = list(stub.Generate(pb.GenerateRequest(text="still here", sampling=_greedy(2))))
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert _wait_for(lambda: engine.block_manager.num_used_blocks == 0)


def test_penalties_logit_bias_and_min_tokens_reach_the_engine_from_the_wire(served):
    stub, engine, _, _ = served
    eos = ARGS.eos_token_ids[0]
    forced = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(
        max_tokens=6, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3, presence_penalty=0.5))))
    tokens = [t for m in forced for t in m.token_ids]
    assert tokens[3] == eos and eos not in tokens[:3] and forced[-1].finish_reason == pb.FINISH_REASON_STOP
    assert _wait_for(lambda: engine.penalties.num_free_slots == engine.config.max_num_seqs)


def test_a_request_that_can_never_fit_is_resource_exhausted(served):
    stub, _, _, _ = served
    # 100 prompt tokens + 20 new need ceil(119 / 4) = 30 blocks; the cache has 29.
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 100), sampling=_greedy(20))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _slow_decode(engine, seconds):
    runner = engine.runner

    def slow(*inputs):
        time.sleep(seconds)
        return runner.decode_step(*inputs)

    runner.decode = slow


def test_client_cancellation_frees_the_sequence_blocks(served):
    stub, engine, _, _ = served
    assert _wait_for(lambda: engine.block_manager.num_used_blocks == 0)
    baseline = engine.block_manager.num_free_blocks
    _slow_decode(engine, 0.02)
    try:
        call = stub.Generate(pb.GenerateRequest(text="count to a hundred", sampling=_greedy(100)))
        first = [next(call), next(call)]
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in first)
        assert engine.block_manager.num_free_blocks < baseline
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert _wait_for(lambda: engine.block_manager.num_free_blocks == baseline)
        assert _wait_for(lambda: engine.stats()["running"] == 0)
    finally:
        del engine.runner.decode


def test_deadline_frees_the_sequence_blocks(served):
    stub, engine, _, _ = served
    baseline = engine.block_manager.num_free_blocks
    _slow_decode(engine, 0.02)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="a long story", sampling=_greedy(100)), timeout=0.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _wait_for(lambda: engine.block_manager.num_free_blocks == baseline)
    finally:
        del engine.runner.decode


def test_model_info_health_and_metrics(served):
    stub, engine, server, channel = served
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.runner_id, info.model, info.family, info.dtype, info.device) == (
        "r-test", "tiny-random", "llama", "f32", "cpu")
    assert (info.vocab_size, info.max_model_len, info.block_size, info.num_kv_blocks, info.max_num_seqs) == (
        49152, 128, 4, KV_BLOCKS - 1, 4)
    assert info.compile_mode == "off"
    # the load as of the call: idle, every usable block free
    assert (info.running, info.waiting, info.kv_blocks_used, info.kv_blocks_usable) == (0, 0, 0, KV_BLOCKS - 1)
    assert [p.name for p in info.startup.phases] == ["kv_cache", "prepack", "programs", "warmup"]
    assert info.startup.total_seconds == pytest.approx(sum(p.seconds for p in info.startup.phases))
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="warmserve.v1.Generation")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    before = server.registry.get_sample_value("warmserve_runner_generated_tokens_total")
    list(stub.Generate(pb.GenerateRequest(text="metrics", sampling=_greedy(5))))
    reg = server.registry
    assert reg.get_sample_value("warmserve_runner_generated_tokens_total") == before + 5
    assert reg.get_sample_value("warmserve_runner_kv_blocks_total") == KV_BLOCKS - 1
    assert reg.get_sample_value("warmserve_runner_kv_blocks_used") == 0
    assert reg.get_sample_value("warmserve_runner_running_sequences") == 0
    assert reg.get_sample_value("warmserve_runner_waiting_sequences") == 0
    assert reg.get_sample_value("warmserve_runner_tokens_per_second") >= 0
    # prefix caching: the same prompt twice, the second finds its full blocks cached
    assert reg.get_sample_value("warmserve_runner_prefix_caching_enabled") == 1
    text = "Quartz metronomes tick beside violet harbours while seventeen ravens audit the lighthouse"
    n = len(engine.tokenizer.encode(text))
    queried = reg.get_sample_value("warmserve_runner_prefix_cache_queried_tokens_total")
    saved = reg.get_sample_value("warmserve_runner_prefix_cache_tokens_saved_total")
    for _ in range(2):
        list(stub.Generate(pb.GenerateRequest(text=text, sampling=_greedy(2))))
    assert reg.get_sample_value("warmserve_runner_prefix_cache_queried_tokens_total") == queried + 2 * n
    assert reg.get_sample_value("warmserve_runner_prefix_cache_tokens_saved_total") == saved + (n - 1) // 4 * 4
    rate = reg.get_sample_value("warmserve_runner_prefix_cache_hit_rate")
    assert rate == pytest.approx(engine.stats()["prefix_cache_hit_rate"]) and 0 < rate < 1
    assert reg.get_sample_value("warmserve_runner_prefix_cache_blocks") >= (n - 1) // 4


class _FedEngine:
    """Stands in for the engine: ``add_request`` hands out a stream the test feeds by hand."""

    def __init__(self) -> None:
        self.stream: RequestStream | None = None

    def add_request(self, params, *, request_id=None, **prompt):
        self.stream = RequestStream(request_id or "fed-0", 3, lambda _rid: None)
        return self.stream


class _Context:
    def add_callback(self, _fn) -> bool:
        return True


def _fed_deltas() -> list[RequestOutput]:
    """Four deltas of one request: three tokens, then the last with the finish reason and usage."""
    lp = [TokenLogprobs(10 + i, -0.25 * (i + 1), [(10 + i, -0.25 * (i + 1)), (99, -3.0)]) for i in range(4)]
    return [RequestOutput("fed-0", [10], "a", [lp[0]], None, 3, 1),
            RequestOutput("fed-0", [11], "", [lp[1]], None, 3, 2),   # text held back by the detokenizer
            RequestOutput("fed-0", [12], "bc", [lp[2]], None, 3, 3),
            RequestOutput("fed-0", [13], "d", [lp[3]], FinishReason.LENGTH, 3, 4)]


def _read(fast: bool) -> list[pb.GenerateResponse]:
    """The servicer's messages for :func:`_fed_deltas`: the first taken as soon as it is queued;
    then ``fast``, each delta read before the next is queued, else the reader falls behind while
    the other three are produced."""
    engine = _FedEngine()
    servicer = GenerationServicer(engine, "r-fed")  # type: ignore[arg-type]
    request = pb.GenerateRequest(text="x", sampling=_greedy(4, logprobs=1))
    deltas = _fed_deltas()
    # The generator calls add_request on its first next(); a thread queues the first delta then.
    def feed_first() -> None:
        while engine.stream is None:
            time.sleep(0.001)
        engine.stream.queue.put(deltas[0])

    feeder = threading.Thread(target=feed_first)
    feeder.start()
    messages = servicer.Generate(request, _Context())
    out = [next(messages)]
    feeder.join()
    assert engine.stream.queue.empty()  # the first token went out before the second existed
    if fast:
        for d in deltas[1:]:
            engine.stream.queue.put(d)
            out.append(next(messages))
    else:
        for d in deltas[1:]:
            engine.stream.queue.put(d)
        out.append(next(messages))
    assert next(messages, None) is None
    return out


def test_a_reader_that_falls_behind_gets_the_tokens_in_one_message_with_the_same_content():
    fast, slow = _read(fast=True), _read(fast=False)
    assert [list(m.token_ids) for m in fast] == [[10], [11], [12], [13]]
    assert [list(m.token_ids) for m in slow] == [[10], [11, 12, 13]]
    assert slow[0] == fast[0]  # the first token alone, unchanged
    for msgs in (fast, slow):
        assert "".join(m.text for m in msgs) == "abcd"
        assert [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                for m in msgs for lp in m.logprobs] == [
            (10 + i, -0.25 * (i + 1), [(10 + i, -0.25 * (i + 1)), (99, -3.0)]) for i in range(4)]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
        assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (3, 4)
        assert all(not m.HasField("usage") for m in msgs[:-1])
        assert {m.runner_id for m in msgs} == {"r-fed"} and {m.request_id for m in msgs} == {"fed-0"}
