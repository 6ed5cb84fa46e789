"""A gateway backend test double that records what reaches it, for in-process gateway tests."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI
from starlette.responses import Response

from loragate.adapters.stats import AdapterStats
from loragate.engine_states import EngineSnapshot, EngineState
from loragate.fetching.progress import ProgressBoard
from loragate.gateway.app import create_app
from loragate.gateway.backends.managed import ManagedBackend
from loragate.gateway.proxy import ProxyClient
from loragate.gateway.server.serve import GatewayServer
from loragate.serving.engine_metrics import scrape_engine_metrics
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
        return True, {"status": "healthy", "models": self.model_ids()}

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


class AdapterManagerDouble:
    """The adapter manager's admin surface; records each change it is asked for."""

    base_name = "base"

    def __init__(self) -> None:
        self.changes: list[tuple[str, ...]] = []
        self.progress = ProgressBoard()

    def describe(self, name: str) -> dict[str, Any]:
        for adapter in self.list():
            if adapter["name"] == name:
                return adapter
        raise KeyError(name)

    def list(self) -> list[dict[str, Any]]:
        return [{"name": "pong", "version": "0" * 64, "state": "serving", "source": "/pong"}]

    def public_models(self) -> list[str]:
        return [self.base_name, *(adapter["name"] for adapter in self.list())]

    def manifest_names(self) -> set[str]:
        return set()

    def store_size(self) -> int:
        return 0

    def stats(self, store_bytes: int) -> AdapterStats:
        return adapter_stats(store_bytes=store_bytes)

    def model_preset(self, name: str) -> dict[str, Any] | None:
        return None

    async def put(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        *,
        preset: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.changes.append(("put", name, source))
        return {"name": name, "version": "1" * 64, "state": "serving"}

    async def remove(self, name: str) -> None:
        self.changes.append(("remove", name))

    async def rollback(self, name: str) -> dict[str, Any]:
        self.changes.append(("rollback", name))
        return {"name": name, "version": "0" * 64, "state": "serving"}


def engine_snapshot(**values: Any) -> EngineSnapshot:
    """A ready engine's snapshot, with ``values`` changed."""
    ready = EngineSnapshot(
        state=EngineState.READY,
        reason="engine answers /health",
        since=0.0,
        boot_progress=None,
        pid=None,
        launcher_pid=None,
        uptime_s=None,
        restarts=0,
        last_exit=None,
        last_exit_at=None,
        waiting_requests=0,
        log_file=Path("/nonexistent/engine.log"),
    )
    return dataclasses.replace(ready, **values)


def adapter_stats(**values: Any) -> AdapterStats:
    """An adapter manager's counters, all zero but ``values``."""
    zero = AdapterStats(
        loads=0,
        swaps=0,
        load_failures=0,
        unloads=0,
        store_repairs=0,
        last_load_seconds=None,
        served=0,
        store_bytes=0,
        store_evictions=0,
    )
    return dataclasses.replace(zero, **values)


class EngineSupervisorDouble:
    """The supervisor as the admin routes and /metrics see it: ready, never restarted."""

    serving = False  # so /metrics does not scrape an engine
    endpoint = None
    asleep = False
    boot_progress = None

    def __init__(self) -> None:
        self.restart_requests = 0
        self.log_path = Path("/nonexistent/engine.log")

    @property
    def state(self) -> EngineState:
        return self.snapshot().state

    @property
    def reason(self) -> str:
        return self.snapshot().reason

    def snapshot(self) -> EngineSnapshot:
        return engine_snapshot(log_file=self.log_path)

    def info(self) -> dict[str, Any]:
        return self.snapshot().as_dict()

    async def restart(self) -> None:
        self.restart_requests += 1


# A cache directory a double never writes: constructing a backend touches no file.
_NOWHERE = Path("/nonexistent/loragate-backend-double")


class ManagedBackendDouble(RecordingBackend, ManagedBackend):
    """A backend with the managed engine's admin routes, answered by doubles: the admin
    API runs for real (keys, bodies, routes, the catalog of one and its model's runtime) and
    nothing is spawned, locked or written."""

    def __init__(self) -> None:
        RecordingBackend.__init__(self)
        # Built as the gateway builds it (nothing is spawned, locked or written until start),
        # then its one model's engine and adapters swapped for doubles.
        ManagedBackend.__init__(
            self, Settings(cache_dir=_NOWHERE, model_name=AdapterManagerDouble.base_name)
        )
        (self.runtime,) = self.catalog.entries.values()
        self.adapters = AdapterManagerDouble()
        self.supervisor = EngineSupervisorDouble()
        self.runtime._prepared.set()
        self.starts = 0
        self.stops = 0

    @property
    def adapters(self) -> Any:
        """The model's adapter manager (a test may swap in another, a real one)."""
        return self.runtime.manager

    @adapters.setter
    def adapters(self, manager: Any) -> None:
        self.runtime.manager = manager

    @property
    def supervisor(self) -> Any:
        """The model's engine supervisor (a test may swap in another, a real one)."""
        return self.runtime.supervisor

    @supervisor.setter
    def supervisor(self, supervisor: Any) -> None:
        self.runtime.supervisor = supervisor

    async def start(self) -> None:
        self.starts += 1

    async def stop(self) -> None:
        self.stops += 1

    def start_report(self) -> dict[str, Any] | None:
        return None  # nothing to prepare or boot

    def health(self) -> tuple[bool, dict[str, Any]]:
        if not self.starts:
            return False, {"status": "starting"}
        return True, {"status": "healthy", "models": self.model_ids()}

    def max_model_len(self) -> int | None:
        return None  # no engine has booted to say

    def changed_anything(self) -> bool:
        return bool(self.adapters.changes or self.supervisor.restart_requests or self.forwarded)


class ProxiedBackend:
    """A GatewayBackend that sends requests to a fake engine through the real ProxyClient."""

    def __init__(
        self,
        base_url: str,
        models: list[str],
        engine: EngineSnapshot | None = None,
        adapters: AdapterStats | None = None,
        engine_url: str | None = None,
    ) -> None:
        """``engine`` and ``adapters``: what it reports, as the managed backend does, with
        the engine's own /metrics scraped from ``engine_url`` while ``engine`` serves."""
        self.base_url = base_url
        self.models = models
        self.engine = engine
        self.adapters = adapters
        self.engine_url = engine_url
        self.rename_engine_ids: Callable[[bytes], bytes] | None = None
        self.proxy = ProxyClient()

    def engine_snapshot(self) -> EngineSnapshot | None:
        return self.engine

    async def adapter_stats(self) -> AdapterStats | None:
        return self.adapters

    async def engine_metrics(self) -> bytes | None:
        if self.engine is None or not self.engine.serving or self.engine_url is None:
            return None
        address = SimpleNamespace(base_url=self.engine_url, headers={}, uds=None)
        return await scrape_engine_metrics(address, self.rename_engine_ids)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        await self.proxy.aclose()

    def model_ids(self) -> list[str]:
        return self.models

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "healthy"}

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
    """Run ``app`` on a free loopback port in a thread; yields its URL.

    ``as_served``: on ``gateway serve``'s own server (``loragate.gateway.server``: its
    connection limits, and its hot routes unless CORS is on); else under plain uvicorn, as an
    embedding user would run ``create_server()``.
    """
    port = free_port()
    thread: threading.Thread
    if as_served:
        settings = app.state.gateway.settings
        gateway = None if settings.cors_origins else app.state.gateway
        server = GatewayServer(
            app, settings, host="127.0.0.1", port=port, drain_timeout=5, gateway=gateway
        )
        thread = threading.Thread(target=lambda: server.run(install_signals=False), daemon=True)
        started: Callable[[], bool] = server.started.is_set
        stop: Callable[[], None] = server.request_stop
    else:
        plain = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        thread = threading.Thread(target=plain.run, daemon=True)
        started = lambda: bool(plain.started)  # noqa: E731
        stop = lambda: setattr(plain, "should_exit", True)  # noqa: E731
    thread.start()
    deadline = time.monotonic() + 10
    while not started():
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop()
        thread.join(10)
