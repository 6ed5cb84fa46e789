"""API keys: several inference keys, a separate admin key, constant-time checks, no key in logs."""

from __future__ import annotations

import contextlib
import hmac
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from loragate.cli import app as cli_app
from loragate.gateway.access import auth
from loragate.gateway.access.auth import KeyChecker, KeyConfigError, check_key_settings
from loragate.gateway.app import AdminKeyRequired, create_app
from loragate.gateway.errors import OpenAIError
from tests.backend_double import RecordingBackend, settings_for

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
ADMIN_ROUTES = [
    ("GET", "/admin/adapters", None),
    ("PUT", "/admin/adapters/pong", {"source": "/nowhere"}),
    ("DELETE", "/admin/adapters/pong", None),
    ("POST", "/admin/adapters/pong/rollback", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("GET", "/admin/engine", None),
    ("POST", "/admin/engine/restart", None),
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
def keyed(tmp_path: Path, backend: RecordingBackend) -> httpx.AsyncClient:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key-1\n\n   file-key-2  \n")
    settings = settings_for(
        tmp_path, api_key=["flag-key-1", "flag-key-2"], api_key_file=key_file, admin_key="the-admin"
    )
    app = create_app(settings, backend=backend)
    # A loopback name: admin routes answer only the gateway's own host names (cross_site).
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize(
    "key", ["flag-key-1", "flag-key-2", "file-key-1", "file-key-2", "the-admin"]
)
async def test_every_configured_key_opens_the_inference_routes(
    keyed: httpx.AsyncClient, backend: RecordingBackend, key: str
) -> None:
    assert (await keyed.get("/v1/models", headers=bearer(key))).status_code == 200
    response = await keyed.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
    assert response.status_code == 200
    assert len(backend.forwarded) == 1


async def test_the_x_api_key_header_works_like_a_bearer_token(keyed: httpx.AsyncClient) -> None:
    response = await keyed.get("/v1/models", headers={"X-API-Key": "file-key-1"})
    assert response.status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong"),
        bearer(""),
        bearer("flag-key"),  # a prefix of a real key
        bearer("flag-key-1x"),  # a real key plus one character
        {"Authorization": "Basic ZmxhZy1rZXktMTo="},
        {"Authorization": "flag-key-1"},  # no scheme
        {"X-API-Key": ""},
    ],
    ids=["none", "wrong", "empty", "prefix", "longer", "basic", "no-scheme", "empty-x-api-key"],
)
async def test_a_missing_or_wrong_key_is_401_and_nothing_reaches_the_backend(
    keyed: httpx.AsyncClient, backend: RecordingBackend, headers: dict[str, str]
) -> None:
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"model": "base", "prompt": "hi"}),
    ]:
        response = await keyed.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["error"] == {
            "message": "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    assert backend.forwarded == []


async def test_the_key_is_checked_before_the_body_is_read(
    keyed: httpx.AsyncClient, backend: RecordingBackend
) -> None:
    # An unauthenticated client cannot make the gateway parse (or buffer) anything.
    response = await keyed.post(
        "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 401
    assert backend.forwarded == []


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
async def test_admin_routes_need_the_admin_key_not_an_inference_key(
    keyed: httpx.AsyncClient, method: str, path: str, body: Any
) -> None:
    missing = await keyed.request(method, path, json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_admin_key"
    assert "admin key" in missing.json()["error"]["message"]
    wrong = await keyed.request(method, path, json=body, headers=bearer("flag-key-1"))
    assert wrong.status_code == 403
    assert wrong.json()["error"]["code"] == "invalid_admin_key"
    # With the admin key the route runs (this double has no managed engine: 404 says so).
    allowed = await keyed.request(method, path, json=body, headers=bearer("the-admin"))
    assert allowed.status_code == 404
    assert allowed.json()["error"]["code"] == "not_supported"


async def test_health_and_metrics_stay_open_with_keys_set(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/health")).status_code == 200
    assert (await keyed.get("/health/live")).status_code == 200
    assert (await keyed.get("/metrics")).status_code == 200


async def test_without_inference_keys_the_inference_routes_are_open(
    tmp_path: Path, backend: RecordingBackend
) -> None:
    app = create_app(settings_for(tmp_path), backend=backend)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
    ) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


def test_every_key_comparison_is_between_equal_length_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    checker = KeyChecker(["short", "a-much-longer-inference-key-" * 4], admin_key="adm")
    for presented in ("x", "short", "y" * 500):
        request = _request({"authorization": f"Bearer {presented}"})
        with contextlib.suppress(OpenAIError):
            checker.check_inference(request)
    # Every configured key is compared every time (no early exit), always 32 bytes to 32 bytes.
    assert len(compared) == 3 * 3
    assert set(compared) == {(32, 32)}


def _request(headers: dict[str, str]) -> Any:
    from starlette.requests import Request

    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw})


def test_the_key_file_skips_comments_and_blank_lines(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# a comment\n\n  one  \n  # indented comment\ntwo\n")
    settings = settings_for(tmp_path, api_key=["flag"], api_key_file=key_file)
    assert check_key_settings(settings) == ["flag", "one", "two"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"api_key_file": "missing"}, "cannot read the API key file"),
        ({"api_key_file": "empty"}, "holds no key"),
        ({"api_key": ["ok", "  "]}, "an API key is empty"),
        ({"admin_key": ""}, "the admin key is empty"),
        ({"api_key": ["shared"], "admin_key": "shared"}, "also an inference API key"),
    ],
    ids=["unreadable-file", "empty-file", "empty-key", "empty-admin-key", "admin-is-inference"],
)
def test_unusable_keys_refuse_to_start_with_a_reason(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    (tmp_path / "empty").write_text("# nothing but comments\n\n")
    if "api_key_file" in values:
        values = {**values, "api_key_file": tmp_path / values["api_key_file"]}
    with pytest.raises(KeyConfigError, match=message):
        create_app(settings_for(tmp_path, **values), backend=RecordingBackend())


def test_no_admin_key_beyond_loopback_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(AdminKeyRequired, match="--admin-key"):
        create_app(settings_for(tmp_path, host="0.0.0.0"), backend=RecordingBackend())
    create_app(settings_for(tmp_path, host="0.0.0.0", admin_key="k"), backend=RecordingBackend())


async def test_open_admin_routes_on_loopback_are_announced_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings_for(tmp_path, host="127.0.0.1", open_admin=True)
    app = create_app(settings, backend=RecordingBackend())
    with caplog.at_level(logging.INFO, logger="loragate.gateway"):
        async with app.router.lifespan_context(app):
            pass
    assert "admin routes are open without a key" in caplog.text
    assert "inference routes are open" in caplog.text


async def test_without_an_admin_key_the_token_file_is_announced_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(settings_for(tmp_path, host="127.0.0.1"), backend=RecordingBackend())
    with caplog.at_level(logging.INFO, logger="loragate.gateway"):
        async with app.router.lifespan_context(app):
            token = (tmp_path / "admin-token").read_text().strip()
    assert f"per-start token in {tmp_path / 'admin-token'}" in caplog.text
    assert "open without a key" not in caplog.text
    assert token not in caplog.text


async def test_no_key_ever_reaches_the_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, backend: RecordingBackend
) -> None:
    secrets = ["sk-inference-secret-1", "sk-inference-secret-2", "sk-admin-secret"]
    presented_wrong = "sk-presented-but-wrong"
    settings = settings_for(tmp_path, api_key=secrets[:2], admin_key=secrets[2], log_level="debug")
    app = create_app(settings, backend=backend)
    with caplog.at_level(logging.DEBUG):
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
            ) as client,
        ):
            for key in [*secrets, presented_wrong]:
                await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
                await client.get("/admin/adapters", headers=bearer(key))
    assert caplog.records  # something was logged: start-up, access lines
    for key in [*secrets, presented_wrong]:
        assert key not in caplog.text


def test_serve_refuses_an_unreadable_key_file_before_listening(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli_app,
        [
            "serve",
            "--upstream-url", "http://127.0.0.1:9/v1",  # no engine to boot
            "--port", "0",
            "--cache-dir", str(tmp_path),
            "--api-key-file", str(tmp_path / "no-such-file"),
        ],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "cannot read the API key file" in result.output
