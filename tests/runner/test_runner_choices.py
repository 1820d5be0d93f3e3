"""Several choices per request (``SamplingParams.n``) on the tiny Llama engine: choice i is the
request with seed s + i, greedy choices agree, the choices share the prompt's full KV blocks
(counted from first principles), nothing leaks after they finish or are cancelled, ``n`` is
validated before anything is queued, and the gRPC servicer streams every choice with its index."""

from __future__ import annotations

import math

import grpc
import pytest
from runner_tiny import kv_bytes, random_prompt, tiny_args, tiny_config

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.output_processor import RequestOutput, RequestStream, merge_by_choice, merge_outputs
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import FinishReason
from runner_service.servicer import GenerationServicer
from services.bootstrap import ServerConfig, ServiceServer
from services.errors import InvalidArgument, ResourceExhausted
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc
from services.sampling_keys import MAX_N

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args()
WEIGHTS = LLAMA.random_weights(ARGS, seed=5)
BS = 4  # tiny_config's block size


def _engine(**cfg):
    cfg.setdefault("kv_cache_bytes", kv_bytes(ARGS, 200))
    return LLMEngine(ARGS, WEIGHTS, tiny_config(**cfg))


def _prompt(n, seed):
    return random_prompt(n, seed, ARGS.vocab_size)


def test_seeded_choices_equal_separate_requests_with_seeds_s_plus_i():
    ids = _prompt(10, 1)
    with _engine() as eng:
        stream = eng.add_request(SamplingParams(max_tokens=12, temperature=1.0, seed=41, ignore_eos=True, n=3),
                                 token_ids=ids)
        eng.run_until_done()
        choices = stream.results(timeout=0)
        singles = []
        for i in range(3):
            s = eng.add_request(SamplingParams(max_tokens=12, temperature=1.0, seed=41 + i, ignore_eos=True),
                                token_ids=ids)
            eng.run_until_done()
            singles.append(s.result(timeout=0))
    assert [c.index for c in choices] == [0, 1, 2]
    assert [c.token_ids for c in choices] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in choices}) == 3  # three seeds, three samples
    for c in choices:
        assert c.request_id == stream.request_id
        assert c.finish_reason is FinishReason.LENGTH
        assert (c.prompt_tokens, c.completion_tokens) == (10, 12)


def test_greedy_choices_are_equal():
    ids = _prompt(7, 2)
    with _engine() as eng:
        stream = eng.add_request(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2), token_ids=ids)
        single = eng.add_request(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), token_ids=ids)
        eng.run_until_done()
        a, b = stream.results(timeout=0)
        assert a.token_ids == b.token_ids == single.result(timeout=0).token_ids
        assert (a.index, b.index) == (0, 1)
        # Choice 0 finishes in the step that computes the prompt: the others still find its blocks cached.
        bm = eng.block_manager
        saved = bm.prefix_hit_tokens
        one = eng.add_request(SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, n=3), token_ids=ids)
        eng.run_until_done()
        outs = one.results(timeout=0)
        assert [o.token_ids for o in outs] == [a.token_ids[:1]] * 3
        assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
        assert bm.prefix_hit_tokens - saved >= 2 * ((len(ids) - 1) // BS * BS)


@pytest.mark.parametrize("caching", [True, False])
def test_choices_share_the_prompts_full_blocks_and_free_them_all(caching):
    prompt, n, max_tokens = 10, 3, 2
    with _engine(enable_prefix_caching=caching) as eng:
        bm = eng.block_manager
        baseline = bm.num_free_blocks
        stream = eng.add_request(SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True, n=n),
                                 token_ids=_prompt(prompt, 3))
        peak = 0
        while eng.has_work():
            eng.step()
            peak = max(peak, bm.num_used_blocks)
        outs = stream.results(timeout=0)
        # K/V of at most prompt + max_tokens - 1 = 11 tokens: ceil(11 / 4) = 3 blocks per choice.
        own = math.ceil((prompt + max_tokens - 1) / BS)
        # Choice 0 computes the prompt; choices 1.. take its (prompt - 1) // 4 = 2 full blocks
        # from the prefix cache (the last prompt token is always recomputed) and add 1 of their own.
        shared = (prompt - 1) // BS if caching else 0
        assert peak == own + (n - 1) * (own - shared) == (5 if caching else 9)
        assert all(o.finish_reason is FinishReason.LENGTH and o.completion_tokens == max_tokens for o in outs)
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == baseline


