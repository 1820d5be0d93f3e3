"""Structured output in the engine, on a tiny random model behind a tiny byte-level tokenizer
(the model's vocabulary larger than the tokenizer's: padding ids): every output obeys its
constraint (JSON schema, any JSON object, regex, choice, Lark and GBNF grammars; greedy and
sampled), a bad constraint is INVALID_ARGUMENT before any KV block is taken, unconstrained rows
beside a constrained one are unchanged, and speculative decoding keeps the constraint (and, greedy,
the output)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from runner_tiny import ScriptedDrafter, kv_bytes, random_prompt, tiny_args, tiny_config
from runner_tiny import run_requests as _run
from structured_tiny import tiny_tokenizer

from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from runner_service.sequence import FinishReason
from runner_service.structured import GrammarCompiler
from services.errors import InvalidArgument
from services.structured import MAX_STRUCTURED_BYTES, StructuredSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = tiny_args(vocab=320, eos=(1,))  # the tokenizer has 270 ids: 50 padding ids
WEIGHTS = LLAMA.random_weights(ARGS, seed=3)
TOKENIZER = tiny_tokenizer()

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["yes", "no", "abc"]},
    "ok": {"type": "boolean"},
    "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
    "required": ["n", "kind", "ok", "tag"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ("yes", "no", "abc", "maybe so")
LARK = 'start: "<" item ("," item)* ">"\nitem: /[0-9]/ | "true"\n'
GBNF = 'root ::= "(" [a-z]{1,3} ")"'


def _spec(kind):
    return {"json_schema": StructuredSpec("json_schema", json.dumps(SCHEMA)),
            "json_object": StructuredSpec("json_object"),
            "regex": StructuredSpec("regex", REGEX),
            "choice": StructuredSpec("choice", choices=CHOICES),
            "lark": StructuredSpec("grammar", LARK),
            "gbnf": StructuredSpec("grammar", GBNF)}[kind]


def _valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "lark":
        return re.fullmatch(r"<(?:[0-9]|true)(?:,(?:[0-9]|true))*>", text) is not None
    return re.fullmatch(r"\([a-z]{1,3}\)", text) is not None


KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")


def _obeys(kind: str, out) -> bool:
    """Whether ``out`` is a complete (STOP) valid output of ``kind``; ``json_object`` may also run
    out of tokens (LENGTH: a random model need not close an unbounded object), then an object's start."""
    if kind == "json_object" and out.finish_reason is FinishReason.LENGTH:
        return out.text.startswith("{")
    return out.finish_reason is FinishReason.STOP and _valid(kind, out.text)


def _engine(blocks=600, **cfg):
    return LLMEngine(ARGS, WEIGHTS, tiny_config(kv_cache_bytes=kv_bytes(ARGS, blocks), **cfg), TOKENIZER)


def _prompt(n, seed):
    return random_prompt(n, seed, 270)


def _requests(kinds, seeds, **kw):
    """One request per (kind, seed): greedy for seed 0, else sampled at temperature 1 with that seed."""
    out = []
    for kind in kinds:
        for seed in seeds:
            sampling = dict(temperature=0.0) if seed == 0 else dict(temperature=1.0, seed=seed)
            params = SamplingParams(max_tokens=120, structured=_spec(kind), **sampling, **kw)
            out.append((_prompt(5 + seed % 7, seed + 100 * KINDS.index(kind)), params))
    return out


def test_every_output_obeys_its_constraint_greedy_and_sampled():
    requests = _requests(KINDS, range(4))
    with _engine() as eng:
        outs = _run(eng, requests)
        assert eng.block_manager.num_used_blocks == 0
    objects_done = 0
    for (_, p), out in zip(requests, outs, strict=True):
        kind = next(k for k in KINDS if _spec(k) == p.structured)
        assert all(t < TOKENIZER.vocab_size for t in out.token_ids)  # never a padding id
        assert _obeys(kind, out), (kind, out.finish_reason, out.text)
        objects_done += kind == "json_object" and out.finish_reason is FinishReason.STOP
    assert objects_done >= 1
    texts = {out.text for out in outs}
    assert len(texts) > len(KINDS)  # the sampled rows differ: the mask did not force one path


def test_a_constraint_that_does_not_compile_is_invalid_argument_before_any_block_is_taken():
    bad = [StructuredSpec("regex", "(ab"), StructuredSpec("json_schema", '{"type": "nope"}'),
           StructuredSpec("json_schema", "[1, 2"), StructuredSpec("grammar", 'start: "a" undefined_rule'),
           StructuredSpec("grammar", 'root ::= ( "a" '),
           StructuredSpec("json_schema", '{"$ref": "#/definitions/missing"}')]
    with _engine() as eng:
        eng.add_request(SamplingParams(max_tokens=4, temperature=0), token_ids=_prompt(6, 1))
        eng.run_until_done(max_steps=1)  # one request holding blocks
        free, waiting = eng.block_manager.num_free_blocks, eng.scheduler.num_waiting
        for spec in bad:
            with pytest.raises(InvalidArgument, match="structured output"):
                eng.add_request(SamplingParams(max_tokens=8, structured=spec), token_ids=_prompt(6, 2))
            with pytest.raises(InvalidArgument):  # the refusal is cached: the same answer again
                eng.add_request(SamplingParams(max_tokens=8, structured=spec), token_ids=_prompt(6, 2))
        assert (eng.block_manager.num_free_blocks, eng.scheduler.num_waiting) == (free, waiting)
        eng.run_until_done()
    with pytest.raises(InvalidArgument, match=f"at most {MAX_STRUCTURED_BYTES}"):
        StructuredSpec("regex", "a" * (MAX_STRUCTURED_BYTES + 1))
    with pytest.raises(InvalidArgument, match="no tokenizer|none"):
        GrammarCompiler(None, 320, (1,)).compile(StructuredSpec("regex", "a+"))


