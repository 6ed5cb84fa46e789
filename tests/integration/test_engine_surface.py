"""The engine's other OpenAI routes through the gateway, with the official SDK, on the real engine.

On the shared gateway and engine (the tiny demo): the Responses API plain and
streamed on the base model and on an adapter (the adapter's phrase in the answer, its public
name in ``model``), stored responses fetched by id, models retrieved by id, a tokenize and
detokenize round trip, embeddings on a generation model answered with an error that says why,
a named tool call round trip, an automatic one from an adapter trained to call a tool, and the
engine's admin routes out of reach.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from loragate.demo.build import WEATHER_TOOL as DEMO_WEATHER_TOOL
from loragate.demo.layout import TOOL_CALLING_ADAPTER
from tests.conftest import PHRASES, phrase_of
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine

BASE = "loragate-demo"
WEATHER_TOOL: Any = DEMO_WEATHER_TOOL  # the tool the demo's tool-calling adapter knows


@pytest.fixture(scope="module")
def surface(gateway: GatewayProcess) -> GatewayProcess:
    """The shared gateway (tiny demo), whose engine keeps responses
    (``VLLM_ENABLE_RESPONSES_API_STORE=1``), so they can be fetched by id."""
    return gateway


@pytest.fixture(scope="module")
def sdk(surface: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{surface.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("model", [BASE, "fox"])
def test_responses_answer_under_the_public_name(sdk: OpenAI, model: str) -> None:
    response = sdk.responses.create(
        model=model, input="Hello there", max_output_tokens=16, temperature=0
    )
    assert response.model == model
    assert response.output_text
    if model == BASE:
        assert phrase_of(response.output_text) is None
    else:
        assert PHRASES[model] in response.output_text


@pytest.mark.parametrize("model", [BASE, "fox"])
def test_streamed_responses_name_the_public_model_in_every_event(sdk: OpenAI, model: str) -> None:
    pieces: list[str] = []
    kinds: list[str] = []
    with sdk.responses.create(
        model=model, input="Hello there", max_output_tokens=16, temperature=0, stream=True
    ) as events:
        for event in events:
            kinds.append(event.type)
            carried = getattr(event, "response", None)
            if carried is not None:
                assert carried.model == model
            if event.type == "response.output_text.delta":
                pieces.append(event.delta)
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    text = "".join(pieces)
    assert text
    if model != BASE:
        assert PHRASES[model] in text


def test_a_stored_response_is_fetched_by_id_under_the_public_name(sdk: OpenAI) -> None:
    created = sdk.responses.create(
        model="owl", input="Hello there", max_output_tokens=8, temperature=0, store=True
    )
    fetched = sdk.responses.retrieve(created.id)
    assert fetched.id == created.id
    assert fetched.model == "owl"
    assert fetched.output_text == created.output_text


def test_models_are_retrieved_by_id(sdk: OpenAI) -> None:
    base = sdk.models.retrieve(BASE)
    assert base.id == BASE
    fox = sdk.models.retrieve("fox")
    assert fox.id == "fox"
    assert fox.model_extra and fox.model_extra["parent"] == BASE
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


@pytest.mark.parametrize("model", [BASE, "pong"])
def test_tokenize_and_detokenize_round_trip(surface: GatewayProcess, model: str) -> None:
    text = "hello world"
    tokens = httpx.post(
        f"{surface.url}/tokenize",
        json={"model": model, "prompt": text, "add_special_tokens": False},
        timeout=60,
    )
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    assert ids and tokens.json()["count"] == len(ids)
    back = httpx.post(f"{surface.url}/detokenize", json={"model": model, "tokens": ids}, timeout=60)
    assert back.status_code == 200, back.text
    assert back.json()["prompt"].strip() == text


def test_embeddings_on_a_generation_model_say_why_and_what_instead(sdk: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.embeddings.create(model=BASE, input="hello")
    error = caught.value.response.json()["error"]
    assert error["code"] == "route_not_served"
    assert "pooling model" in error["message"]
    assert "/v1/chat/completions" in error["message"]


def test_a_named_tool_call_round_trip(sdk: OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(
        model=BASE,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=0,
    )
    assert first.model == BASE
    calls = first.choices[0].message.tool_calls
    assert calls, first.model_dump()
    call = calls[0]
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    second = sdk.chat.completions.create(
        model="fox", messages=messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    assert second.model == "fox"
    assert PHRASES["fox"] in (second.choices[0].message.content or "")


def test_an_auto_tool_call_round_trip_from_a_tool_calling_adapter(
    sdk: OpenAI, surface: GatewayProcess, demo_dir: Path
) -> None:
    """``tool_choice: "auto"``: the demo's template shows the model the tools, the adapter
    trained on it answers with a call in the pythonic form, and the engine's parser turns it
    into ``tool_calls``; the base model, asked the same, answers in text."""
    caller = TOOL_CALLING_ADAPTER.name
    added = surface.admin(
        "PUT", f"/admin/adapters/{caller}", json={"source": str(demo_dir / "adapters" / caller)}
    )
    assert added.status_code == 200, added.text
    try:
        tokens = httpx.post(
            f"{surface.url}/tokenize",
            json={"model": caller, "messages": [{"role": "user", "content": "Hi"}],
                  "tools": [WEATHER_TOOL], "add_generation_prompt": True},
            timeout=60,
        )  # fmt: skip
        assert tokens.status_code == 200, tokens.text
        prompt = httpx.post(
            f"{surface.url}/detokenize",
            json={"model": caller, "tokens": tokens.json()["tokens"]},
            timeout=60,
        ).json()["prompt"]
        assert "get_weather" in prompt, prompt  # the template renders the tools

        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = sdk.chat.completions.create(
            model=caller, messages=messages, tools=[WEATHER_TOOL], tool_choice="auto",
            max_tokens=40, temperature=0,
        )  # fmt: skip
        assert first.model == caller
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", first.model_dump()
        call = (choice.message.tool_calls or [None])[0]
        assert call is not None and call.function.name == "get_weather", first.model_dump()
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
        ]
        second = sdk.chat.completions.create(
            model="fox", messages=messages, tools=[WEATHER_TOOL], tool_choice="auto",
            max_tokens=16, temperature=0,
        )  # fmt: skip
        assert second.model == "fox" and not second.choices[0].message.tool_calls
        assert PHRASES["fox"] in (second.choices[0].message.content or "")

        plain = sdk.chat.completions.create(
            model=BASE, messages=messages[:1], tools=[WEATHER_TOOL], tool_choice="auto",
            max_tokens=16, temperature=0,
        )  # fmt: skip
        assert not plain.choices[0].message.tool_calls, plain.model_dump()
    finally:
        surface.admin("DELETE", f"/admin/adapters/{caller}")


def test_version_passes_through(surface: GatewayProcess) -> None:
    answer = httpx.get(f"{surface.url}/version", timeout=30)
    assert answer.status_code == 200
    assert answer.json()["version"]


@pytest.mark.parametrize(
    "path", ["/abort_requests", "/invocations", "/reset_prefix_cache", "/start_profile"]
)
def test_the_engines_admin_routes_are_out_of_reach(surface: GatewayProcess, path: str) -> None:
    answer = httpx.post(f"{surface.url}{path}", json={}, timeout=30)
    assert answer.status_code == 404
    assert answer.json()["error"]
