"""`gateway serve` bounds its connections: past ``limit_concurrency``, a 503 at once."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from loragate import cli
from loragate.gateway.app import create_app
from loragate.gateway.server_options import server_options
from loragate.settings import Settings
from tests.backend_double import RecordingBackend, free_port, serving, settings_for

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}


def test_connections_are_bounded_by_default(tmp_path: Path) -> None:
    default = Settings(cache_dir=tmp_path).limit_concurrency
    assert default is not None and 64 <= default <= 4096
    app = create_app(settings_for(tmp_path), backend=RecordingBackend())
    assert server_options(app)["limit_concurrency"] == default


@pytest.mark.parametrize("extra", [[], ["--limit-concurrency", "7"]], ids=["default", "flag"])
def test_serve_gives_uvicorn_the_connection_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    captured: dict[str, Any] = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **options: captured.update(options))
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
    assert captured["limit_concurrency"] == expected


def test_past_the_limit_a_new_request_gets_a_503_on_the_hot_path(tmp_path: Path) -> None:
    backend = RecordingBackend()
    app = create_app(settings_for(tmp_path, limit_concurrency=3), backend=backend)
    with serving(app, as_served=True) as url:
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            with httpx.Client(timeout=10) as client:
                response = client.post(f"{url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 503
        finally:
            for sock in idle:
                sock.close()
        # Once the server has seen the idle ones close, requests are answered again.
        deadline = time.monotonic() + 10
        while (status := _post(url)) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
    assert len(backend.forwarded) == 1


def _post(url: str) -> int:
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10).status_code
