"""The admin routes go through the backend's admin interface (``backends.base.AdminBackend``):
the backend that has one owns the checks and answers its refusals, one without one gets a 404.

Each refusal is checked through the routes, with bodies sent as lazy streams that count what
the gateway pulled: a change refused before its body was read pulled nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate import GenerationResult, InferenceBackend
from loragate.adapters.fleet_reconciler import FleetReconciler
from loragate.gateway.app import create_app
from loragate.gateway.backends.base import AdminBackend, GatewayBackend
from loragate.gateway.backends.managed import ManagedBackend, ManagedCatalogBackend
from loragate.settings import Settings
from tests.backend_double import ManagedBackendDouble, engine_snapshot, settings_for
from tools.bench.fake_engine import FakeEngine, start_server

ADMIN_KEY = "the-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
SIGNED_MANIFEST = "https://ops:hunter22@fleet.example/adapters.json?sig=abc123"

# (method, path) of every admin route that changes the adapters; each takes a JSON body or none.
CHANGES = [
    ("PUT", "/admin/adapters/pong"),
    ("DELETE", "/admin/adapters/pong"),
    ("POST", "/admin/adapters/pong/rollback"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
]
ADMIN_ROUTES = [
    ("GET", "/admin/adapters"),
    ("GET", "/admin/adapters/pong"),
    *CHANGES,
    ("GET", "/admin/engine"),
    ("POST", "/admin/engine/restart"),
]


class CountedBody:
    """A JSON body made only as the gateway pulls it; ``pulled`` counts the chunks it took."""

    def __init__(self) -> None:
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in (b'{"source": "/pong", ', b'"lora_name": "pong", "lora_path": "/pong"}'):
            self.pulled += 1
            yield chunk


class EchoBackend(InferenceBackend):
    """A custom backend: it answers chat, and has no engine or adapters of the gateway's."""

    def available_models(self) -> list[str]:
        return ["echo"]

    async def generate(
        self,
        messages: list[dict[str, Any]],
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        return GenerationResult(text="echo")

    async def generate_stream(
        self,
        messages: list[dict[str, Any]],
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[str | None]:
        yield "echo"


@pytest.fixture
async def fake_engine() -> AsyncIterator[str]:
    server = await start_server(FakeEngine(api_key=None, models=["upstream-base"]))
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()
        await server.wait_closed()


async def call_app(
    settings: Settings,
    backend: GatewayBackend | InferenceBackend | None,
    ask: Callable[[httpx.AsyncClient], Any],
) -> Any:
    """``ask(client)`` against the app for ``settings`` and ``backend``, inside its lifespan
    (the backend started and stopped)."""
    app = create_app(settings, backend=backend)
    transport = httpx.ASGITransport(app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client,
    ):
        return await ask(client)


def send_each(routes: list[tuple[str, str]]) -> Callable[[httpx.AsyncClient], Any]:
    async def ask(client: httpx.AsyncClient) -> list[tuple[httpx.Response, CountedBody]]:
        answers = []
        for method, path in routes:
            body = CountedBody()
            content = body if method in ("PUT", "POST") else None
            answers.append(
                (await client.request(method, path, content=content, headers=ADMIN), body)
            )
        return answers

    return ask


async def test_an_upstream_backend_has_no_admin_interface_every_admin_route_answers_404(
    tmp_path: Path, fake_engine: str
) -> None:
    settings = settings_for(tmp_path, admin_key=ADMIN_KEY, upstream_url=fake_engine)
    answers = await call_app(settings, None, send_each(ADMIN_ROUTES))
    for (method, path), (response, body) in zip(ADMIN_ROUTES, answers, strict=True):
        assert response.status_code == 404, (method, path, response.text)
        error = response.json()["error"]
        assert error["code"] == "not_supported"
        assert error["message"] == "This gateway's backend has no managed engine or adapters."
        assert body.pulled == 0, (method, path)


async def test_a_custom_backend_has_no_admin_interface_every_admin_route_answers_404(
    tmp_path: Path,
) -> None:
    settings = settings_for(tmp_path, admin_key=ADMIN_KEY)
    answers = await call_app(settings, EchoBackend(), send_each(ADMIN_ROUTES))
    for (method, path), (response, body) in zip(ADMIN_ROUTES, answers, strict=True):
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_supported"
        assert body.pulled == 0, (method, path)


def test_the_managed_backends_are_the_admin_interface() -> None:
    assert issubclass(ManagedBackend, AdminBackend)
    assert issubclass(ManagedCatalogBackend, AdminBackend)


async def test_a_managed_backend_still_starting_refuses_with_503_before_reading_a_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real backend, its start held in planning the engine: no adapter manager yet."""

    async def planning_forever(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr("loragate.serving.model.plan_engine", planning_forever)
    settings = settings_for(tmp_path, admin_key=ADMIN_KEY, model=str(tmp_path / "model"))
    routes = [("GET", "/admin/adapters"), ("GET", "/admin/adapters/pong"), *CHANGES]
    answers = await call_app(settings, ManagedBackend(settings), send_each(routes))
    for (method, path), (response, body) in zip(routes, answers, strict=True):
        assert response.status_code == 503, (method, path, response.text)
        assert response.json()["error"] == {
            "message": "the gateway is still starting",
            "type": "service_unavailable",
            "param": None,
            "code": "engine_starting",
        }
        assert body.pulled == 0, (method, path)


async def test_a_request_while_the_model_is_prepared_gets_a_503_at_the_queue_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone model still being prepared (its plan held here): a chat request waits for it
    until ``queue_deadline``, then gets the 503 it can retry, not an answer that never comes."""

    async def planning_forever(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr("loragate.serving.model.plan_engine", planning_forever)
    settings = settings_for(tmp_path, model=str(tmp_path / "model"), queue_deadline=0.5)

    async def ask(client: httpx.AsyncClient) -> httpx.Response:
        body = {
            "model": settings.served_model_name,
            "messages": [{"role": "user", "content": "hi"}],
        }
        return await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 10)

    answer = await call_app(settings, ManagedBackend(settings), ask)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_starting"
    assert answer.headers["retry-after"] == "10"


async def test_adapters_a_fleet_manifest_owns_refuse_every_change_with_409_and_its_source_redacted(
    tmp_path: Path,
) -> None:
    backend = ManagedBackendDouble()

    def never_fetched(url: str) -> bytes:
        raise AssertionError("the reconciler was not started")

    backend.runtime.fleet = FleetReconciler(
        backend.adapters,  # type: ignore[arg-type]
        SIGNED_MANIFEST,
        interval=60,
        fetch=never_fetched,
    )

    async def ask(client: httpx.AsyncClient) -> tuple[Any, httpx.Response]:
        return await send_each(CHANGES)(client), await client.get("/admin/adapters", headers=ADMIN)

    answers, listing = await call_app(settings_for(tmp_path, admin_key=ADMIN_KEY), backend, ask)
    for (method, path), (response, body) in zip(CHANGES, answers, strict=True):
        assert response.status_code == 409, (method, path, response.text)
        error = response.json()["error"]
        assert error["code"] == "managed_by_manifest"
        assert error["message"].startswith(
            "this gateway serves the adapters of the manifest "
            "https://***@fleet.example/adapters.json?***; change the manifest instead"
        )
        assert "hunter22" not in response.text
        assert body.pulled == 0, (method, path)
    assert backend.adapters.changes == []
    assert listing.status_code == 200
    assert listing.json()["adapters_manifest"]["source"] == (
        "https://***@fleet.example/adapters.json?***"
    )


async def test_the_admin_routes_answer_what_the_backend_reports_and_change_through_it(
    tmp_path: Path,
) -> None:
    backend = ManagedBackendDouble()
    with backend.adapters.progress.track("sleepy", "/sleepy"):
        pass  # a finished add of a name the manager does not list (it failed, say)
    running = backend.adapters.progress.track("fresh", "/fresh")
    running.__enter__()  # an add still running

    async def ask(client: httpx.AsyncClient) -> dict[str, httpx.Response]:
        return {
            "list": await client.get("/admin/adapters", headers=ADMIN),
            "pong": await client.get("/admin/adapters/pong", headers=ADMIN),
            "fresh": await client.get("/admin/adapters/fresh", headers=ADMIN),
            "nope": await client.get("/admin/adapters/nope", headers=ADMIN),
            "put": await client.put(
                "/admin/adapters/pong", json={"source": "/pong2"}, headers=ADMIN
            ),
            "rollback": await client.post("/admin/adapters/pong/rollback", headers=ADMIN),
            "delete": await client.delete("/admin/adapters/pong", headers=ADMIN),
        }

    # "/": local sources anywhere, as the double's fake paths are.
    settings = settings_for(tmp_path, admin_key=ADMIN_KEY, adapter_source_roots=["/"])
    answers = await call_app(settings, backend, ask)
    running.__exit__(None, None, None)
    listing = answers["list"].json()
    assert listing["object"] == "list"
    assert listing["base_model"] == "base"
    assert [adapter["name"] for adapter in listing["data"]] == ["pong"]
    assert [record["name"] for record in listing["progress"]] == ["sleepy", "fresh"]
    assert listing["adapters_manifest"] is None
    assert answers["pong"].json()["state"] == "serving"
    assert answers["pong"].json()["progress"] is None
    assert answers["fresh"].json()["state"] == "adding"
    assert answers["fresh"].json()["progress"]["name"] == "fresh"
    assert answers["nope"].status_code == 404
    assert answers["nope"].json()["error"]["code"] == "adapter_not_found"
    assert answers["put"].json()["version"] == "1" * 64
    assert answers["rollback"].json()["version"] == "0" * 64
    assert answers["delete"].json() == {"name": "pong", "deleted": True}
    assert backend.adapters.changes == [
        ("put", "pong", "/pong2"),
        ("rollback", "pong"),
        ("remove", "pong"),
    ]


async def test_the_engine_report_counts_the_memory_of_the_engine_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        backend = ManagedBackendDouble()
        snapshot = engine_snapshot(launcher_pid=engine.pid, log_file=backend.supervisor.log_path)
        monkeypatch.setattr(backend.supervisor, "snapshot", lambda: snapshot)

        async def ask(client: httpx.AsyncClient) -> httpx.Response:
            return await client.get("/admin/engine", headers=ADMIN)

        report = (await call_app(settings_for(tmp_path, admin_key=ADMIN_KEY), backend, ask)).json()
    finally:
        engine.kill()
        await asyncio.to_thread(engine.wait)
    assert report["launcher_pid"] == engine.pid
    assert report["rss_bytes"] > 1 << 20  # a Python interpreter holds megabytes
    assert report["base_routing"] == "direct"
