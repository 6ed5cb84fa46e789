"""The upstream backend: models, health and names from an OpenAI-compatible server (a local one)."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from loragate.gateway.backends.upstream import UpstreamBackend, split_upstream_url
from loragate.settings import Settings
from tests.backend_double import free_port

MODELS = {
    "object": "list",
    "data": [
        {"id": "lora-a", "object": "model", "parent": "org/base-7b"},
        {"id": "org/base-7b", "object": "model", "parent": None},
    ],
}


def backend(tmp_path: Path, url: str, **options: Any) -> UpstreamBackend:
    return UpstreamBackend(Settings(upstream_url=url, cache_dir=tmp_path, **options))


def test_upstream_url_is_taken_with_or_without_v1() -> None:
    assert split_upstream_url("http://h:1/v1/") == ("http://h:1/v1", "http://h:1")
    assert split_upstream_url("https://h/api") == ("https://h/api/v1", "https://h/api")
    for bad in ("h:1", "http://", "http://h:abc/v1", "http://h:70000"):
        with pytest.raises(ValueError, match="http"):
            split_upstream_url(bad)


def test_settings_refuse_an_upstream_url_that_is_not_http(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="upstream_url"):
        Settings(upstream_url="localhost:8000", cache_dir=tmp_path)


class FakeUpstream(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server that records what it was sent."""

    protocol_version = "HTTP/1.1"
    received: ClassVar[list[tuple[str, dict[str, str], bytes]]] = []
    models: ClassVar[tuple[int, object]] = (200, MODELS)
    health: ClassVar[tuple[int, object]] = (200, {})

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.received.append((self.path, dict(self.headers), b""))
        self._answer(*(self.models if self.path == "/v1/models" else self.health))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, dict(self.headers), body))
        model = json.loads(body)["model"]
        self._answer(200, {"object": "chat.completion", "model": model, "choices": []})

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving_upstream() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeUpstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeUpstream.received.clear()
    FakeUpstream.models, FakeUpstream.health = (200, MODELS), (200, {})
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_upstream() -> Iterator[str]:
    with serving_upstream() as url:
        yield url


async def test_models_come_from_the_upstream_base_first(tmp_path: Path, fake_upstream: str) -> None:
    upstream = backend(tmp_path, fake_upstream, upstream_api_key="sk-up")
    await upstream.refresh()
    assert upstream.model_ids() == ["org/base-7b", "lora-a"]
    assert upstream.health() == (True, {"status": "healthy", "models": ["org/base-7b", "lora-a"]})
    asked = {path: headers.get("Authorization") for path, headers, _ in FakeUpstream.received}
    assert asked == {"/v1/models": "Bearer sk-up", "/health": "Bearer sk-up"}
    await upstream.stop()


async def test_health_follows_the_upstream_health_route(tmp_path: Path, fake_upstream: str) -> None:
    FakeUpstream.health = (503, {"status": "starting"})
    upstream = backend(tmp_path, fake_upstream)
    await upstream.refresh()
    ready, body = upstream.health()
    assert not ready and "503" in body["reason"]
    await upstream.stop()


async def test_without_a_health_route_answering_models_is_healthy(
    tmp_path: Path, fake_upstream: str
) -> None:
    FakeUpstream.health = (404, {"detail": "Not Found"})
    upstream = backend(tmp_path, fake_upstream)
    await upstream.refresh()
    assert upstream.health()[0]
    await upstream.stop()


async def test_a_models_route_that_fails_is_not_ready_with_its_answer(
    tmp_path: Path, fake_upstream: str
) -> None:
    FakeUpstream.models = (401, {"error": {"message": "bad key"}})
    upstream = backend(tmp_path, fake_upstream)
    await upstream.refresh()
    ready, body = upstream.health()
    assert not ready and "401" in body["reason"] and "bad key" in body["reason"]
    await upstream.stop()


async def test_unreachable_upstream_is_not_ready_and_keeps_known_models(tmp_path: Path) -> None:
    with serving_upstream() as url:
        upstream = backend(tmp_path, url)
        await upstream.refresh()
    await upstream.refresh()  # the server is gone: its port refuses
    ready, body = upstream.health()
    assert not ready and "unreachable" in body["reason"]
    assert upstream.model_ids() == ["org/base-7b", "lora-a"]
    await upstream.stop()


async def test_an_upstream_that_never_answers_times_out(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts (the kernel does) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        upstream = backend(tmp_path, url, probe_timeout=0.2)
        started = time.monotonic()
        await upstream.refresh()
        assert time.monotonic() - started < 2
    ready, body = upstream.health()
    assert not ready and "within 0.2 s" in body["reason"]
    await upstream.stop()


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
    [(path, headers, body)] = [sent for sent in FakeUpstream.received if sent[2]]
    assert path == "/v1/chat/completions"
    assert json.loads(body)["model"] == "org/base-7b"
    assert headers["Authorization"] == "Bearer sk-up"
    assert json.loads(bytes(response.body))["model"] == "base"
    assert response.headers["x-request-id"] == "req-1"
    await upstream.forward("/v1/chat/completions", {"model": "lora-a"}, "lora-a", False, "req-2")
    assert json.loads(FakeUpstream.received[-1][2])["model"] == "lora-a"
    await upstream.stop()


async def test_upstream_credentials_are_never_shown(tmp_path: Path) -> None:
    # http://user:password@host/v1 (and a ?key= query): the public /health and a client's
    # error name the upstream with its secrets as ***.
    from loragate.gateway.app import create_app

    upstream_server = serving_upstream()
    url = upstream_server.__enter__()
    secret_url = url.replace("http://", "http://ops:pa55w0rd-upstream@")
    app = create_app(Settings(upstream_url=secret_url, cache_dir=tmp_path, host="127.0.0.1"))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
        ) as client,
    ):
        assert (await client.get("/health")).status_code == 200
        upstream_server.__exit__(None, None, None)  # gone: its port refuses from now on
        await app.state.gateway.backend.refresh()
        health = await client.get("/health")
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "lora-a", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert health.status_code == 503 and "unreachable" in health.json()["reason"]
    assert chat.status_code == 503 and "upstream server http://***@127.0.0.1:" in chat.text
    for shown in (health.text, chat.text):
        assert "pa55w0rd-upstream" not in shown and "ops:" not in shown, shown

    query_url = f"http://127.0.0.1:{free_port()}/v1?api_key=sekrit-in-query"
    keyed = backend(tmp_path, query_url, probe_timeout=0.5)
    await keyed.refresh()
    ready, body = keyed.health()
    assert not ready and "sekrit-in-query" not in json.dumps(body) and "?***" in body["reason"]
    await keyed.stop()
