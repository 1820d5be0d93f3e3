"""The OpenAI door's tool calling, unit level: ``tools`` and ``tool_choice`` checked and turned
into the proto and a constraint, and answers turned back into OpenAI ``tool_calls``. The
constraint schemas are checked with ``jsonschema`` (an independent validator) against calls
written by hand."""

from __future__ import annotations

import json

import jsonschema
import pytest

from openai_service.errors import OpenAIError
from openai_service.protocol import MAX_TOOLS, ChatMessage
from openai_service.tools import message_to_proto, plan, tool_calls, tools_to_proto

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


def test_tools_become_protos_and_bad_tools_are_a_400_naming_the_field():
    protos = tools_to_proto([WEATHER, TIME])
    assert [(t.name, t.description, json.loads(t.parameters)) for t in protos] == [
        ("get_weather", "Weather now", WEATHER["function"]["parameters"]), ("get_time", "", TIME["function"]["parameters"])]
    bad = [([{"type": "code_interpreter"}], "must be"),
           ([{"type": "function", "function": {"name": "has space"}}], "name must be"),
           ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "JSON Schema object"),
           ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], "at most")]
    for tools, words in bad:
        with pytest.raises(OpenAIError, match=words) as e:
            tools_to_proto(tools)
        assert e.value.status == 400 and e.value.param == "tools"


def test_tool_choice_plans_and_their_schemas_accept_exactly_the_calls_they_should():
    tools = tools_to_proto([WEATHER, TIME])
    assert plan(None, tools).mode == "auto" and plan(None, []).mode == "none" and plan("none", tools).mode == "none"
    named = plan({"type": "function", "function": {"name": "get_time"}}, tools)
    assert (named.mode, named.name) == ("named", "get_time")
    jsonschema.validate({"tz": "UTC"}, json.loads(named.schema))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tz": "PST"}, json.loads(named.schema))
    required = json.loads(plan("required", tools).schema)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "get_time", "arguments": {"tz": "CET"}}], required)
    for wrong in ([], [{"name": "get_weather", "arguments": {"tz": "UTC"}}],
                  [{"name": "nope", "arguments": {}}], [{"name": "get_time", "arguments": {"tz": "UTC"}, "x": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    for choice, words in (("required", "needs tools"), ({"type": "function", "function": {"name": "x"}}, "not among"),
                          ("sometimes", "must be")):
        with pytest.raises(OpenAIError, match=words) as e:
            plan(choice, tools if words != "needs tools" else [])
        assert e.value.param == "tool_choice"


def test_answers_become_tool_calls():
    tools = tools_to_proto([WEATHER, TIME])
    content, calls = tool_calls(plan({"type": "function", "function": {"name": "get_weather"}}, tools),
                                '{"city": "Oslo"}')
    assert content is None and [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Oslo"}'})]
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29
    content, calls = tool_calls(plan("required", tools), '[{"name": "get_time", "arguments": {"tz": "UTC"}}]')
    assert content is None and [c["function"] for c in calls] == [{"name": "get_time", "arguments": '{"tz": "UTC"}'}]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = tool_calls(plan("auto", tools), text)
    assert content == "Let me check." and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert tool_calls(plan("auto", tools), "Just text.") == ("Just text.", [])
    assert tool_calls(plan("auto", tools), "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert tool_calls(plan("required", tools), '[{"name": "get_ti') == ('[{"name": "get_ti', [])  # cut by length


def test_tool_messages_carry_their_calls_and_ids():
    assistant = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]})
    m = message_to_proto("assistant", "", assistant)
    assert [(c.id, c.name, c.arguments) for c in m.tool_calls] == [("call_1", "get_weather", '{"city": "Oslo"}')]
    tool = ChatMessage.model_validate({"role": "tool", "content": "cold", "tool_call_id": "call_1"})
    m = message_to_proto("tool", "cold", tool)
    assert (m.role, m.content, m.tool_call_id) == ("tool", "cold", "call_1")
    broken = ChatMessage.model_validate({"role": "assistant", "tool_calls": [{"function": {"name": 3}}]})
    with pytest.raises(OpenAIError, match="tool_calls"):
        message_to_proto("assistant", "", broken)


def _stream(plan_, pieces: list[str]) -> tuple[str, list[dict], bool]:
    from openai_service.tools import ToolStream

    s, content, deltas = ToolStream(plan_), "", []
    for i, piece in enumerate(pieces):
        c, d = s.feed(piece, final=i == len(pieces) - 1)
        content += c
        deltas += d
    return content, deltas, s.called


def test_streamed_answers_become_the_same_calls_as_whole_ones():
    tools = tools_to_proto([WEATHER, TIME])
    named = plan({"type": "function", "function": {"name": "get_weather"}}, tools)
    content, deltas, called = _stream(named, ['{"ci', 'ty": ', '"Oslo"}', ""])
    assert content == "" and called and deltas[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert deltas[0]["id"].startswith("call_") and all(d["index"] == 0 for d in deltas)
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    for cut in range(1, len(text)):  # wherever the messages split, the same content and call
        content, deltas, called = _stream(plan("auto", tools), [text[:cut], text[cut:]])
        assert (content, [d["function"] for d in deltas], called) == (
            "Sure.", [{"name": "get_time", "arguments": '{"tz": "UTC"}'}], True), cut
    content, deltas, called = _stream(plan("auto", tools), ["a <tool", "box> b", ""])
    assert (content, deltas, called) == ("a <toolbox> b", [], False)  # held back, then let go
    content, deltas, called = _stream(plan("required", tools), ['[{"name": "get_time", ', '"arguments": {"tz": "CET"}}]'])
    assert content == "" and [(d["index"], d["function"]) for d in deltas] == [
        (0, {"name": "get_time", "arguments": '{"tz": "CET"}'})]
    assert _stream(plan("none", tools), ["a", "b"]) == ("ab", [], False)
