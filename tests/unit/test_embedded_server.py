"""``create_server()`` is safe however it is served, and works mounted in a larger app.

The app cannot see where its ASGI server binds (the Vi SDK's own docs run it with
``uvicorn.run(create_server(...), host="0.0.0.0")``), so it must not rely on ``settings.host``:
its admin routes need a key unless explicitly opened, and then answer only this machine.
Mounted apps get no lifespan events, so the backend must start anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

import loragate
from tests.backend_double import ManagedBackendDouble

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
REMOTE = ("203.0.113.7", 50000)  # a client elsewhere, as uvicorn on 0.0.0.0 would see it


def client_for(app: object, **transport: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app, **transport),  # type: ignore[arg-type]
        base_url="http://127.0.0.1:8000",
    )


@pytest.mark.parametrize("client", [REMOTE, ("127.0.0.1", 50000)], ids=["remote", "local"])
async def test_create_server_serves_no_admin_route_without_a_key(
    tmp_path: Path, client: tuple[str, int]
) -> None:
    backend = ManagedBackendDouble()
    app = loragate.create_server(backend=backend, cache_dir=tmp_path)
    async with app.router.lifespan_context(app), client_for(app, client=client) as http:
        for method, path in [
            ("GET", "/admin/adapters"),
            ("POST", "/admin/engine/restart"),
            ("DELETE", "/admin/adapters/pong"),
        ]:
            response = await http.request(method, path)
            assert response.status_code == 401, (path, response.text)
        put = await http.put("/admin/adapters/x", json={"source": "https://evil.example/a.zip"})
        assert put.status_code == 401
        # Inference stays as open as it was configured (no --api-key: open).
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert backend.adapters.changes == [] and backend.supervisor.restart_requests == 0


async def test_create_server_with_an_admin_key_serves_admin_routes_to_it(tmp_path: Path) -> None:
    backend = ManagedBackendDouble()
    app = loragate.create_server(backend=backend, cache_dir=tmp_path, admin_key="k")
    async with app.router.lifespan_context(app), client_for(app, client=REMOTE) as http:
        assert (await http.get("/admin/adapters")).status_code == 401
        response = await http.get("/admin/adapters", headers={"Authorization": "Bearer k"})
        assert response.status_code == 200


async def test_open_admin_is_never_open_to_other_machines(tmp_path: Path) -> None:
    backend = ManagedBackendDouble()
    app = loragate.create_server(backend=backend, cache_dir=tmp_path, open_admin=True)
    async with app.router.lifespan_context(app):
        async with client_for(app, client=REMOTE) as remote:
            assert (await remote.post("/admin/engine/restart")).status_code == 403
        async with client_for(app, client=("127.0.0.1", 1)) as local:
            assert (await local.post("/admin/engine/restart")).status_code == 202
    assert backend.supervisor.restart_requests == 1


async def test_a_mounted_gateway_starts_its_backend_on_the_first_request(tmp_path: Path) -> None:
    backend = ManagedBackendDouble()
    gateway = loragate.create_server(backend=backend, cache_dir=tmp_path)
    parent = Starlette(routes=[Mount("/llm", app=gateway)])
    async with client_for(parent) as http:  # the parent's lifespan never reaches `gateway`
        health = await http.get("/llm/health")
        assert health.status_code == 200, health.text
        assert backend.starts == 1
        chat = await http.post("/llm/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200, chat.text
        models = await http.get("/llm/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["base", "pong"]
        # The per-start token is published on that first start too.
        token = (tmp_path / "admin-token").read_text().strip()
        admin = await http.get("/llm/admin/adapters", headers={"Authorization": f"Bearer {token}"})
        assert admin.status_code == 200
    assert backend.starts == 1
    assert [path for path, _ in backend.forwarded] == ["/v1/chat/completions"]


async def test_concurrent_first_requests_start_the_backend_once(tmp_path: Path) -> None:
    import asyncio

    backend = ManagedBackendDouble()
    parent = Starlette(
        routes=[Mount("/llm", app=loragate.create_server(backend=backend, cache_dir=tmp_path))]
    )
    async with client_for(parent) as http:
        answers = await asyncio.gather(*(http.get("/llm/health") for _ in range(8)))
    assert {a.status_code for a in answers} == {200}
    assert backend.starts == 1


async def test_a_parent_app_can_run_the_gateways_lifespan_itself(tmp_path: Path) -> None:
    """The README's pattern: the parent's lifespan starts and stops the mounted gateway."""
    backend = ManagedBackendDouble()
    gateway = loragate.create_server(backend=backend, cache_dir=tmp_path)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gateway.router.lifespan_context(gateway):
            yield

    parent = Starlette(routes=[Mount("/llm", app=gateway)], lifespan=lifespan)
    async with parent.router.lifespan_context(parent):
        assert backend.starts == 1
        async with client_for(parent) as http:
            assert (await http.get("/llm/health")).status_code == 200
        assert backend.starts == 1
    assert backend.stops == 1
    assert not (tmp_path / "admin-token").exists()


async def test_after_its_lifespan_ended_the_gateway_does_not_start_again(tmp_path: Path) -> None:
    backend = ManagedBackendDouble()
    app = loragate.create_server(backend=backend, cache_dir=tmp_path)
    async with app.router.lifespan_context(app):
        pass
    async with client_for(app) as http:
        late = await http.get("/health")
    assert late.status_code == 503 and late.json()["error"]["code"] == "gateway_stopped"
    assert (backend.starts, backend.stops) == (1, 1)
