"""The status page's routes without an engine: /ui and its files, / for browsers only, the log
tail, the traffic series, and the admin API's add progress, each under the admin API's rules."""

from __future__ import annotations

import fnmatch
import io
import json
import logging
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

import loragate.gateway as gateway_package
from loragate.fetching.progress import report_bytes, report_stage
from loragate.gateway.app import create_app
from loragate.gateway.routes.ui import page_files
from tests.backend_double import ManagedBackendDouble, settings_for

KEY = "admin-secret"
LOOPBACK = "http://127.0.0.1:8000"
AUTH = {"Authorization": f"Bearer {KEY}"}
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def backend() -> ManagedBackendDouble:
    return ManagedBackendDouble()


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=LOOPBACK)


@pytest.fixture
async def client(tmp_path: Path, backend: ManagedBackendDouble) -> Any:
    app = create_app(settings_for(tmp_path, host="127.0.0.1", admin_key=KEY), backend=backend)
    async with client_for(app) as http:
        yield http


# ----- the page -------------------------------------------------------------------------------


async def test_ui_serves_the_page_with_a_strict_content_security_policy(
    client: httpx.AsyncClient,
) -> None:
    page = await client.get("/ui")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert "set-cookie" not in page.headers
    assert '<script type="module" src="ui/main.js">' in page.text
    # Nothing from a CDN: every file the page loads is its own.
    assert re.findall(r'(?:src|href)="([^"]*)"', page.text) == ["data:,", "ui/ui.css", "ui/main.js"]


async def test_ui_files_are_served_from_the_package_and_nothing_else(
    client: httpx.AsyncClient,
) -> None:
    assert {"index.html", "main.js", "api.js", "ui.css"} <= set(page_files())
    script = await client.get("/ui/main.js")
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    style = await client.get("/ui/ui.css")
    assert style.headers["content-type"].startswith("text/css")
    for path in ("/ui/missing.js", "/ui/..%2fapp.py", "/ui/__init__.py"):
        assert (await client.get(path)).status_code == 404, path


async def test_page_scripts_never_write_html_from_data() -> None:
    for name, body in page_files().items():
        if name.endswith(".js"):
            text = body.decode()
            for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
                assert sink not in text, f"{name} uses {sink}"


async def test_root_redirects_browsers_to_the_page(client: httpx.AsyncClient) -> None:
    answer = await client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert answer.status_code == 307
    assert answer.headers["location"] == "/ui"


async def test_root_answers_api_clients_as_before(client: httpx.AsyncClient) -> None:
    unknown = await client.get("/no-such-route")
    for headers in ({"Accept": "application/json"}, {"Accept": "*/*"}, {}):
        answer = await client.get("/", headers=headers)
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["code"] == unknown.json()["error"]["code"]
        assert error["message"] == unknown.json()["error"]["message"].replace("/no-such-route", "/")
    posted = await client.post("/", headers={"Accept": BROWSER_ACCEPT}, json={})
    assert posted.status_code == 404


# ----- the log tail ---------------------------------------------------------------------------


