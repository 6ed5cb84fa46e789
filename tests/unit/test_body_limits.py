"""Every route checks its key before it reads a byte of the body, and every body has a cap.

Bodies are sent as lazy streams that count the chunks the gateway pulled: a refusal that
pulled any has read (and buffered) what an unauthenticated client chose to send.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loragate.gateway.app import create_app
from tests.backend_double import ManagedBackendDouble, serving, settings_for

ADMIN_KEY = "the-admin"
API_KEY = "the-client"
MiB = 1 << 20
ADMIN_CAP = MiB  # admin bodies are a name and a source: a mebibyte is plenty

BODY_ROUTES = [
    ("PUT", "/admin/adapters/big"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
]


class CountedBody:
    """``chunks`` chunks of 1 MiB, made only when the gateway asks for them."""

    def __init__(self, chunks: int, first: bytes = b'{"source": "') -> None:
        self.chunks = chunks
        self.first = first
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for index in range(self.chunks):
            self.pulled += 1
            yield self.first if index == 0 else b"x" * MiB


@pytest.fixture
def backend() -> ManagedBackendDouble:
    return ManagedBackendDouble()


@pytest.fixture
async def client(tmp_path: Path, backend: ManagedBackendDouble) -> AsyncIterator[httpx.AsyncClient]:
    settings = settings_for(
        tmp_path, admin_key=ADMIN_KEY, api_key=[API_KEY], adapter_source_roots=["/adapters"]
    )
    app = create_app(settings, backend=backend)
    transport = httpx.ASGITransport(app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c,
    ):
        yield c


def json_headers(key: str | None = None, **extra: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", **extra}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize("key", [None, "wrong"], ids=["no-key", "wrong-key"])
async def test_a_refused_key_reads_nothing_of_the_body(
    client: httpx.AsyncClient,
    backend: ManagedBackendDouble,
    method: str,
    path: str,
    key: str | None,
) -> None:
    body = CountedBody(96)  # the 96 MB
    response = await client.request(method, path, content=body, headers=json_headers(key))
    assert response.status_code in (401, 403), response.text
    assert body.pulled == 0
    assert not backend.changed_anything()


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
async def test_a_foreign_origin_reads_nothing_of_the_body(
    client: httpx.AsyncClient, backend: ManagedBackendDouble, method: str, path: str
) -> None:
    body = CountedBody(96)
    headers = json_headers(ADMIN_KEY, Origin="http://evil.example")
    response = await client.request(method, path, content=body, headers=headers)
    assert response.status_code == 403, response.text
    assert body.pulled == 0
    assert not backend.changed_anything()


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES[:3])
async def test_admin_bodies_are_capped_declared_or_streamed(
    client: httpx.AsyncClient, backend: ManagedBackendDouble, method: str, path: str
) -> None:
    # Declared: refused on its Content-Length, before a byte is read.
    declared = orjson.dumps({"source": "x" * (2 * MiB), "lora_name": "a", "lora_path": "b"})
    response = await client.request(method, path, content=declared, headers=json_headers(ADMIN_KEY))
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    # Streamed without a length: reading stops at the cap.
    body = CountedBody(96)
    response = await client.request(method, path, content=body, headers=json_headers(ADMIN_KEY))
    assert response.status_code == 413, response.text
    assert body.pulled <= ADMIN_CAP // MiB + 2
    assert not backend.changed_anything()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"source": 5}', "source"),
        (b'{"revision": "main"}', "source"),
        (b'{"source": "/a", "follow": "sometimes"}', "follow"),
        (b"[]", None),
        (b"{not json", None),
        (b"", None),
    ],
)
async def test_put_still_says_what_is_wrong_with_its_body(
    client: httpx.AsyncClient, backend: ManagedBackendDouble, body: bytes, param: str | None
) -> None:
    response = await client.put(
        "/admin/adapters/fine", content=body, headers=json_headers(ADMIN_KEY)
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert not backend.changed_anything()


async def test_put_with_the_admin_key_and_a_fine_body_still_works(
    client: httpx.AsyncClient, backend: ManagedBackendDouble
) -> None:
    body: dict[str, Any] = {"source": "/adapters/fine", "revision": None, "follow": False}
    response = await client.put(
        "/admin/adapters/fine", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert response.status_code == 200, response.text
    assert backend.adapters.changes == [("put", "fine", "/adapters/fine")]


def test_the_openapi_schema_still_describes_the_put_body(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = create_app(settings_for(tmp_path, admin_key=ADMIN_KEY), backend=backend)
    put = app.openapi()["paths"]["/admin/adapters/{name}"]["put"]
    schema = put["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in schema:
        schema = app.openapi()["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    assert schema["required"] == ["source"]
    assert set(schema["properties"]) == {"source", "revision", "follow", "preset"}


def test_a_real_server_answers_an_unauthenticated_put_before_its_body_arrives(
    tmp_path: Path, backend: ManagedBackendDouble
) -> None:
    app = create_app(settings_for(tmp_path, admin_key=ADMIN_KEY), backend=backend)
    with serving(app, as_served=True) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = (
                "PUT /admin/adapters/big HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {96 * MiB}\r\n\r\n"
            )
            sock.sendall(head.encode() + b'{"source": "' + b"x" * MiB)
            # 95 MiB are still to come; the answer must not wait for them.
            answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert not backend.changed_anything()
