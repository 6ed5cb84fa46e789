"""The HTTP surface around the routes: CORS, security headers, /docs, the OpenAPI schema, CLI flags."""

from __future__ import annotations

import html.parser
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from typer.testing import CliRunner

from loragate.cli import app as cli_app
from loragate.gateway import app as app_module
from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import RecordingBackend, free_port, settings_for

SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization",
}


async def client_for(tmp_path: Path, **values: Any) -> httpx.AsyncClient:
    app = create_app(settings_for(tmp_path, **values), backend=RecordingBackend())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1")


@pytest.fixture
async def default(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with await client_for(tmp_path) as client:
        yield client


async def test_cors_is_off_by_default(default: httpx.AsyncClient) -> None:
    origin = {"Origin": "https://evil.example"}
    preflight = await default.options("/v1/chat/completions", headers={**origin, **PREFLIGHT})
    assert "access-control-allow-origin" not in preflight.headers
    simple = await default.get("/v1/models", headers=origin)
    assert simple.status_code == 403  # a page at a foreign origin is refused outright
    assert "access-control-allow-origin" not in simple.headers


async def test_cors_allows_only_the_configured_origins(tmp_path: Path) -> None:
    async with await client_for(tmp_path, cors_origins=["https://app.example"]) as client:
        allowed = await client.options(
            "/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT}
        )
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = await client.options(
            "/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT}
        )
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        # The inference routes too (they skip FastAPI's layers only when CORS is off).
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"Origin": "https://app.example"},
        )
        assert chat.status_code == 200
        assert chat.headers["access-control-allow-origin"] == "https://app.example"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/chat/completions", {"messages": "bad"}),
        ("GET", "/no/such/route", None),
        ("DELETE", "/v1/models", None),
    ],
    ids=["health", "models", "chat", "chat-400", "404", "405"],
)
async def test_every_answer_carries_the_security_headers(
    default: httpx.AsyncClient, method: str, path: str, body: Any
) -> None:
    response = await default.request(method, path, json=body)
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (response.status_code, name)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_docs_can_be_turned_off(tmp_path: Path, default: httpx.AsyncClient) -> None:
    for path in ("/docs", "/openapi.json"):
        assert (await default.get(path)).status_code == 200, path
    assert (await default.get("/redoc")).status_code == 404  # a CDN viewer: not served
    async with await client_for(tmp_path, docs=False) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await client.get(path)).status_code == 404, path


class _PageParts(html.parser.HTMLParser):
    """The scripts, stylesheets and frames a page would load, and its links."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, dict[str, str | None]]] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag in ("script", "iframe", "object", "embed", "img") or (
            tag == "link" and values.get("rel") != "help"
        ):
            self.loads.append((tag, values))
        if tag == "a" and values.get("href"):
            self.links.append(str(values["href"]))


async def test_docs_runs_no_script_in_the_gateways_origin(default: httpx.AsyncClient) -> None:
    # The gateway trusts pages of its own origin (cross_site): a CDN script there could drive
    # the admin routes. /docs is a plain page that links the description.
    page = await default.get("/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    parts = _PageParts()
    parts.feed(page.text)
    assert parts.loads == []
    assert "openapi.json" in parts.links
    assert all("://" not in link for link in parts.links)  # nothing off the gateway
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert (await default.get("/openapi.json")).json()["paths"]["/v1/chat/completions"]


async def test_openapi_describes_the_raw_body_inference_routes(default: httpx.AsyncClient) -> None:
    schema = (await default.get("/openapi.json")).json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    body_schema = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    completions = schema["paths"]["/v1/completions"]["post"]
    assert "requestBody" in completions
    for name in ("OpenAIChatRequest", "ViChatRequest", "ChatMessage", "CompletionRequest", "Error"):
        assert name in schema["components"]["schemas"]
    load = schema["paths"]["/v1/load_lora_adapter"]["post"]["requestBody"]
    assert load["content"]["application/json"]["schema"]["required"] == ["lora_name", "lora_path"]


async def test_requests_the_schema_accepts_are_the_ones_the_gateway_accepts(
    tmp_path: Path,
) -> None:
    backend = RecordingBackend()
    app = create_app(settings_for(tmp_path), backend=backend)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
    ) as client:
        spec = (await client.get("/openapi.json")).json()
        registry = {"components": spec["components"]}

        def validator(name: str) -> jsonschema.Validator:
            return jsonschema.Draft202012Validator(
                {**registry, "$ref": f"#/components/schemas/{name}"}
            )

        chat = validator("ChatCompletionRequest")
        completion = validator("CompletionRequest")
        good_chat = [
            {"model": "pong", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            {"user_prompt": "hi", "generation_config": {"max_new_tokens": 4, "do_sample": False}},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "n": 2},
        ]
        bad_chat = [
            {"messages": [{"role": "root", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            {"messages": [{"role": "user", "content": "hi"}], "n": 0},
            {"model": "base"},
        ]
        for body in good_chat:
            chat.validate(body)
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        for body in bad_chat:
            assert not chat.is_valid(body), body
        completion.validate({"model": "base", "prompt": "hi", "max_tokens": 3})
        assert not completion.is_valid({"model": "base"})


class _Captured(Exception):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings


def test_serve_flags_reach_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def capture(settings: Settings, backend: Any = None) -> Any:
        raise _Captured(settings)

    monkeypatch.setattr(app_module, "create_app", capture)
    key_file = tmp_path / "keys"
    key_file.write_text("k3\n")
    result = CliRunner().invoke(
        cli_app,
        [
            "serve",
            "--upstream-url", "http://127.0.0.1:9/v1",
            "--port", str(free_port()),
            "--cache-dir", str(tmp_path),
            "--api-key", "k1", "--api-key", "k2", "--api-key-file", str(key_file),
            "--max-body-bytes", "1000",
            "--max-messages", "7",
            "--max-tokens-cap", "99",
            "--max-image-bytes", "5000",
            "--max-image-pixels", "640000",
            "--cors-origin", "https://a.example", "--cors-origin", "https://b.example",
            "--no-docs",
            "--private-image-urls",
            "--access-log",
        ],
    )  # fmt: skip
    assert isinstance(result.exception, _Captured), result.output
    settings = result.exception.settings
    assert settings.api_key == ["k1", "k2"]
    assert settings.api_key_file == key_file
    assert settings.inference_keys() == ["k1", "k2", "k3"]
    assert (settings.max_body_bytes, settings.max_messages, settings.max_tokens_cap) == (
        1000,
        7,
        99,
    )
    assert (settings.max_image_bytes, settings.max_image_pixels) == (5000, 640000)
    assert settings.cors_origins == ["https://a.example", "https://b.example"]
    assert settings.docs is False
    assert settings.private_image_urls is True
    assert settings.access_log is True


def test_serve_defaults_keep_cors_off_and_docs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def capture(settings: Settings, backend: Any = None) -> Any:
        raise _Captured(settings)

    monkeypatch.setattr(app_module, "create_app", capture)
    for name in ("LORAGATE_CORS_ORIGINS", "LORAGATE_DOCS", "LORAGATE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(
        cli_app,
        ["serve", "--upstream-url", "http://127.0.0.1:9/v1", "--port", str(free_port()),
         "--cache-dir", str(tmp_path)],
    )  # fmt: skip
    assert isinstance(result.exception, _Captured), result.output
    assert result.exception.settings.cors_origins == []
    assert result.exception.settings.docs is True
    assert result.exception.settings.api_key == []
