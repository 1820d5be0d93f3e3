"""schemathesis runs the OpenAI door's own OpenAPI schema (``app.openapi()``) in-process on the
ASGI app, with an API key configured, in front of a fake router (tests/openai/door_fakes.py):
no 5xx, every status, header and body as documented, invalid data refused and valid data
accepted, 405 with ``Allow``, and 401 without the key (schemathesis' default checks).
Derandomized (a fixed seed per operation), no example database, bounded to well under a minute.

The app exists at import (schemathesis parametrizes from it); the fake router it calls starts
on its port in a fixture, before the first request opens the door's channel."""

from __future__ import annotations

import pytest
import schemathesis
from door_fakes import FAKE_MODEL, fake_router
from hypothesis import HealthCheck, settings

from openai_service.app import create_app
from openai_service.config import OpenAIConfig
from services.ports import free_port

KEY = "sk-schemathesis-test-key"
ROUTER_PORT = free_port()
APP = create_app(OpenAIConfig(router=f"127.0.0.1:{ROUTER_PORT}", port=0, api_key=KEY, served_model_name=FAKE_MODEL))
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


@pytest.fixture(scope="module", autouse=True)
def router():
    with fake_router(ROUTER_PORT) as (_, servicer):
        yield servicer


@schema.parametrize()
@settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_door_answers_as_its_schema_says(case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"})

