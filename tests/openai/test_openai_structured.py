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


PROMPTS = ("Describe France as JSON.", "Give the capital of Japan as JSON.", "Tell me about Brazil in JSON.")


@pytest.fixture(scope="module")
def client(smollm2_door):
    with openai.OpenAI(base_url=smollm2_door.url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_response_format_returns_valid_objects(client, model) -> None:
    for prompt in PROMPTS:
        completion = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": prompt}], response_format=Capital, max_tokens=80,
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
