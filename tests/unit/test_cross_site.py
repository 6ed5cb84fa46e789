"""Web pages cannot drive the gateway: foreign origins, rebound host names, non-JSON bodies.

A page in the user's browser may send "simple" requests anywhere without asking (no CORS
preflight): GET, or POST with a text/plain, form or untyped body, and it cannot set
``Authorization``. After a DNS rebinding, its requests even carry the gateway's address but
the attacker's host name. Each of those doors is tried here, on a gateway with no admin key
on loopback (the set-up the issue's attack used), and each must stay shut with nothing
changed.
"""

from __future__ import annotations

import http.client
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import respx
from typer.testing import CliRunner

from loragate.cli import app as cli_app
from loragate.gateway.access.auth import KeyConfigError
from loragate.gateway.app import create_app
from tests.backend_double import ManagedBackendDouble, free_port, serving, settings_for

EVIL = "http://evil.example"
LOOPBACK = "http://127.0.0.1:8000"
CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
LOAD = {"lora_name": "evil", "lora_path": "https://evil.example/adapter.tar.gz"}

BODY_ROUTES = [
    ("POST", "/v1/load_lora_adapter", LOAD),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "pong"}),
    ("PUT", "/admin/adapters/evil", {"source": "https://evil.example/adapter.tar.gz"}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "base", "prompt": "hi"}),
]
ADMIN_ROUTES = [
    ("GET", "/admin/adapters", None),
    ("PUT", "/admin/adapters/evil", {"source": "/evil"}),
    ("DELETE", "/admin/adapters/pong", None),
    ("POST", "/admin/adapters/pong/rollback", None),
    ("POST", "/v1/load_lora_adapter", LOAD),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "pong"}),
    ("GET", "/admin/engine", None),
    ("POST", "/admin/engine/restart", None),
]
INFERENCE_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "base", "prompt": "hi"}),
]


@pytest.fixture
def backend() -> ManagedBackendDouble:
    return ManagedBackendDouble()


def keyless_app(tmp_path: Path, backend: ManagedBackendDouble, **values: Any) -> Any:
    """A gateway as `gateway serve` starts by default: loopback, no --admin-key."""
    return create_app(settings_for(tmp_path, host="127.0.0.1", **values), backend=backend)


def client_for(app: Any, base_url: str = LOOPBACK, **transport: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, **transport), base_url=base_url)


def admin_token(cache_dir: Path) -> dict[str, str]:
    return {"Authorization": f"Bearer {(cache_dir / 'admin-token').read_text().strip()}"}


@pytest.fixture
async def keyless(
    tmp_path: Path, backend: ManagedBackendDouble
) -> AsyncIterator[httpx.AsyncClient]:
    app = keyless_app(tmp_path, backend)
    async with app.router.lifespan_context(app), client_for(app) as client:
        yield client


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error


# ----- the attack from the issue --------------------------------------------------------------


async def test_a_web_page_cannot_load_an_adapter_into_a_keyless_loopback_gateway(
    keyless: httpx.AsyncClient, backend: ManagedBackendDouble
) -> None:
    # fetch(url, {method: "POST", mode: "no-cors", body: JSON.stringify(...)}) from a page:
    response = await keyless.post(
        "/v1/load_lora_adapter",
        content=orjson.dumps(LOAD),
        headers={"Content-Type": "text/plain;charset=UTF-8", "Origin": EVIL},
    )
    assert response.status_code in (401, 403, 415), response.text
    assert "error" in response.json()
    restart = await keyless.post("/admin/engine/restart", headers={"Origin": EVIL})
    assert restart.status_code in (401, 403), restart.text
    assert not backend.changed_anything()


