"""Structured output through the OpenAI door with the official ``openai`` client, on the real
SmolLM2: ``chat.completions.parse`` with a pydantic ``response_format`` returns a valid object,
a streamed ``json_schema`` response is valid JSON of the schema, and a schema the runner cannot
compile is a 400 naming ``response_format``."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


class Capital(BaseModel):
    country: str = Field(max_length=24)
    capital: str = Field(max_length=24)
    continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]
    population_millions: int = Field(ge=0, le=2000)


PROMPTS = ("Describe France as JSON.", "Give the capital of Japan as JSON.", "Tell me about Brazil in JSON.",
           "Kenya: country facts as JSON.", "JSON for Canada, please.", "What is Australia's capital? JSON only.",
           "Egypt as a JSON record.", "Output Germany's data in JSON.", "I need India's capital in JSON form.",
           "Mexico, as JSON.", "Give me a JSON object about Norway.", "Peru's capital and population as JSON.",
           "Describe New Zealand with JSON.", "Chile: answer with JSON.", "JSON about Vietnam.",
           "Italy in JSON format.", "Tell me the capital of Nigeria using JSON.", "Spain, JSON please.",
           "Return a JSON description of Argentina.", "Thailand facts as a JSON object.")


@pytest.fixture(scope="module")
def client(smollm2_door):
    with openai.OpenAI(base_url=smollm2_door.url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_response_format_returns_valid_objects(client, model) -> None:
    assert len(set(PROMPTS)) == 20
    for prompt in PROMPTS:
        completion = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": prompt}], response_format=Capital, max_tokens=128,
            temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Capital)
        assert Capital.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_streamed_json_schema_response_is_valid_json_of_the_schema(client, model) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "reason": {"type": "string", "maxLength": 40}},
              "required": ["answer", "reason"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], stream=True,
        max_tokens=60, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert "\n" not in text and "  " not in text.replace(json.loads(text)["reason"], "")  # no free whitespace


def test_a_schema_the_runner_cannot_compile_is_a_400_naming_response_format(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format" and "structured output" in e.value.body["message"]


def test_a_regex_and_a_choice_constrain_the_answer(client, model) -> None:
    """vLLM's extra keys through the official client's ``extra_body``."""
    import re

    date = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "When did the Berlin wall fall? Give the date."}],
        max_tokens=20, temperature=0, extra_body={"guided_regex": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"})
    assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", date.choices[0].message.content)
    assert date.choices[0].finish_reason == "stop"
    for seed in (1, 2, 3):
        pick = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Which is a fruit?"}], max_tokens=10,
            temperature=1.0, seed=seed, extra_body={"guided_choice": ["apple", "hammer", "cloud"]})
        assert pick.choices[0].message.content in ("apple", "hammer", "cloud")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}}, "required": ["tz"],
                   "additionalProperties": False}}}


def test_a_named_tool_choice_returns_arguments_that_validate_streamed_or_not(client, model) -> None:
    schema = WEATHER["function"]["parameters"]
    for city in ("Paris", "Tokyo", "Lima"):
        messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
        done = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        message = done.choices[0].message
        assert message.content is None and done.choices[0].finish_reason == "stop"
        (call,) = message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema)
        stream = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        deltas = [c.choices[0].delta.tool_calls for c in stream if c.choices and c.choices[0].delta.tool_calls]
        assert deltas[0][0].function.name == "get_weather" and deltas[0][0].id
        streamed = "".join(d[0].function.arguments or "" for d in deltas)
        assert streamed == call.function.arguments  # greedy: the same call, in fragments


def test_required_tool_choice_and_a_tool_result_round_trip(client, model) -> None:
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=80,
                                          temperature=0, tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    call = choice.message.tool_calls[0]
    follow = client.chat.completions.create(model=model, max_tokens=20, temperature=0, tools=[WEATHER, TIME], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "09:30"}])
    assert follow.choices[0].message.content and follow.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, max_tokens=5, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e.value.body["param"] == "tool_choice"
