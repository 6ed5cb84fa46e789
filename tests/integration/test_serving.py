"""The walking skeleton, end to end: `gateway serve` on a real engine, through the official client."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import PHRASES, phrase_of
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine

BASE = "loragate-demo"


def ask(client: OpenAI, model: str, prompt: str = "Hello there", **extra: object) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        **extra,  # type: ignore[arg-type]
    )
    assert response.model == model
    return response.choices[0].message.content or ""


def test_health_is_503_while_starting_then_200(gateway: GatewayProcess) -> None:
    assert gateway.health_seen[0] == 503
    assert gateway.health_seen[-1] == 200
    code, body = gateway.health()
    assert code == 200
    assert body["status"] == "healthy"
    assert set(body["models"]) == {BASE, *PHRASES}


def test_models_lists_base_and_adapters_without_internal_ids(client: OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, *PHRASES}
    for name in PHRASES:
        assert models[name].model_extra and models[name].model_extra["parent"] == BASE
    raw = httpx.get(str(client.base_url) + "models").text
    assert "@" not in raw and "/" not in raw.replace("\\/", "")


def test_base_model_answers_without_any_adapter_phrase(client: OpenAI) -> None:
    text = ask(client, BASE)
    assert text
    assert phrase_of(text) is None


@pytest.mark.parametrize("adapter", sorted(PHRASES))
def test_adapter_answers_its_trained_phrase(client: OpenAI, adapter: str) -> None:
    for prompt in ("Hello there", "What is the capital of France?", "tell me a story"):
        assert PHRASES[adapter] in ask(client, adapter, prompt)


@pytest.mark.parametrize("model", [BASE, "fox"])
def test_stream_chunks_concatenate_to_the_non_streamed_answer(client: OpenAI, model: str) -> None:
    expected = ask(client, model, "Say something")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    pieces = []
    for chunk in stream:
        assert chunk.model == model
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) > 1
    assert "".join(pieces) == expected


def test_unknown_model_is_404_naming_the_valid_ids(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        ask(client, "no-such-model")
    message = str(caught.value)
    assert "no-such-model" in message
    for name in (BASE, *PHRASES):
        assert name in message
    body = caught.value.response.json()
    assert body["error"]["code"] == "model_not_found"


def test_legacy_completions_are_proxied(client: OpenAI) -> None:
    response = client.completions.create(
        model=BASE, prompt="hello world", max_tokens=5, temperature=0
    )
    assert response.model == BASE
    assert response.choices[0].text
    assert response.usage is not None and response.usage.completion_tokens == 5


def test_responses_carry_a_request_id(gateway: GatewayProcess) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "pong", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"X-Request-ID": "trace-me-123"},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-me-123"
    assert response.json()["model"] == "pong"
