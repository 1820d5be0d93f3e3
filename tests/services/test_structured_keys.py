"""The structured-output spec shared by the doors and the runner (``services/structured.py``): the
proto round trip, the limits, and vLLM's ``structured_outputs`` / ``guided_decoding`` keys through
the sampling-keys parser both doors use (Triton's ``sampling_parameters`` JSON included)."""

from __future__ import annotations

import json

import pytest

from kserve_service.convert import MAX_SAMPLING_JSON_BYTES, sampling_from_json
from services.errors import InvalidArgument
from services.sampling_keys import sampling_from_dict
from services.structured import (
    MAX_CHOICES,
    MAX_STRUCTURED_BYTES,
    StructuredSpec,
    spec_from_proto,
    spec_to_proto,
    structured_from_vllm,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize("spec", [StructuredSpec("json_schema", json.dumps(SCHEMA)), StructuredSpec("json_object"),
                                  StructuredSpec("regex", "a|b"), StructuredSpec("choice", choices=("x", "y z")),
                                  StructuredSpec("grammar", 'start: "a"')])
def test_a_spec_survives_the_proto(spec) -> None:
    assert spec_from_proto(spec_to_proto(spec)) == spec


def test_limits_and_empty_constraints_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match=f"is {MAX_STRUCTURED_BYTES + 2} bytes; at most") as e:
        StructuredSpec("grammar", "é" * (MAX_STRUCTURED_BYTES // 2 + 1))
    assert e.value.reason == "structured"
    with pytest.raises(InvalidArgument, match=f"at most {MAX_CHOICES}"):
        StructuredSpec("choice", choices=tuple(map(str, range(MAX_CHOICES + 1))))
    with pytest.raises(InvalidArgument, match="is empty"):
        StructuredSpec("regex", "")
    with pytest.raises(InvalidArgument, match="empty string"):
        StructuredSpec("choice", choices=("a", ""))
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        StructuredSpec("regex", "\ud800")


@pytest.mark.parametrize("key", ["structured_outputs", "guided_decoding"])
def test_vllm_structured_keys_become_the_proto_field(key) -> None:
    sp = sampling_from_dict({"max_tokens": 5, key: {"json": SCHEMA, "backend": "xgrammar"}})
    assert json.loads(sp.structured.json_schema) == SCHEMA and sp.max_tokens == 5
    sp = sampling_from_dict({key: json.dumps({"regex": "[0-9]+", "whitespace_pattern": None})})  # JSON text
    assert sp.structured.regex == "[0-9]+"
    assert list(sampling_from_dict({key: {"choice": ["a", "b"]}}).structured.choice.choices) == ["a", "b"]
    assert sampling_from_dict({key: {"grammar": 'root ::= "a"'}}).structured.grammar == 'root ::= "a"'
    assert sampling_from_dict({key: {"json_object": True}}).structured.json_object
    assert not sampling_from_dict({key: {"json_object": False}}).HasField("structured")
    assert not sampling_from_dict({key: None}).HasField("structured")


@pytest.mark.parametrize(("params", "words"), [
    ({"structured_outputs": {"regex": "a", "json": {}}}, "at most one structured-output constraint, got 2"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "at most one"),
    ({"guided_decoding": {"json": "{oops"}}, "'guided_decoding.json' is not valid JSON"),
    ({"guided_decoding": {"json": [1]}}, "must be a JSON schema"),
    ({"guided_decoding": {"choice": "a"}}, "must be a list of strings"),
    ({"guided_decoding": {"regex": 5}}, "must be a string"),
    ({"guided_decoding": {"whitespace_pattern": " *"}}, "'guided_decoding.whitespace_pattern' is not supported"),
    ({"guided_decoding": 3}, "must be an object"),
    ({"structured_outputs": "[1"}, "is not valid JSON"),
])
def test_bad_vllm_structured_keys_are_invalid_argument_naming_the_key(params, words) -> None:
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(").replace("[", r"\[")):
        sampling_from_dict(params)


def test_triton_sampling_parameters_carry_a_schema_at_the_limit() -> None:
    schema = {"type": "object", "description": "\u00e9" * (MAX_STRUCTURED_BYTES // 2 - 100)}
    text = json.dumps({"max_tokens": 3, "guided_decoding": {"json": schema}})  # \u-escaped: 3x the bytes
    assert len(text) < MAX_SAMPLING_JSON_BYTES
    assert json.loads(sampling_from_json(text).structured.json_schema) == schema
    assert structured_from_vllm("k", {"json": json.dumps(schema)}).text == json.dumps(schema, ensure_ascii=False)


def test_a_schema_nested_past_the_parser_is_invalid_argument_not_a_crash() -> None:
    deep = '{"type": "array", "items": ' * 2000 + "{}" + "}" * 2000
    for params in ({"guided_decoding": {"json": deep}}, {"structured_outputs": json.dumps({"json": deep})},
                   {"guided_decoding": json.dumps({"json": "[" * 5000})}):
        with pytest.raises(InvalidArgument, match="nests too deeply|not valid JSON"):
            sampling_from_dict(params)
    nested: dict = {}
    for _ in range(5000):
        nested = {"type": "array", "items": nested}
    with pytest.raises(InvalidArgument, match="nests too deeply"):
        sampling_from_dict({"guided_decoding": {"json": nested}})