# ----- Origin ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES + INFERENCE_ROUTES)
async def test_a_foreign_origin_is_refused_even_with_the_right_key(
    tmp_path: Path, backend: ManagedBackendDouble, method: str, path: str, body: Any
) -> None:
    app = keyless_app(tmp_path, backend)
    async with app.router.lifespan_context(app), client_for(app) as client:
        headers = {**admin_token(tmp_path), "Origin": EVIL}
        response = await client.request(method, path, json=body, headers=headers)
        assert_error(response, 403, "origin_not_allowed")
        assert "--cors-origin" in response.json()["error"]["message"]
        assert not backend.changed_anything()
        # The same request from no web page at all goes through.
        del headers["Origin"]
        assert (await client.request(method, path, json=body, headers=headers)).is_success


@pytest.mark.parametrize(
    "origin", ["null", "http://127.0.0.1:8000.evil.example", "https://127.0.0.1:9"]
)
async def test_odd_and_lookalike_origins_are_foreign(
    keyless: httpx.AsyncClient, backend: ManagedBackendDouble, origin: str
) -> None:
    response = await keyless.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
    assert_error(response, 403, "origin_not_allowed")
    assert backend.forwarded == []


async def test_listed_cors_origins_and_the_gateways_own_pages_are_allowed(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = keyless_app(tmp_path, backend, cors_origins=["https://app.example"])
    async with app.router.lifespan_context(app), client_for(app) as client:
        listed = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example"}
        )
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == "https://app.example"
        # /docs ("try it out") posts from the gateway's own origin.
        own = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": LOOPBACK})
        assert own.status_code == 200
    assert len(backend.forwarded) == 2


async def test_a_rebound_host_name_is_not_the_gateways_own_origin(
    keyless: httpx.AsyncClient, backend: ManagedBackendDouble
) -> None:
    # After DNS rebinding, evil.example:8000 resolves to 127.0.0.1: the page is "same-origin".
    rebound = {"Origin": "http://evil.example:8000", "Host": "evil.example:8000"}
    response = await keyless.post("/v1/chat/completions", json=CHAT, headers=rebound)
    assert_error(response, 403, "origin_not_allowed")
    assert backend.forwarded == []


# ----- Host --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
async def test_admin_routes_refuse_host_names_that_are_not_the_gateways(
    tmp_path: Path, backend: ManagedBackendDouble, method: str, path: str, body: Any
) -> None:
    app = keyless_app(tmp_path, backend)
    async with app.router.lifespan_context(app), client_for(app) as client:
        # A rebinding page's GET carries no Origin; its Host names the attacker's domain.
        headers = {**admin_token(tmp_path), "Host": "evil.example:8000"}
        response = await client.request(method, path, json=body, headers=headers)
        assert_error(response, 403, "host_not_allowed")
        assert "--allowed-hosts" in response.json()["error"]["message"]
    assert not backend.changed_anything()


@pytest.mark.parametrize(
    ("allowed", "host", "answer"),
    [
        ([], "127.0.0.1:8000", 200),
        ([], "localhost:8000", 200),
        ([], "LOCALHOST", 200),
        ([], "[::1]:8000", 200),
        ([], "127.0.0.2:8000", 403),
        ([], "10.1.2.3:8000", 403),
        ([], "localhost.evil.example", 403),
        (["gw.example"], "gw.example:8000", 200),
        (["gw.example"], "sub.gw.example", 403),
        (["*.gw.example"], "sub.gw.example", 200),
        (["*.gw.example"], "gw.example", 403),
        (["*"], "anything.example", 200),
    ],
)
async def test_allowed_hosts_are_loopback_names_the_bind_address_and_the_listed_ones(
    tmp_path: Path, backend: ManagedBackendDouble, allowed: list[str], host: str, answer: int
) -> None:
    app = keyless_app(tmp_path, backend, allowed_hosts=allowed)
    async with app.router.lifespan_context(app), client_for(app) as client:
        response = await client.get(
            "/admin/adapters", headers={**admin_token(tmp_path), "Host": host}
        )
    assert response.status_code == answer, response.text