def test_unconstrained_rows_beside_a_constrained_one_are_unchanged():
    free = [(_prompt(9, s), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for s in (1, 2)]
    sampled = [(_prompt(7, 3), SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True))]
    with _engine() as eng:
        alone = _run(eng, free + sampled)
        mixed = _run(eng, [free[0], _requests(["json_schema"], [0])[0], free[1],
                           _requests(["regex"], [5])[0], sampled[0]])
    assert [o.token_ids for o in (mixed[0], mixed[2], mixed[4])] == [o.token_ids for o in alone]
    assert _valid("json_schema", mixed[1].text) and _valid("regex", mixed[3].text)


def test_speculative_decoding_keeps_the_constraint_and_the_greedy_output():
    requests = _requests(KINDS, (0,)) + _requests(("json_schema", "lark"), (1, 2))
    with _engine() as plain_engine:
        plain = _run(plain_engine, requests)
    outputs = {tuple(ids): o.token_ids for (ids, _), o in zip(requests, plain, strict=True)}
    spec = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    with _engine(**spec) as eng:
        eng.gate = None  # verify every step (the gate would measure and may turn drafts off)
        eng.drafter = ScriptedDrafter(3, outputs, ARGS.vocab_size, wrong=0.3)  # some drafts the grammar refuses
        got = _run(eng, requests)
        stats = eng.stats()
        assert eng.block_manager.num_used_blocks == 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for (_, p), g, o in zip(requests, got, plain, strict=True):
        kind = next(k for k in KINDS if _spec(k) == p.structured)
        assert _obeys(kind, g), (kind, g.text)
        if p.greedy:
            assert (g.token_ids, g.finish_reason) == (o.token_ids, o.finish_reason)
    with _engine(**spec) as ngram:  # prompt-lookup drafts (the real drafter)
        ngram.gate = None
        reqs = [(ids * 3, p) for ids, p in _requests(("json_schema", "regex", "choice"), (0, 3))]
        for (_, p), out in zip(reqs, _run(ngram, reqs), strict=True):
            kind = next(k for k in KINDS if _spec(k) == p.structured)
            assert _obeys(kind, out), (kind, out.text)


def test_choices_penalties_and_min_tokens_keep_the_constraint():
    """``n`` choices each step their own matcher (seeded choice i = the request with seed s + i);
    penalties and ``logit_bias`` reshape the logits inside the grammar, never outside it; a
    ``min_tokens`` the grammar cannot reach ends with the grammar (its EOS is allowed once
    nothing else is)."""
    prompt = _prompt(6, 11)
    with _engine() as eng:
        both = eng.add_request(SamplingParams(max_tokens=40, temperature=1.0, seed=21, n=3, structured=_spec("regex")),
                               token_ids=prompt)
        eng.run_until_done()
        choices = both.results(timeout=0)
        alone = [_run(eng, [(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=21 + i,
                                                    structured=_spec("regex")))])[0] for i in range(3)]
        assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
        assert all(_obeys("regex", c) for c in choices)
        shaped = _run(eng, [(prompt, SamplingParams(max_tokens=60, temperature=0.0, presence_penalty=2.0,
                                                    frequency_penalty=2.0, repetition_penalty=1.8,
                                                    logit_bias={ord("a") + 2: 100.0}, structured=_spec(kind)))
                            for kind in ("json_schema", "regex", "choice")])
        for kind, out in zip(("json_schema", "regex", "choice"), shaped, strict=True):
            assert _obeys(kind, out), (kind, out.text)
        short = _run(eng, [(prompt, SamplingParams(max_tokens=30, temperature=0.0, min_tokens=25,
                                                   structured=_spec("choice")))])[0]
        assert _obeys("choice", short) and len(short.token_ids) < 25, short.text
        assert eng.block_manager.num_used_blocks == 0


def test_a_grammar_that_fails_while_generating_aborts_the_request_instead_of_stopping_it():
    """A matcher in error (here: a token forced past the grammar; in service, a parser limit hit
    mid-generation) ends its request ABORTED, never as a normal STOP."""
    from runner_service.output_processor import RequestOutput
    from runner_service.sequence import Sequence
    from runner_service.structured import finish_completed

    compiler = GrammarCompiler(TOKENIZER, ARGS.vocab_size, (1,))
    ok, bad = (Sequence(rid, [3, 4], SamplingParams(max_tokens=8), 64) for rid in ("ok", "bad"))
    ok.grammar, bad.grammar = compiler.compile(_spec("choice")), compiler.compile(_spec("regex"))
    for t in TOKENIZER.encode("yes", add_special_tokens=False):
        assert ok.grammar.consume_token(t)
    ok.grammar.consume_token(1)  # EOS: complete
    assert not bad.grammar.consume_token(TOKENIZER.encode("z", add_special_tokens=False)[0])  # outside [a-c]
    outs = [RequestOutput("ok"), RequestOutput("bad")]
    finish_completed([ok, bad], outs)
    assert [o.finish_reason for o in outs] == [FinishReason.STOP, FinishReason.ABORTED]
