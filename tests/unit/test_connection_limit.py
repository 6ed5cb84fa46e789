"""`gateway serve` bounds the requests it answers at once: past ``limit_concurrency``, an
OpenAI-style 503 at once. Idle connections do not count (the header deadline closes them),
and the health probes are answered however busy the gateway is."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import Response
from typer.testing import CliRunner

from loragate import cli
from loragate.gateway.app import create_app
from loragate.gateway.server.serve import GatewayServer
from loragate.settings import Settings
from tests.backend_double import RecordingBackend, free_port, serving, settings_for

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}


def test_requests_are_bounded_by_default_by_the_server_counting_requests(tmp_path: Path) -> None:
    default = Settings(cache_dir=tmp_path).limit_concurrency
    assert 64 <= default <= 4096
    app = create_app(settings_for(tmp_path), backend=RecordingBackend())
    server = GatewayServer(app, app.state.gateway.settings)
    assert server.state.limits.limit_concurrency == default
    assert server.state.active == 0  # requests being answered, not sockets


@pytest.mark.parametrize("extra", [[], ["--limit-concurrency", "7"]], ids=["default", "flag"])
def test_serve_gives_the_protocol_the_request_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    captured: dict[str, Any] = {}
    monkeypatch.setattr(
        "loragate.gateway.server.serve.serve_app",
        lambda app, settings: captured.update(settings=settings),
    )
    monkeypatch.setattr("gc.freeze", lambda: None)
    result = CliRunner().invoke(
        cli.app,
        [
            "serve",
            "--upstream-url", "http://127.0.0.1:9/v1",  # no engine to boot
            "--port", str(free_port()),
            "--cache-dir", str(tmp_path),
            *extra,
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    expected = 7 if extra else Settings(cache_dir=tmp_path).limit_concurrency
    assert captured["settings"].limit_concurrency == expected


class HeldBackend(RecordingBackend):
    """Answers once the test lets it: the requests it holds are in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = 0
        self.release = threading.Event()

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        self.holding += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return await super().forward(path, payload, public_model, stream, request_id)


@pytest.mark.parametrize("cors", [False, True], ids=["hot path", "asgi (cors on)"])
def test_past_the_limit_a_request_gets_a_503_and_the_probes_still_answer(
    tmp_path: Path, cors: bool
) -> None:
    backend = HeldBackend()
    values: dict[str, Any] = {"cors_origins": ["https://app.example"]} if cors else {}
    app = create_app(settings_for(tmp_path, limit_concurrency=2, **values), backend=backend)
    with serving(app, as_served=True) as url, ThreadPoolExecutor(2) as pool:
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(8)]
        try:
            held = [pool.submit(_post, url) for _ in range(2)]
            deadline = time.monotonic() + 10
            while backend.holding < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert backend.holding == 2  # eight idle sockets took no slot
            busy = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
            assert busy.status_code == 503
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "concurrency_limit"
            assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            backend.release.set()
            assert [future.result(10) for future in held] == [200, 200]
            assert _post(url) == 200  # the slots are free again
        finally:
            backend.release.set()
            for sock in idle:
                sock.close()
    assert len(backend.forwarded) == 3


def _post(url: str) -> int:
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10).status_code