def test_cancelling_a_request_cancels_every_choice_and_frees_every_block():
    with _engine() as eng:
        bm = eng.block_manager
        baseline = bm.num_free_blocks
        params = SamplingParams(max_tokens=100, temperature=1.0, ignore_eos=True, n=3)
        held = eng.add_request(params, token_ids=_prompt(9, 4), request_id="held")
        held.cancel()  # before any step: choices 1..2 are still held back behind choice 0
        eng.run_until_done()
        assert [o.finish_reason for o in held.results(timeout=0)] == [FinishReason.CANCELLED] * 3
        eng.start()
        stream = eng.add_request(params, token_ids=_prompt(9, 5), request_id="req")
        seen = set()
        while len(seen) < 3:  # every choice is decoding
            out = stream.get(timeout=30)
            assert out.finish_reason is None
            seen.add(out.index)
        assert bm.num_used_blocks > 0
        stream.cancel()
        outs = stream.results(timeout=30)
        assert [o.finish_reason for o in outs] == [FinishReason.CANCELLED] * 3
        assert all(0 < o.completion_tokens < 100 for o in outs)
        assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == baseline
        again = eng.add_request(SamplingParams(max_tokens=2, temperature=0, n=2), token_ids=[5, 6], request_id="req")
        assert len(again.results(timeout=30)) == 2  # the id (and its choices' ids) was released


def test_n_is_validated_before_anything_is_queued():
    for bad in (0, MAX_N + 1):
        with pytest.raises(InvalidArgument, match="n must be in"):
            SamplingParams(n=bad)
    with _engine(max_num_seqs=4, kv_cache_bytes=kv_bytes(ARGS, 13)) as eng:  # 12 usable blocks
        with pytest.raises(InvalidArgument, match="at most 4 sequences"):
            eng.add_request(SamplingParams(max_tokens=2, n=5), token_ids=[3, 4])
        # A 9-token prompt, 8 new: K/V of 16 tokens, 4 blocks a choice, (9 - 1) // 4 = 2 of them the
        # shared prompt blocks: n=4 needs 4 + 3 * 2 = 10 blocks (fits); 12 new: 5 + 3 * 3 = 14 (does not).
        eng.add_request(SamplingParams(max_tokens=8, n=4), token_ids=_prompt(9, 6)).cancel()
        with pytest.raises(ResourceExhausted, match="n=4 choices need up to 14 KV blocks"):
            eng.add_request(SamplingParams(max_tokens=12, n=4), token_ids=_prompt(9, 6))
        eng.run_until_done()
    with pytest.raises(ValueError, match="results"):
        RequestStream("r", 1, lambda _r: None, n=2).result()


def test_coalescing_merges_deltas_per_choice_never_across():
    def out(index, tokens, reason=None):
        return RequestOutput("r", list(tokens), "".join(f"<{t}>" for t in tokens), [], reason, 2, len(tokens), index)

    with pytest.raises(ValueError, match="different choices"):
        merge_outputs([out(0, [1]), out(1, [2])])
    merged = merge_by_choice([out(1, [5]), out(0, [1]), out(1, [6]), out(0, [2], FinishReason.STOP)])
    assert [(m.index, m.token_ids, m.text, m.finish_reason) for m in merged] == [
        (1, [5, 6], "<5><6>", None), (0, [1, 2], "<1><2>", FinishReason.STOP)]
    stream = RequestStream("r", 2, lambda _r: None, n=2)
    for o in (out(0, [1]), out(1, [5]), out(0, [2], FinishReason.LENGTH), out(1, [6]), out(1, [7], FinishReason.STOP)):
        stream.queue.put(o)
    got = list(stream.coalesced())
    assert stream.finished
    assert [(m.index, m.token_ids, m.finish_reason) for m in got] == [
        (0, [1, 2], FinishReason.LENGTH), (1, [5, 6, 7], FinishReason.STOP)]


def test_servicer_streams_every_choice_with_its_index():
    with _engine() as eng:
        eng.start()
        server = ServiceServer(ServerConfig(service="runner"), [
            (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(eng, "r-n"),
             "warmserve.v1.Generation")])
        server.start()
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                request = pb.GenerateRequest(request_id="x", token_ids=pb.TokenIds(ids=_prompt(6, 7)),
                                             sampling=pb.SamplingParams(max_tokens=5, temperature=1.0, seed=9,
                                                                        ignore_eos=True, n=3))
                msgs = list(stub.Generate(request, timeout=60))
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3]),
                                                          sampling=pb.SamplingParams(n=MAX_N + 1)), timeout=60))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            server.stop()
    tokens = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in range(3)}
    finals = [m for m in msgs if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1, 2]
    assert all(len(t) == 5 for t in tokens.values())
    assert all(m.request_id == "x" for m in msgs)
    assert [(m.usage.prompt_tokens, m.usage.completion_tokens) for m in finals] == [(6, 5)] * 3
    assert msgs[-1].finish_reason  # the stream ends with the last choice's final message
