"""The runner fills ``TokenLogprob.token`` and ``TopLogprob.token`` with the text of each token
id alone, checked against HF ``tokenizers`` loading the same ``tokenizer.json`` (SmolLM2's
byte-level BPE, behind a tiny random model), only when logprobs were asked for."""

from __future__ import annotations

import grpc
import pytest
from runner_tiny import kv_bytes, tiny_args, tiny_config
from tokenizers import Tokenizer as HFTokenizer

from model_families.llama import FAMILY as LLAMA
from runner_service.convert import output_to_proto, token_text_decoder
from runner_service.engine import LLMEngine
from runner_service.output_processor import RequestOutput
from runner_service.sampler import TokenLogprobs
from runner_service.servicer import GenerationServicer
from runner_service.tokenizer import Tokenizer
from services.bootstrap import ServerConfig, ServiceServer
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args(vocab=49152, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16, eos=(2,))


@pytest.fixture(scope="module")
def hf(smollm2_sidecar) -> HFTokenizer:
    """The reference: HF tokenizers on the sidecar's own tokenizer.json."""
    return HFTokenizer.from_file(str(smollm2_sidecar / "tokenizer.json"))


def test_the_decoder_gives_each_id_its_own_text(smollm2_sidecar, hf) -> None:
    text = token_text_decoder(Tokenizer.from_dir(smollm2_sidecar))
    the = hf.token_to_id("Ġthe")
    assert text(the) == " the"  # the byte-level piece keeps its leading space
    assert text(2) == "<|im_end|>"  # special tokens are shown, not skipped (as vLLM and OpenAI show them)
    for token_id in (0, 1, 2, the, 504, 12345, 49151):
        assert text(token_id) == hf.decode([token_id], skip_special_tokens=False)
    assert token_text_decoder(None) is None


def test_output_to_proto_fills_the_token_texts(smollm2_sidecar, hf) -> None:
    the = hf.token_to_id("Ġthe")
    out = RequestOutput("r", token_ids=[the], text=" the",
                        logprobs=[TokenLogprobs(the, -0.25, [(the, -0.25), (2, -1.5)])])
    msg = output_to_proto(out, "runner-x", token_text_decoder(Tokenizer.from_dir(smollm2_sidecar)))
    (lp,) = msg.logprobs
    assert (lp.token_id, lp.token, lp.logprob) == (the, " the", -0.25)
    assert [(t.token_id, t.token, t.logprob) for t in lp.top] == [(the, " the", -0.25), (2, "<|im_end|>", -1.5)]
    bare = output_to_proto(out, "runner-x")  # no decoder: the texts stay empty
    assert bare.logprobs[0].token == "" and [t.token for t in bare.logprobs[0].top] == ["", ""]


def test_the_served_stream_carries_token_texts_only_with_logprobs(smollm2_sidecar, hf) -> None:
    engine = LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=3),
                       tiny_config(max_num_seqs=2, max_model_len=128, kv_cache_bytes=kv_bytes(ARGS, 30)),
                       Tokenizer.from_dir(smollm2_sidecar), model="tiny-random")
    engine.start()
    server = ServiceServer(ServerConfig(service="runner"), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, "r-tok"),
         "warmserve.v1.Generation")])
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=4)
            msgs = list(stub.Generate(pb.GenerateRequest(text="The capital of France is", sampling=sampling)))
            lps = [lp for m in msgs for lp in m.logprobs]
            assert len(lps) == 8 and all(len(lp.top) == 4 for lp in lps)
            for lp in lps:
                assert lp.token == hf.decode([lp.token_id], skip_special_tokens=False)
                assert [t.token for t in lp.top] == [hf.decode([t.token_id], skip_special_tokens=False)
                                                     for t in lp.top]
            plain = list(stub.Generate(pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True))))
            assert [t for m in plain for t in m.token_ids] == [lp.token_id for lp in lps]
            assert all(not m.logprobs for m in plain)
    finally:
        server.stop()
        engine.close()
