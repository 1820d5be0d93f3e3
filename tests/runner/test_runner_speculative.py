"""Speculative decoding (``--speculative ngram``) in the engine, on tiny random models: greedy
output equal to one-token-per-step decoding (bit for bit in batch-invariant mode), the stop
rules, logprobs, preemption and cancellation with exact block accounting, the per-request
opt-out, seeded sampling, and the families that cannot speculate."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import ScriptedDrafter, kv_bytes, tiny_args, tiny_config
from runner_tiny import run_requests as _run

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import FinishReason
from services.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args(vocab=64, eos=(1,))
WEIGHTS = LLAMA.random_weights(ARGS, seed=11)
SPEC = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def _engine(blocks=400, **cfg):
    return LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, blocks), **cfg))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Copy-heavy prompts (a random span repeated, as in quoting or editing) and plain random ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        span = torch.randint(2, ARGS.vocab_size, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        out.append(span * 3 if i % 2 == 0 else torch.randint(2, ARGS.vocab_size, (20,), generator=g).tolist())
    return out


def _key(out):
    return out.token_ids, out.finish_reason, out.completion_tokens


def test_greedy_output_equals_one_token_per_step_with_every_stop_rule_and_logprobs():
    prompts = _prompts(12)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),   # the length limit mid-draft
              SamplingParams(max_tokens=30, temperature=0),                    # EOS may come mid-draft
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2)]
    requests = [(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    plain = _run(_engine(), requests)
    # a stop token that plain decoding emits in the middle of each output
    requests += [(ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                      stop_token_ids=(out.token_ids[len(out.token_ids) // 2],)))
                 for (ids, _), out in zip(requests[:4], plain[:4], strict=True)]
    plain = _run(_engine(), requests)
    spec_engine = _engine(**SPEC)
    spec = _run(spec_engine, requests)
    assert [_key(o) for o in spec] == [_key(o) for o in plain]
    assert any(o.finish_reason is FinishReason.STOP for o in plain[-4:])
    for a, b in zip(spec, plain, strict=True):
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs, b.logprobs, strict=True))
    scripted = _engine(**SPEC)
    # the full outputs (the stop-token requests reuse the first four prompts: their outputs are prefixes)
    scripted.drafter = ScriptedDrafter(3, {tuple(ids): o.token_ids for (ids, _), o in zip(requests[:12], plain,
                                                                                          strict=False)}, ARGS.vocab_size)
    assert [_key(o) for o in _run(scripted, requests)] == [_key(o) for o in plain]
    s = scripted.stats()
    assert s["spec_decode_mean_acceptance_length"] > 1.5 and 0.3 < s["spec_decode_acceptance_rate"] < 0.95
    assert scripted.block_manager.num_used_blocks == 0
    stats = spec_engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1
    assert stats["spec_decode_mean_acceptance_length"] == 1 + (stats["spec_decode_num_accepted_tokens"]
                                                             / stats["spec_decode_num_drafts"])
    assert stats["kv_blocks_used"] == 0
    assert stats["generated_tokens_total"] == sum(o.completion_tokens for o in spec)


@pytest.mark.parametrize("k", [1, 4])
def test_forced_drafts_all_right_give_k_plus_1_tokens_a_step_all_wrong_exactly_one(k):
    requests = [(p, SamplingParams(max_tokens=41, temperature=0, ignore_eos=True)) for p in _prompts(4, 8)]
    plain = _run(_engine(), requests)
    outputs = {tuple(ids): o.token_ids for (ids, _), o in zip(requests, plain, strict=True)}
    for wrong, steps_per_seq, acceptance in ((0.0, -(-40 // (k + 1)), 1.0), (1.0, 40, 0.0)):
        engine = _engine(**{**SPEC, "num_speculative_tokens": k})
        engine.drafter = ScriptedDrafter(k, outputs, ARGS.vocab_size, wrong=wrong)
        streams = [engine.add_request(p, token_ids=ids) for ids, p in requests]
        steps = engine.run_until_done()
        assert [s.result(timeout=0).token_ids for s in streams] == [o.token_ids for o in plain]
        # one prefill step, then the 40 tokens after the first at k + 1 (or 1) a step for all four rows
        assert steps == 1 + steps_per_seq
        assert engine.stats()["spec_decode_acceptance_rate"] == acceptance


def test_sampled_tokens_follow_the_same_distribution_with_and_without_speculation():
    """Temperature 1.0 on a 16-token vocabulary, 800 seeds: the histograms of the 2nd and 3rd
    generated tokens (the first ones a verify step emits) with forced drafts vs without pass a
    two-sample chi-squared test at p = 0.001 (15 degrees of freedom: critical value 37.70)."""
    args = tiny_args(vocab=16, eos=(1,))
    weights = LLAMA.random_weights(args, seed=2)
    prompt = [3, 7, 5, 9, 3, 7]

    class LikelyDrafter:  # the most frequent 2nd and 3rd tokens of the plain run, every step
        drafts: list[int] = []

        def propose(self, seqs):
            for seq in seqs:
                if not seq.is_finished:
                    room = max(0, seq.max_total_tokens - seq.num_tokens - 1)
                    done = seq.num_completion_tokens
                    seq.draft_token_ids = self.drafts[done - 1:done - 1 + room]

    hists = []
    for spec in (False, True):
        engine = LLMEngine(args, weights, tiny_config(max_num_seqs=16, kv_cache_bytes=kv_bytes(args, 400),
                                                     **(SPEC if spec else {})))
        if spec:
            engine.drafter = LikelyDrafter()
        streams = [engine.add_request(SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True),
                                      token_ids=prompt) for s in range(800)]
        engine.run_until_done()
        outs = [st.result(timeout=0).token_ids for st in streams]
        hists.append([torch.bincount(torch.tensor([o[j] for o in outs]), minlength=16).float() for j in (1, 2)])
        if spec:
            assert engine.stats()["spec_decode_num_accepted_tokens"] > 100  # the verify path decided many
        else:
            LikelyDrafter.drafts = [int(h.argmax()) for h in hists[0]]
    for plain, drafted in zip(*hists, strict=True):
        seen = (plain + drafted) > 0
        chi2 = (((plain - drafted) ** 2)[seen] / (plain + drafted)[seen]).sum().item()
        assert chi2 < 37.70, (chi2, plain.tolist(), drafted.tolist())


def test_batch_invariant_speculative_output_is_bit_for_bit_the_plain_output():
    requests = [(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)) for p in _prompts(6, 1)]
    plain = _run(_engine(batch_invariant=True), requests)
    for scripted in (False, True):
        spec_engine = _engine(batch_invariant=True, **SPEC)
        if scripted:
            spec_engine.drafter = ScriptedDrafter(3, {tuple(ids): o.token_ids for (ids, _), o in zip(requests, plain,
                                                                                                  strict=True)}, ARGS.vocab_size)
        spec = _run(spec_engine, requests)
        assert spec_engine.stats()["spec_decode_num_accepted_tokens"] > 0
        for a, b in zip(spec, plain, strict=True):
            assert a.token_ids == b.token_ids
            assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]


def test_preemption_under_kv_exhaustion_keeps_outputs_and_block_accounting_exact():
    requests = [(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in _prompts(16, 2)]
    plain = _run(_engine(blocks=400), requests)
    for scripted in (False, True):
        engine = _engine(blocks=60, max_num_seqs=16, **SPEC)  # 59 usable blocks of 4 tokens for 16 x ~60 tokens
        if scripted:
            engine.drafter = ScriptedDrafter(3, {tuple(ids): o.token_ids for (ids, _), o in zip(requests, plain,
                                                                                             strict=True)}, ARGS.vocab_size)
        spec = _run(engine, requests)
        assert engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert engine.block_manager.num_used_blocks == 0


def test_cancelling_mid_generation_frees_every_block():
    engine = _engine(**SPEC)
    baseline = engine.block_manager.num_used_blocks
    streams = [engine.add_request(SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), token_ids=p)
               for p in _prompts(4, 3)]
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_used_blocks > baseline
    for s in streams:
        s.cancel()
    engine.run_until_done()
    assert [s.result(timeout=0).finish_reason for s in streams] == [FinishReason.CANCELLED] * 4
    assert engine.block_manager.num_used_blocks == baseline


def test_a_request_that_opts_out_is_never_drafted_and_decodes_the_same():
    engine = _engine(**SPEC)
    prompt = _prompts(1, 4)[0]
    out = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, disable_speculative_decoding=True)
    opted_out = _run(engine, [(prompt, out)])[0]
    assert engine.stats()["spec_decode_num_drafts"] == 0
    drafted = _run(engine, [(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))])[0]
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert drafted.token_ids == opted_out.token_ids


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=123, ignore_eos=True)
    prompt = _prompts(1, 5)[0]
    first = _run(_engine(**SPEC), [(prompt, params)])[0]
    again = _run(_engine(**SPEC), [(prompt, params), (_prompts(2, 6)[1], params)])[0]  # another batch-mate
    assert first.token_ids == again.token_ids and len(first.token_ids) == 30


def test_a_family_without_a_verify_step_refuses_speculation_by_name():
    class Plain(type(LLAMA)):  # a family that lists no speculative method
        name = "plain"
        speculative_methods = ()

    # refused before the weights are looked at: the family decides
    with pytest.raises(InvalidArgument, match="plain family cannot use --speculative ngram"):
        LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=1 << 20, **SPEC), family=Plain())


def test_the_runners_startup_line_names_the_method_and_k_when_speculating(caplog):
    caplog.set_level("INFO", logger="runner_service.engine")
    on = _engine(**SPEC)
    assert on.startup_line().endswith("s | speculative ngram x3")
    assert any(r.getMessage() == "startup: " + on.startup_line() for r in caplog.records)
    assert "speculative" not in _engine().startup_line()


def test_model_info_metrics_and_the_wire_opt_out_report_speculation():
    import grpc
    from prometheus_client import generate_latest

    from runner_service.servicer import GenerationServicer, RunnerCollector
    from services.bootstrap import ServerConfig, ServiceServer
    from services.proto import generation_pb2 as pb
    from services.proto import generation_pb2_grpc
    from warmserve.stack_report import format_startup_report, speculative_summary

    engine = _engine(**SPEC)
    engine.start()
    server = ServiceServer(ServerConfig(service="runner"), [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, "r-spec"),
         "warmserve.v1.Generation")])
    server.registry.register(RunnerCollector(engine))
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            prompt = pb.TokenIds(ids=_prompts(1, 7)[0])
            info = stub.ModelInfo(pb.ModelInfoRequest())
            assert (info.speculative.method, info.speculative.num_speculative_tokens) == ("ngram", 3)
            assert speculative_summary(info.speculative) == "ngram x3: no drafts yet"
            opted = pb.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, disable_speculative_decoding=True)
            out = [t for m in stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=opted)) for t in m.token_ids]
            assert stub.ModelInfo(pb.ModelInfoRequest()).speculative.num_drafts == 0
            drafted = pb.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
            again = [t for m in stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=drafted))
                     for t in m.token_ids]
            assert again == out
            spec = stub.ModelInfo(pb.ModelInfoRequest()).speculative
            stats = engine.stats()
            assert spec.num_drafts == stats["spec_decode_num_drafts"] > 0
            assert spec.num_accepted_tokens == stats["spec_decode_num_accepted_tokens"]
            assert spec.mean_acceptance_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
            assert speculative_summary(spec).startswith("ngram x3: acceptance ")
            report = format_startup_report(stub.ModelInfo(pb.ModelInfoRequest()))
            rate = f"acceptance {spec.num_accepted_tokens / spec.num_draft_tokens:.2f}"
            assert f"  speculative decoding ngram x3: {rate}, {spec.mean_acceptance_length:.2f} tokens/step" in report
        text = generate_latest(server.registry).decode()
        assert f"warmserve_runner_spec_decode_num_accepted_tokens_total {float(spec.num_accepted_tokens)}" in text
    finally:
        server.stop()
        engine.close()


def test_with_a_compiled_decode_the_gate_decides_and_a_declined_step_decodes_one_token():
    requests = [(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in _prompts(4, 9)]
    plain = _run(_engine(), requests)
    engine = _engine(**SPEC)
    engine.runner.install_program("decode", engine.runner.decode_module)  # the program contract, eager

    class Decline:
        def __init__(self):
            self.asked, self.recorded = 0, []

        def reset(self):  # the install above
            pass

        def allow(self, bucket):
            self.asked += 1
            return False

        def record(self, kind, bucket, tokens, seconds):
            self.recorded.append(kind)

    engine.gate = gate = Decline()
    assert [o.token_ids for o in _run(engine, requests)] == [o.token_ids for o in plain]
    assert gate.asked > 0 and set(gate.recorded) == {"decode"}
    assert engine.stats()["spec_decode_num_drafts"] == 0 and engine.block_manager.num_used_blocks == 0
