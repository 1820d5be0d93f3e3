"""The runner's request limits over real gRPC (a tiny random model behind a word-level tokenizer,
tests/weights_tiny.py): a prompt over ``--max-prompt-bytes`` is refused before the tokenizer sees
it, stop strings and stop ids are bounded, invalid Unicode is INVALID_ARGUMENT with a sentence,
a runner at its stream cap answers Overloaded, each refusal is counted, and tokenizing does not
hold the GIL."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from runner_tiny import tiny_args, tiny_config
from weights_tiny import write_word_tokenizer

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from runner_service.servicer import GenerationServicer
from runner_service.tokenizer import Tokenizer
from services.bootstrap import ServerConfig, ServiceServer
from services.errors import InvalidArgument, is_overloaded
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc
from services.stream_slots import StreamSlots

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args(vocab=128, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16, eos=(2,))


class SpyTokenizer(Tokenizer):
    """The word-level tokenizer, counting the prompts it is asked to tokenize."""

    calls = 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        return super().encode(*args, **kwargs)

    def encode_chat(self, *args, **kwargs):
        self.calls += 1
        return super().encode_chat(*args, **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("tok")
    write_word_tokenizer(tok_dir, 96)
    tok = SpyTokenizer.from_dir(tok_dir)
    engine = LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=1), tiny_config(max_num_seqs=4, max_model_len=128),
                       tok, model="tiny-random")
    engine.start()
    servicer = GenerationServicer(engine, "r-limits", StreamSlots(2, "runner r-limits"))
    server = ServiceServer(ServerConfig(service="runner"), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, servicer, "warmserve.v1.Generation")],
        servicer.refusals)
    server.start()
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 16 << 20)])
    try:
        yield generation_pb2_grpc.GenerationStub(channel), engine, server, channel
    finally:
        channel.close()
        server.stop()
        engine.close()


def _refused(server: ServiceServer, reason: str) -> float:
    return server.registry.get_sample_value("warmserve_refused_total", {"reason": reason}) or 0.0


def _refusal(stub, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=30))
    return err.value


def _greedy(n: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _still_serves(stub) -> None:
    msgs = list(stub.Generate(pb.GenerateRequest(text="w5 w6", sampling=_greedy(3)), timeout=30))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_4_mb_prompt_is_refused_before_the_tokenizer_sees_it(served) -> None:
    stub, engine, server, _ = served
    calls, before = engine.tokenizer.calls, _refused(server, "prompt_bytes")
    huge = "w5 " * ((4 << 20) // 3)
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="w7 " * 200_000)] * 2)
    for request in (pb.GenerateRequest(text=huge, sampling=_greedy(4)),
                    pb.GenerateRequest(chat=chat, sampling=_greedy(4))):
        err = _refusal(stub, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bytes of UTF-8" in err.details() and "at most 1048576 (--max-prompt-bytes)" in err.details()
    assert engine.tokenizer.calls == calls  # never tokenized
    assert _refused(server, "prompt_bytes") == before + 2
    _still_serves(stub)


def test_the_prompt_limit_is_a_runner_flag() -> None:
    from runner_service.options import MAX_PROMPT_BYTES

    assert MAX_PROMPT_BYTES.flag == "--max-prompt-bytes" and MAX_PROMPT_BYTES.default == 1 << 20
    with pytest.raises(InvalidArgument, match="max_prompt_bytes"):
        tiny_config(max_prompt_bytes=0)


@pytest.mark.parametrize(("sampling", "says", "reason"), [
    (dict(stop=[f"w{i} w{i + 1}" for i in range(100_000)]), "stop has 100000 strings; at most 16", "stop_strings"),
    (dict(stop=[f"s{i}" for i in range(17)]), "at most 16", "stop_strings"),
    (dict(stop=["é" * 129]), "stop string 0 is 258 bytes of UTF-8; at most 256", "stop_strings"),
    (dict(stop_token_ids=list(range(65))), "stop_token_ids has 65 ids; at most 64", "stop_token_ids"),
], ids=["100000-stops", "17-stops", "long-stop", "65-stop-ids"])
def test_stop_strings_and_ids_are_bounded(served, sampling, says, reason) -> None:
    stub, _, server, _ = served
    before = _refused(server, reason)
    err = _refusal(stub, pb.GenerateRequest(text="w5 w6", sampling=_greedy(4, **sampling)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details()
    assert _refused(server, reason) == before + 1


def test_the_most_stops_allowed_still_generate(served) -> None:
    stub, _, _, _ = served
    sampling = _greedy(4, stop=[f"{i:02d}" + "x" * 254 for i in range(16)], stop_token_ids=list(range(60, 124)))
    msgs = list(stub.Generate(pb.GenerateRequest(text="w5 w6", sampling=sampling), timeout=30))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def _raw_generate(channel, payload: bytes):
    call = channel.unary_stream("/warmserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        list(call(payload, timeout=10))
    return err.value


def test_bad_utf8_on_the_wire_is_invalid_argument_with_a_sentence(served) -> None:
    stub, _, server, channel = served
    before = _refused(server, "unicode")
    surrogate = b"\xed\xa0\x80"  # U+D800 written as UTF-8 (CESU), which is not valid UTF-8
    text_field = b"\x12" + bytes([len(surrogate)]) + surrogate                 # GenerateRequest.text
    stop_field = b"\x2a\x05" + b"\x32\x03" + surrogate                          # sampling { stop }
    for payload in (text_field, b"\x12\x02w5" + stop_field):
        err = _raw_generate(channel, payload)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == ("a string field of the request is not valid UTF-8 (for example a lone surrogate); "
                                 "send valid Unicode text")
    assert _refused(server, "unicode") == before + 2
    _still_serves(stub)


def test_a_lone_surrogate_given_to_the_engine_is_invalid_argument(served) -> None:
    _, engine, _, _ = served
    with pytest.raises(InvalidArgument, match="the prompt is not valid Unicode: a lone surrogate U\\+D800") as err:
        engine.add_request(SamplingParams(max_tokens=2), text="w5 \ud800")
    assert err.value.reason == "unicode"
    with pytest.raises(InvalidArgument, match="stop string 1 is not valid Unicode: a lone surrogate U\\+DC00"):
        SamplingParams(stop=("ok", "\udc00"))


def test_a_runner_at_its_stream_cap_answers_overloaded(served) -> None:
    stub, _, server, _ = served
    before = _refused(server, "overloaded")
    held = [stub.Generate(pb.GenerateRequest(text="w5", sampling=_greedy(100)), timeout=30) for _ in range(2)]
    try:
        for call in held:
            next(call)  # both slots are held while these streams are open
        err = _refusal(stub, pb.GenerateRequest(text="w6", sampling=_greedy(2)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and is_overloaded(err)
        assert "maximum of 2 concurrent streams" in err.details()
        assert _refused(server, "overloaded") == before + 1
    finally:
        for call in held:
            call.cancel()


def test_tokenizing_a_long_prompt_lets_other_threads_run(served) -> None:
    """``tokenizers``' ``encode`` holds the GIL for the whole prompt; the batch form releases it."""
    _, engine, _, _ = served
    text = " ".join(f"w{i % 96}" for i in range(250_000))  # ~1 MB
    ticks, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0005)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        start = ticks[0]
        ids = engine.tokenizer.encode(text)
        during = ticks[0] - start
    finally:
        stop.set()
        spinner.join()
    assert len(ids) == 250_000  # one id per word
    assert during >= 20, f"the other thread ran only {during} times while the prompt was tokenized"
