"""The upstream backend: models, health and names from an OpenAI-compatible server (respx)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import respx

from loragate.gateway.upstream_backend import UpstreamBackend, split_upstream_url
from loragate.settings import Settings

ROOT = "http://upstream.test:9000"
MODELS = {
    "object": "list",
    "data": [
        {"id": "lora-a", "object": "model", "parent": "org/base-7b"},
        {"id": "org/base-7b", "object": "model", "parent": None},
    ],
}


def backend(tmp_path: Path, **options: Any) -> UpstreamBackend:
    return UpstreamBackend(Settings(upstream_url=f"{ROOT}/v1", cache_dir=tmp_path, **options))


def test_upstream_url_is_taken_with_or_without_v1() -> None:
    assert split_upstream_url("http://h:1/v1/") == ("http://h:1/v1", "http://h:1")
    assert split_upstream_url("https://h/api") == ("https://h/api/v1", "https://h/api")
    with pytest.raises(ValueError, match="http"):
        split_upstream_url("h:1")


def test_settings_refuse_an_upstream_url_that_is_not_http(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="upstream_url"):
        Settings(upstream_url="localhost:8000", cache_dir=tmp_path)


@respx.mock
async def test_models_come_from_the_upstream_base_first(tmp_path: Path) -> None:
    respx.get(f"{ROOT}/v1/models").respond(json=MODELS)
    respx.get(f"{ROOT}/health").respond(200)
    upstream = backend(tmp_path)
    await upstream.refresh()
    assert upstream.model_ids() == ["org/base-7b", "lora-a"]
    assert upstream.health() == (True, {"status": "ok", "models": ["org/base-7b", "lora-a"]})
    await upstream.stop()


@respx.mock
async def test_health_follows_the_upstream_health_route(tmp_path: Path) -> None:
    respx.get(f"{ROOT}/v1/models").respond(json=MODELS)
    respx.get(f"{ROOT}/health").respond(503, json={"status": "starting"})
    upstream = backend(tmp_path)
    await upstream.refresh()
    ready, body = upstream.health()
    assert not ready and "503" in body["reason"]
    await upstream.stop()


@respx.mock
async def test_without_a_health_route_answering_models_is_healthy(tmp_path: Path) -> None:
    respx.get(f"{ROOT}/v1/models").respond(json=MODELS)
    respx.get(f"{ROOT}/health").respond(404)
    upstream = backend(tmp_path)
    await upstream.refresh()
    assert upstream.health()[0]
    await upstream.stop()


@respx.mock
async def test_unreachable_upstream_is_not_ready_and_keeps_known_models(tmp_path: Path) -> None:
    models = respx.get(f"{ROOT}/v1/models").respond(json=MODELS)
    respx.get(f"{ROOT}/health").respond(200)
    upstream = backend(tmp_path)
    await upstream.refresh()
    models.side_effect = httpx.ConnectError("refused")
    await upstream.refresh()
    ready, body = upstream.health()
    assert not ready and "unreachable" in body["reason"]
    assert upstream.model_ids() == ["org/base-7b", "lora-a"]
    await upstream.stop()


class FakeUpstream(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server that records what it was sent."""

    protocol_version = "HTTP/1.1"
    received: ClassVar[list[tuple[str, dict[str, str], bytes]]] = []

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(200, MODELS if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, dict(self.headers), body))
        model = json.loads(body)["model"]
        self._answer(200, {"object": "chat.completion", "model": model, "choices": []})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_upstream() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeUpstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeUpstream.received.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


async def test_model_name_aliases_the_base_model_both_ways(
    tmp_path: Path, fake_upstream: str
) -> None:
    settings = Settings(
        upstream_url=fake_upstream, model_name="base", upstream_api_key="sk-up", cache_dir=tmp_path
    )
    upstream = UpstreamBackend(settings)
    await upstream.refresh()
    assert upstream.model_ids() == ["base", "lora-a"]
    response = await upstream.forward(
        "/v1/chat/completions", {"model": "base", "messages": []}, "base", False, "req-1"
    )
    [(path, headers, body)] = FakeUpstream.received
    assert path == "/v1/chat/completions"
    assert json.loads(body)["model"] == "org/base-7b"
    assert headers["Authorization"] == "Bearer sk-up"
    assert json.loads(bytes(response.body))["model"] == "base"
    assert response.headers["x-request-id"] == "req-1"
    await upstream.forward("/v1/chat/completions", {"model": "lora-a"}, "lora-a", False, "req-2")
    assert json.loads(FakeUpstream.received[-1][2])["model"] == "lora-a"
    await upstream.stop()
