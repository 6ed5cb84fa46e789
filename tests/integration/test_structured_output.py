"""Structured outputs on the real engine: the schema constrains what the demo model writes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from openai.types.shared_params import ResponseFormatJSONSchema

from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine

BASE = "loragate-demo"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: ResponseFormatJSONSchema = {
    "type": "json_schema",
    "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
}


def content_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def post(gateway: GatewayProcess, body: dict[str, Any]) -> httpx.Response:
    request = {"max_tokens": 64, "temperature": 0, **body}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=request, timeout=120)


@pytest.mark.parametrize("model", [BASE, "pong"])
def test_json_schema_output_validates_against_the_schema(client: OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick a colour and a number."}],
        response_format=RESPONSE_FORMAT,
        max_tokens=64,
        temperature=0,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)


def test_json_schema_constrains_a_vi_request_too(gateway: GatewayProcess) -> None:
    body = {"model": BASE, "user_prompt": "Pick one.", "response_format": RESPONSE_FORMAT}
    jsonschema.validate(json.loads(content_of(post(gateway, body))), SCHEMA)


def test_json_schema_constrains_a_stream(gateway: GatewayProcess) -> None:
    body = {
        "model": BASE,
        "messages": [{"role": "user", "content": "Pick"}],
        "response_format": RESPONSE_FORMAT,
        "stream": True,
        "max_tokens": 64,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        events = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_old_guided_json_still_constrains_the_output(gateway: GatewayProcess) -> None:
    body = {"model": BASE, "messages": [{"role": "user", "content": "Pick"}], "guided_json": SCHEMA}
    jsonschema.validate(json.loads(content_of(post(gateway, body))), SCHEMA)


def test_json_object_constrains_the_output_to_start_an_object(gateway: GatewayProcess) -> None:
    # The random demo model never closes a free-form object, but it can only open one.
    body = {
        "model": BASE,
        "messages": [{"role": "user", "content": "Reply in JSON."}],
        "response_format": {"type": "json_object"},
        "max_tokens": 8,
    }
    assert content_of(post(gateway, body)).startswith("{")


def test_schema_that_is_not_json_schema_is_400_before_the_engine(client: OpenAI) -> None:
    bad: dict[str, Any] = {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": "zero"}},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": "Pick"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
            max_tokens=8,
        )
    error = caught.value.response.json()["error"]
    assert error["code"] == "invalid_json_schema"
    assert error["param"] == "response_format.json_schema.schema"
    assert "minimum" in error["message"]