async def test_log_tail_needs_the_admin_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/admin/logs")).status_code == 401
    wrong = await client.get("/admin/logs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403


async def test_log_tail_refuses_foreign_pages_and_rebound_hosts_even_with_the_key(
    client: httpx.AsyncClient,
) -> None:
    foreign = await client.get("/admin/logs", headers={**AUTH, "Origin": "http://evil.example"})
    assert foreign.status_code == 403
    assert foreign.json()["error"]["code"] == "origin_not_allowed"
    rebound = await client.get("/admin/logs", headers={**AUTH, "Host": "evil.example:8000"})
    assert rebound.status_code == 403
    assert rebound.json()["error"]["code"] == "host_not_allowed"
    own_page = await client.get(
        "/admin/logs", headers={**AUTH, "Origin": LOOPBACK, "Host": "127.0.0.1:8000"}
    )
    assert own_page.status_code == 200


async def test_log_tail_shows_the_gateways_and_the_engines_lines(
    client: httpx.AsyncClient, backend: ManagedBackendDouble, tmp_path: Path
) -> None:
    engine_log = tmp_path / "engine.log"
    engine_log.write_text("engine booting\nengine <b>ready</b>\n")
    backend.supervisor.log_path = engine_log
    logger = logging.getLogger("loragate.gateway")
    old_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    try:
        logger.info("a line for the status page")
    finally:
        logging.getLogger().setLevel(old_level)
    answer = await client.get("/admin/logs", params={"lines": 50}, headers=AUTH)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    entries = [json.loads(line) for line in answer.text.splitlines()]
    gateway = [e["line"] for e in entries if e["source"] == "gateway"]
    engine = [e["line"] for e in entries if e["source"] == "engine"]
    assert any(line.endswith("loragate.gateway: a line for the status page") for line in gateway)
    assert engine == ["engine booting", "engine <b>ready</b>"]
    only_engine = await client.get("/admin/logs", params={"source": "engine"}, headers=AUTH)
    assert {json.loads(line)["source"] for line in only_engine.text.splitlines()} == {"engine"}
    assert (await client.get("/admin/logs?lines=-1", headers=AUTH)).status_code == 400


# ----- the add progress -----------------------------------------------------------------------


async def test_adapter_progress_is_readable_while_an_add_runs(
    client: httpx.AsyncClient, backend: ManagedBackendDouble
) -> None:
    board = backend.adapters.progress
    assert (await client.get("/admin/adapters/newcomer", headers=AUTH)).status_code == 404
    with board.track("newcomer", "https://example.com/a.tar.gz"):
        report_bytes(512, 2048)
        during = await client.get("/admin/adapters/newcomer", headers=AUTH)
        listed = await client.get("/admin/adapters", headers=AUTH)
        report_stage("validation")
        later = await client.get("/admin/adapters/newcomer", headers=AUTH)
    assert during.status_code == 200
    body = during.json()
    assert body["state"] == "adding"
    assert body["progress"]["stage"] == "download"
    assert (body["progress"]["bytes_done"], body["progress"]["bytes_total"]) == (512, 2048)
    assert body["progress"]["percent"] == 25.0
    assert [p["name"] for p in listed.json()["progress"]] == ["newcomer"]
    assert later.json()["progress"]["stage"] == "validation"
    done = (await client.get("/admin/adapters/newcomer", headers=AUTH)).json()
    assert done["progress"]["stage"] == "done" and done["progress"]["finished"]
    known = (await client.get("/admin/adapters/pong", headers=AUTH)).json()
    assert known["name"] == "pong" and known["progress"] is None


async def test_adapter_progress_needs_the_admin_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/admin/adapters/pong")).status_code == 401


async def test_engine_info_reports_the_memory_it_uses(client: httpx.AsyncClient) -> None:
    info = (await client.get("/admin/engine", headers=AUTH)).json()
    assert "rss_bytes" in info  # None here: the double has no engine process


# ----- the traffic series ---------------------------------------------------------------------


async def test_recent_traffic_is_public_like_metrics(
    client: httpx.AsyncClient, backend: ManagedBackendDouble
) -> None:
    chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    recent = await client.get("/metrics/recent", params={"window": 60, "step": 5})
    assert recent.status_code == 200
    body = recent.json()
    assert len(body["points"]) == 12
    assert sum(point["rps"] for point in body["points"]) * 5 == pytest.approx(3)
    assert body["in_flight"] == 0 and body["queued"] == 0
    assert any(point["latency_avg"] is not None for point in body["points"])


async def test_recent_traffic_needs_the_admin_key_when_metrics_are_private(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    settings = settings_for(tmp_path, host="127.0.0.1", admin_key=KEY, metrics_public=False)
    async with client_for(create_app(settings, backend=backend)) as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics/recent")).status_code == 401
        assert (await http.get("/metrics/recent", headers=AUTH)).status_code == 200


def test_every_page_file_ships_in_the_wheel() -> None:
    """``pip install .`` copies package data only where pyproject lists it."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["loragate.gateway"]
    for path in (root / "loragate" / "gateway" / "ui").iterdir():
        relative = f"ui/{path.name}"
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"{relative} would not ship"


# ----- without the key: what /health shows, and the start line's address ---------------------


async def test_health_shows_the_uptimes_publicly_but_not_the_engines_pid_or_memory(
    tmp_path: Path,
) -> None:
    from tests.backend_double import ProxiedBackend, engine_snapshot

    engine = engine_snapshot(uptime_s=42.54, pid=4321)
    backend = ProxiedBackend("http://127.0.0.1:9", ["base"], engine=engine)
    app = create_app(settings_for(tmp_path, host="127.0.0.1", admin_key=KEY), backend=backend)
    async with client_for(app) as http:
        body = (await http.get("/health")).json()
    assert body["engine_uptime_s"] == 42.5 and 0 <= body["uptime_s"] < 60
    assert "4321" not in json.dumps(body) and "memory" not in body and "rss_bytes" not in body


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_on_a_terminal_the_start_prints_the_status_page_address_with_the_token(
    tmp_path: Path,
    backend: ManagedBackendDouble,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    caplog.set_level(logging.INFO, "loragate.gateway")
    app = create_app(settings_for(tmp_path, host="127.0.0.1", port=8123), backend=backend)
    async with app.router.lifespan_context(app), client_for(app) as http:
        token = (tmp_path / "admin-token").read_text().strip()
        assert f"status page: http://127.0.0.1:8123/ui#token={token}\n" in terminal.getvalue()
        assert token not in caplog.text  # the terminal only, never a log
        admin = await http.get("/admin/adapters", headers={"Authorization": f"Bearer {token}"})
        assert admin.status_code == 200


def test_a_configured_admin_key_is_never_printed_as_an_address(
    tmp_path: Path,
    backend: ManagedBackendDouble,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    caplog.set_level(logging.INFO, "loragate.gateway")
    app = create_app(settings_for(tmp_path, host="127.0.0.1", admin_key=KEY), backend=backend)

    async def start_and_stop() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(start_and_stop())
    assert "#token=" not in terminal.getvalue() + caplog.text
    assert KEY not in terminal.getvalue() + caplog.text


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_the_page_keeps_the_addresses_token_for_the_tab_and_drops_it_from_the_address() -> None:
    api = Path(gateway_package.__file__).parent / "ui" / "api.js"
    script = f"""
const store = new Map();
globalThis.sessionStorage = {{
  getItem: (k) => store.get(k) ?? null, setItem: (k, v) => store.set(k, v),
  removeItem: (k) => store.delete(k),
}};
const api = await import({json.dumps(api.as_uri())});
const replaced = [];
const history = {{ replaceState: (...args) => replaced.push(args[2]) }};
const found = api.adoptTokenFromAddress(
  {{ hash: "#token=Ab-c_9", pathname: "/ui", search: "?x=1" }}, history);
const none = api.adoptTokenFromAddress({{ hash: "#other", pathname: "/ui", search: "" }}, history);
console.log(JSON.stringify({{ found, none, key: api.adminKey(), replaced }}));
"""
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "found": True,
        "none": False,
        "key": "Ab-c_9",
        "replaced": ["/ui?x=1"],
    }