async def test_the_bind_address_is_an_allowed_host(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    settings = settings_for(tmp_path, host="10.1.2.3", admin_key="k")
    app = create_app(settings, backend=backend)
    async with client_for(app, "http://10.1.2.3:8000") as client:
        response = await client.get("/admin/adapters", headers={"Authorization": "Bearer k"})
        assert response.status_code == 200
        other = await client.get(
            "/admin/adapters", headers={"Authorization": "Bearer k", "Host": "10.9.9.9"}
        )
        assert_error(other, 403, "host_not_allowed")


def test_allowed_hosts_come_from_the_env_as_a_comma_separated_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_ALLOWED_HOSTS", "gw.example, *.lan")
    assert settings_for(tmp_path).allowed_hosts == ["gw.example", "*.lan"]


async def test_health_answers_probes_by_any_host_and_origin(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = keyless_app(tmp_path, backend)
    async with app.router.lifespan_context(app), client_for(app, "http://10.1.2.3:8000") as client:
        for path in ("/health", "/health/live"):
            response = await client.get(path, headers={"Origin": EVIL})
            assert response.status_code == 200, path


# ----- Content-Type ------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), BODY_ROUTES)
@pytest.mark.parametrize(
    "content_type",
    ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data", None],
    ids=["text", "form", "multipart", "untyped-blob"],
)
async def test_json_bodies_need_the_json_content_type(
    tmp_path: Path,
    backend: ManagedBackendDouble,
    method: str,
    path: str,
    body: Any,
    content_type: str | None,
) -> None:
    app = keyless_app(tmp_path, backend)
    async with app.router.lifespan_context(app), client_for(app) as client:
        headers = admin_token(tmp_path)
        if content_type is not None:
            headers["Content-Type"] = content_type
        response = await client.request(method, path, content=orjson.dumps(body), headers=headers)
        assert_error(response, 415, "unsupported_media_type")
        assert "application/json" in response.json()["error"]["message"]
        # With the JSON type, and a charset, the same body goes through.
        headers["Content-Type"] = "application/json; charset=utf-8"
        allowed = await client.request(method, path, content=orjson.dumps(body), headers=headers)
        assert allowed.is_success, allowed.text


def test_the_hot_protocol_refuses_foreign_origins_and_non_json_bodies(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = keyless_app(tmp_path, backend)
    body = orjson.dumps(CHAT)
    with serving(app, as_served=True) as url:
        port = int(url.rsplit(":", 1)[1])
        refused = [
            ({"Content-Type": "text/plain", "Origin": EVIL}, 403),
            ({"Content-Type": "application/json", "Origin": EVIL}, 403),
            ({"Content-Type": "text/plain"}, 415),
            ({}, 415),
        ]
        for headers, status in refused:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
            answer = connection.getresponse()
            assert answer.status == status, (headers, answer.read())
            assert "error" in orjson.loads(answer.read())
            connection.close()
        assert backend.forwarded == []
        ok = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
        assert ok.status_code == 200
    assert len(backend.forwarded) == 1


# ----- no admin key: a per-start token ------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
async def test_without_an_admin_key_admin_routes_need_the_per_start_token(
    tmp_path: Path, backend: ManagedBackendDouble, method: str, path: str, body: Any
) -> None:
    app = keyless_app(tmp_path, backend)
    async with app.router.lifespan_context(app), client_for(app) as client:
        refused = await client.request(method, path, json=body)
        assert_error(refused, 401, "invalid_admin_key")
        assert "admin-token" in refused.json()["error"]["message"]
        assert not backend.changed_anything()
        allowed = await client.request(method, path, json=body, headers=admin_token(tmp_path))
        assert allowed.is_success, allowed.text


async def test_the_admin_token_is_private_fresh_each_start_and_removed_at_stop(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    token_file = tmp_path / "admin-token"
    tokens = []
    for _ in range(2):
        app = keyless_app(tmp_path, backend)
        async with app.router.lifespan_context(app):
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            assert token_file.stat().st_uid == os.getuid()
            tokens.append(token_file.read_text().strip())
        assert not token_file.exists()
    assert len(tokens[0]) >= 32 and tokens[0] != tokens[1]


async def test_an_admin_key_makes_no_token(tmp_path: Path, backend: ManagedBackendDouble) -> None:
    app = create_app(settings_for(tmp_path, admin_key="the-admin"), backend=backend)
    async with app.router.lifespan_context(app), client_for(app) as client:
        assert not (tmp_path / "admin-token").exists()
        response = await client.get(
            "/admin/adapters", headers={"Authorization": "Bearer the-admin"}
        )
        assert response.status_code == 200


def test_the_cli_reads_the_admin_token_of_a_gateway_on_this_machine(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    runner = CliRunner()
    with serving(keyless_app(tmp_path, backend)) as url:
        status = runner.invoke(
            cli_app, ["status", "--json", "--url", url, "--cache-dir", str(tmp_path)]
        )
        assert status.exit_code == 0, status.output
        assert '"state": "ready"' in status.output
        listed = runner.invoke(
            cli_app, ["adapters", "list", "--url", url, "--cache-dir", str(tmp_path)]
        )
        assert listed.exit_code == 0, listed.output
        assert "pong" in listed.output
        # The token is found through LORAGATE_CACHE_DIR as well.
        removed = runner.invoke(
            cli_app,
            ["adapters", "remove", "pong", "--url", url],
            env={"LORAGATE_CACHE_DIR": str(tmp_path)},
        )
        assert removed.exit_code == 0, removed.output
    assert backend.adapters.changes == [("remove", "pong")]


@respx.mock
def test_the_cli_never_sends_the_local_token_to_another_machine(tmp_path: Path) -> None:
    (tmp_path / "admin-token").write_text("local-secret\n")
    route = respx.get("http://gw.example:8000/admin/adapters").respond(
        200, json={"object": "list", "data": []}
    )
    result = CliRunner().invoke(
        cli_app,
        ["adapters", "list", "--url", "http://gw.example:8000", "--cache-dir", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    assert "authorization" not in route.calls.last.request.headers


# ----- open admin, only when asked for ----------------------------------------------------------


async def test_open_admin_answers_only_clients_on_this_machine(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = keyless_app(tmp_path, backend, open_admin=True)
    async with app.router.lifespan_context(app):
        assert not (tmp_path / "admin-token").exists()
        async with client_for(app) as local:
            assert (await local.get("/admin/adapters")).status_code == 200
        async with client_for(app, client=("10.1.2.3", 40000)) as remote:
            refused = await remote.post("/admin/engine/restart")
            assert_error(refused, 403, "invalid_admin_key")
        # A reverse proxy on this machine connects from loopback on a remote client's behalf.
        async with client_for(app) as proxied:
            proxy_headers = ("X-Forwarded-For", "Forwarded", "X-Real-IP", "X-Forwarded-Host")
            for header in (*proxy_headers, "X-Forwarded-Proto", "Via"):
                refused = await proxied.post("/admin/engine/restart", headers={header: "x"})
                assert_error(refused, 403, "invalid_admin_key")
    assert backend.supervisor.restart_requests == 0


# ----- CORS stops at the admin routes ------------------------------------------------------------


@pytest.mark.parametrize("cors_origin", ["*", "https://app.example"])
async def test_no_cors_origin_opens_the_admin_routes(
    tmp_path: Path, backend: ManagedBackendDouble, cors_origin: str
) -> None:
    app = keyless_app(tmp_path, backend, cors_origins=[cors_origin])
    page = {"Origin": "https://app.example"}
    async with app.router.lifespan_context(app), client_for(app) as client:
        preflight = await client.options(
            "/admin/adapters/evil",
            headers={**page, "Access-Control-Request-Method": "PUT",
                     "Access-Control-Request-Headers": "authorization,content-type"},
        )  # fmt: skip
        assert not [name for name in preflight.headers if name.startswith("access-control-")]
        # Even with the admin key in hand, a page's admin call is refused, and readable by none.
        for method, path, body in [
            ("PUT", "/admin/adapters/evil", {"source": "https://evil.example/a.tar.gz"}),
            ("POST", "/v1/load_lora_adapter", LOAD),
            ("POST", "/admin/engine/restart", None),
            ("GET", "/admin/logs", None),
        ]:
            response = await client.request(
                method, path, json=body, headers={**page, **admin_token(tmp_path)}
            )
            assert_error(response, 403, "origin_not_allowed")
            assert "access-control-allow-origin" not in response.headers
        # The inference routes still answer that origin, with CORS headers.
        chat = await client.post("/v1/chat/completions", json=CHAT, headers=page)
        assert chat.status_code == 200
        assert chat.headers["access-control-allow-origin"] in ("*", "https://app.example")
    assert not backend.adapters.changes and backend.supervisor.restart_requests == 0


async def test_open_admin_refuses_a_listed_cors_origins_pages(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    # A page at a --cors-origin, in a browser on this machine, is a loopback client.
    app = keyless_app(tmp_path, backend, open_admin=True, cors_origins=["https://app.example"])
    async with app.router.lifespan_context(app), client_for(app) as client:
        refused = await client.post(
            "/admin/engine/restart", headers={"Origin": "https://app.example"}
        )
        assert_error(refused, 403, "origin_not_allowed")
        assert (await client.get("/admin/adapters")).status_code == 200  # the CLI, no Origin
    assert backend.supervisor.restart_requests == 0


def test_open_admin_beside_any_cors_origin_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(KeyConfigError, match="--open-admin and --cors-origin"):
        keyless_app(tmp_path, ManagedBackendDouble(), open_admin=True, cors_origins=["*"])
    result = CliRunner().invoke(
        cli_app,
        ["serve", "--upstream-url", "http://127.0.0.1:9/v1", "--port", str(free_port()),
         "--cache-dir", str(tmp_path), "--open-admin", "--cors-origin", "*"],
    )  # fmt: skip
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: --open-admin and --cors-origin '*'"), result.output


# ----- DNS rebinding on a gateway without inference keys ---------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), INFERENCE_ROUTES)
async def test_a_rebound_page_cannot_read_or_use_a_keyless_gateway(
    keyless: httpx.AsyncClient, backend: ManagedBackendDouble, method: str, path: str, body: Any
) -> None:
    # After the rebinding the page is same-origin: a GET carries no Origin at all.
    response = await keyless.request(method, path, json=body, headers={"Host": "evil.example"})
    assert_error(response, 403, "host_not_allowed")
    assert "--allowed-hosts" in response.json()["error"]["message"]
    assert backend.forwarded == []


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "192.168.1.5:8000", "[fe80::1]"])
async def test_a_keyless_gateway_answers_its_own_names_and_any_address(
    keyless: httpx.AsyncClient, host: str
) -> None:
    # An address written as digits cannot be rebound: LAN clients by IP keep working.
    response = await keyless.get("/v1/models", headers={"Host": host})
    assert response.status_code == 200, response.text


async def test_with_an_api_key_any_host_name_may_ask(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    # A rebound page does not have the key; a client behind any name that has it may ask.
    app = keyless_app(tmp_path, backend, api_key=["sk-inference"])
    async with app.router.lifespan_context(app), client_for(app) as client:
        headers = {"Host": "gw.internal.example", "Authorization": "Bearer sk-inference"}
        assert (await client.get("/v1/models", headers=headers)).status_code == 200
        no_key = await client.get("/v1/models", headers={"Host": "evil.example"})
        assert_error(no_key, 401, "invalid_api_key")


def test_the_hot_protocol_refuses_a_rebound_host_on_a_keyless_gateway(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = keyless_app(tmp_path, backend)
    with serving(app, as_served=True) as url:
        port = int(url.rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        headers = {"Content-Type": "application/json", "Host": "evil.example"}
        connection.request("POST", "/v1/chat/completions", body=orjson.dumps(CHAT), headers=headers)
        answer = connection.getresponse()
        assert answer.status == 403
        assert orjson.loads(answer.read())["error"]["code"] == "host_not_allowed"
        connection.close()
    assert backend.forwarded == []
