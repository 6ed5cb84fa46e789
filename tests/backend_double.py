"""A gateway backend test double that records what reaches it, for in-process gateway tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI
from starlette.responses import Response

from loragate.gateway.app import create_app
from loragate.gateway.proxy import ProxyClient
from loragate.gateway.runtime import server_options
from loragate.settings import Settings


@dataclass
class RecordingBackend:
    """Answers every request at once and keeps each payload it was given."""

    models: list[str] = field(default_factory=lambda: ["base", "pong"])
    forwarded: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def model_ids(self) -> list[str]:
        return list(self.models)

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok", "models": self.model_ids()}

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        self.forwarded.append((path, dict(payload)))
        answer = {
            "id": request_id,
            "object": "chat.completion",
            "model": public_model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        }
        return Response(orjson.dumps(answer), media_type="application/json")


class ProxiedBackend:
    """A GatewayBackend that sends requests to a fake engine through the real ProxyClient."""

    def __init__(
        self, base_url: str, models: list[str], supervisor: Any = None, manager: Any = None
    ) -> None:
        self.base_url = base_url
        self.models = models
        self.supervisor = supervisor
        self.manager = manager
        self.proxy = ProxyClient()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        await self.proxy.aclose()

    def model_ids(self) -> list[str]:
        return self.models

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok"}

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        return await self.proxy.forward(
            self.base_url + path,
            orjson.dumps(payload),
            {"Content-Type": "application/json", "X-Request-Id": request_id},
            stream=stream,
            rename=None,
            on_done=lambda: None,
            response_headers={"X-Request-ID": request_id},
        )


def settings_for(cache_dir: Path, **values: Any) -> Settings:
    """Settings that keep everything the gateway writes inside ``cache_dir``."""
    return Settings(cache_dir=cache_dir, **values)


def app_with(backend: RecordingBackend, settings: Settings) -> FastAPI:
    return create_app(settings, backend=backend)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(app: FastAPI, *, as_served: bool = False) -> Iterator[str]:
    """Run ``app`` under uvicorn on a free loopback port in a thread; yields its URL.

    ``as_served``: with the options ``gateway serve`` gives uvicorn (its hot-route protocol).
    """
    port = free_port()
    options = server_options(app) if as_served else {}
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
