"""clients/node/generate.js's structured-output flags (``SamplingParams.structured``) and ``--n``
against a router and a runner whose byte-level tokenizer llguidance reads: each constrained
output obeys its constraint (Python's ``re``, choice membership, ``json.loads`` + ``jsonschema``,
a grammar's language as a regex) and is the Python client's answer to the same
``StructuredOutput``; an invalid schema is INVALID_ARGUMENT naming the problem; ``--n 3 --seed s``
prints three indexed choices, each the single-choice answer with seed ``s + i``."""

from __future__ import annotations

import json
import re

import jsonschema

from services.generation_client import GenerationClient, GenerationResult, sampling_params, text_request
from services.proto import generation_pb2

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "colour": {"enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
    "required": ["id", "colour", "ok", "tag"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ("red", "green", "maybe so")
GBNF = 'root ::= "(" [a-z]{1,3} ")"'
MAX_TOKENS = 80


def _reference(address: str, prompt: str, structured: generation_pb2.StructuredOutput, *,
               seed: int | None = None) -> GenerationResult:
    sampling = (sampling_params(max_tokens=MAX_TOKENS, temperature=0.0) if seed is None
                else sampling_params(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed))
    request = text_request(prompt, sampling)
    request.sampling.structured.CopyFrom(structured)
    with GenerationClient(address, fail_fast=True) as client:
        return client.complete(request, timeout_s=30)


def _valid_record(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def test_each_constraint_flag_gives_output_that_obeys_it(bytes_stack, node_cli, tmp_path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA, indent=2))
    grammar_file = tmp_path / "paren.gbnf"
    grammar_file.write_text(GBNF)
    cases = [  # (flags, the same constraint as a StructuredOutput, the independent check, prompt)
        (["--json-schema", json.dumps(SCHEMA)], generation_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
         _valid_record, "A record as JSON:"),
        (["--json-schema", str(schema_file)], generation_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
         _valid_record, "Another record:"),
        (["--json-object"], generation_pb2.StructuredOutput(json_object=True),
         lambda t: isinstance(json.loads(t), dict), "An object:"),
        (["--regex", REGEX], generation_pb2.StructuredOutput(regex=REGEX),
         lambda t: re.fullmatch(REGEX, t) is not None, "Order number:"),
        ([a for c in CHOICES for a in ("--choice", c)],
         generation_pb2.StructuredOutput(choice=generation_pb2.ChoiceList(choices=CHOICES)),
         lambda t: t in CHOICES, "Pick one:"),
        (["--grammar", str(grammar_file)], generation_pb2.StructuredOutput(grammar=GBNF),
         lambda t: re.fullmatch(r"\([a-z]{1,3}\)", t) is not None, "In parentheses:"),
    ]
    for flags, structured, check, prompt in cases:
        ref = _reference(bytes_stack.address, prompt, structured)
        # Any JSON object need not close within MAX_TOKENS on a random model: its prompt is one whose does.
        assert ref.finish_reason == "STOP" and check(ref.text), (flags, ref)
        done = node_cli("generate.js", "--addr", bytes_stack.address, "--prompt", prompt,
                        "--max-tokens", str(MAX_TOKENS), "--temperature", "0", *flags)
        assert done.returncode == 0, (flags, done.stderr)
        assert done.stdout.endswith("\n")
        text = done.stdout[:-1]
        assert check(text), (flags, text)  # independent of the reference
        assert text == ref.text, flags
        assert done.stderr.endswith(f" tokens, prompt {ref.prompt_tokens} tokens, finish STOP\n"), done.stderr


def test_an_invalid_schema_is_refused_naming_the_problem(bytes_stack, node_cli) -> None:
    for schema, says in (({"type": "object", "properties": {"id": {"type": "integr"}}}, "Invalid type: integr"),
                         ({"type": "string", "minLength": 5, "maxLength": 2},
                          "minLength (5) is greater than maxLength (2)")):
        done = node_cli("generate.js", "--addr", bytes_stack.address, "--prompt", "x",
                        "--json-schema", json.dumps(schema))
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr.startswith("generate.js: INVALID_ARGUMENT: the structured output's json schema "
                                      "is not valid"), done.stderr
        assert says in done.stderr


def test_bad_structured_flags_exit_2_before_dialling(node_cli, tmp_path) -> None:
    addr = ("--addr", "127.0.0.1:1")  # nothing listens: a flag error must come first
    for args, says in ((["--regex", "a", "--choice", "b"], "at most one structured-output flag, got --regex, --choice"),
                       (["--json-object", "--json-schema", "{}"], "got --json-schema, --json-object"),
                       (["--json-schema", "{not json"], "--json-schema is not valid JSON"),
                       (["--json-schema", "[1]"], "--json-schema must be a JSON object"),
                       (["--json-schema", str(tmp_path / "missing.json")], "--json-schema: cannot read"),
                       (["--grammar", str(tmp_path / "missing.gbnf")], "--grammar: cannot read"),
                       (["--regex", ""], "--regex must not be empty"),
                       (["--choice", "a", "--choice", ""], "--choice must not be empty"),
                       (["--n", "0"], "--n must be in [1, ")):
        done = node_cli("generate.js", *addr, *args, "x")
        assert (done.returncode, done.stdout) == (2, ""), args
        assert done.stderr.startswith("generate.js: error: ") and says in done.stderr, (args, done.stderr)


def test_n_choices_are_indexed_and_each_is_the_single_choice_with_seed_plus_index(bytes_stack, node_cli) -> None:
    prompt, seed = "Order number:", 11
    refs = [_reference(bytes_stack.address, prompt, generation_pb2.StructuredOutput(regex=REGEX), seed=seed + i)
            for i in range(3)]
    assert all(r.finish_reason == "STOP" and re.fullmatch(REGEX, r.text) for r in refs), refs
    assert len({r.text for r in refs}) > 1  # the seeds differ: so do the samples
    args = ("--addr", bytes_stack.address, "--prompt", prompt, "--max-tokens", str(MAX_TOKENS),
            "--temperature", "1", "--seed", str(seed), "--n", "3", "--regex", REGEX)
    done = node_cli("generate.js", *args, "--json")
    assert done.returncode == 0, done.stderr
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    assert {m["index"] for m in messages} == {0, 1, 2}
    for i, ref in enumerate(refs):
        mine = [m for m in messages if m["index"] == i]
        assert "".join(m["text"] for m in mine) == ref.text
        assert mine[-1]["finish_reason"] == "FINISH_REASON_STOP"
        assert mine[-1]["usage"]["completion_tokens"] == ref.completion_tokens

    done = node_cli("generate.js", *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(f"[{i}] {ref.text}\n" for i, ref in enumerate(refs))
    assert done.stderr == "".join(f"[{bytes_stack.runner_id}] choice {i}: {ref.completion_tokens} tokens, prompt "
                                  f"{ref.prompt_tokens} tokens, finish STOP\n" for i, ref in enumerate(refs))
