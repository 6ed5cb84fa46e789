"""The engine's allow-listed routes through the gateway, against a stand-in engine.

The stand-in is a small FastAPI app shaped like vLLM 0.32's API server: it serves the
allow-listed routes, the engine's own admin routes (which must stay unreachable), audio
uploads (the CPU build has no audio stack), and FastAPI's bare ``{"detail": "Not Found"}``
for anything else. The gateway in front of it proxies it by URL (the upstream backend), with
``--model-name demo`` naming the engine's ``engine-base``: a rename both ways to check.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from PIL import Image
from starlette.responses import JSONResponse, Response, StreamingResponse

from loragate.gateway.access.engine_allow_list import ENGINE_ROUTES, engine_route
from loragate.gateway.app import create_app
from loragate.gateway.observe.tracing import trace_headers_of
from loragate.serving.engine_names import AnyVersionRename
from loragate.settings import Settings
from tests.backend_double import serving

ENGINE_ADMIN_ROUTES = [
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/abort_requests"),
    ("POST", "/invocations"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/pause"),
    ("POST", "/update_weights"),
    ("GET", "/server_info"),
]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def stand_in_engine(seen: list[Seen]) -> FastAPI:
    engine = FastAPI()

    @engine.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        body = await request.body()
        seen.append(Seen(request.method, request.url.path, dict(request.headers), body))
        return await call_next(request)

    @engine.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "engine-base", "object": "model"}]}

    @engine.get("/health")
    async def health() -> Response:
        return Response()

    @engine.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await request.json()
        answer = {"id": "resp_1", "object": "response", "model": body["model"], "output": []}
        if not body.get("stream"):
            return JSONResponse(answer)

        async def events() -> AsyncIterator[bytes]:
            for kind in ("response.created", "response.in_progress", "response.completed"):
                event = {"type": kind, "response": answer}
                yield f"event: {kind}\ndata: ".encode() + orjson.dumps(event) + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @engine.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        return JSONResponse({"id": response_id, "object": "response", "model": "engine-base"})

    @engine.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"tokens": [1, 2, 3], "count": 3, "max_model_len": 512, "model": body["model"]}

    @engine.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "0.32.0"}

    @engine.post("/v1/audio/transcriptions")
    async def transcribe(request: Request) -> dict[str, Any]:
        form = await request.form()
        upload = form["file"]
        assert not isinstance(upload, str)
        content = await upload.read()
        return {
            "text": f"{form['model']} heard {len(content)} bytes in {form.get('language')}",
            "model": form["model"],
        }

    for method, path in ENGINE_ADMIN_ROUTES:
        engine.add_api_route(
            path, lambda: {"reached": "the engine's admin route"}, methods=[method]
        )
    return engine


@pytest.fixture
def seen() -> list[Seen]:
    return []


@pytest.fixture
def gateway(tmp_path: Path, seen: list[Seen]) -> Iterator[httpx.Client]:
    with serving(stand_in_engine(seen)) as engine_url:
        settings = Settings(
            upstream_url=engine_url + "/v1",
            model_name="demo",
            cache_dir=tmp_path,
            access_log=True,
            allowed_media_dir=tmp_path,
        )
        with serving(create_app(settings)) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield client


def engine_paths(seen: list[Seen]) -> list[str]:
    return [s.path for s in seen if s.path not in ("/v1/models", "/health")]


@pytest.mark.parametrize(("method", "path"), ENGINE_ADMIN_ROUTES)
def test_the_engines_admin_routes_are_unreachable_through_the_gateway(
    gateway: httpx.Client, seen: list[Seen], method: str, path: str
) -> None:
    answer = gateway.request(method, path, json={"lora_name": "x", "lora_path": "/tmp"})
    # The gateway's own /v1/load_lora_adapter (through the adapter manager) wants its admin key.
    assert answer.status_code in ((401, 403, 503) if "lora_adapter" in path else (404, 405))
    assert "error" in answer.json()
    assert engine_paths(seen) == []


def test_every_allow_listed_route_maps_to_its_template() -> None:
    for route in ENGINE_ROUTES:
        assert engine_route(route.path.replace("{id}", "resp_42")) == route
    assert engine_route("/v1/responses/") is None
    assert engine_route("/abort_requests") is None


def test_responses_rename_the_model_both_ways(gateway: httpx.Client, seen: list[Seen]) -> None:
    answer = gateway.post("/v1/responses", json={"model": "demo", "input": "hi"})
    assert answer.status_code == 200
    assert answer.json()["model"] == "demo"
    assert orjson.loads(seen[-1].body)["model"] == "engine-base"


def test_every_streamed_responses_event_carries_the_public_name(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    with gateway.stream(
        "POST", "/v1/responses", json={"model": "demo", "input": "hi", "stream": True}
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert len(events) == 3
    assert all(orjson.loads(event)["response"]["model"] == "demo" for event in events)
    assert "engine-base" not in text


def test_tokenize_and_version_pass_through(gateway: httpx.Client, seen: list[Seen]) -> None:
    tokens = gateway.post("/tokenize", json={"prompt": "hello"})
    assert tokens.status_code == 200
    assert tokens.json()["tokens"] == [1, 2, 3]
    assert orjson.loads(seen[-1].body)["model"] == "engine-base"  # the base when none is named
    version = gateway.get("/version")
    assert version.json() == {"version": "0.32.0"}
    assert seen[-1].method == "GET"


def test_stored_responses_are_fetched_by_id(gateway: httpx.Client, seen: list[Seen]) -> None:
    answer = gateway.get("/v1/responses/resp_7", params={"stream": "false", "other": "x"})
    assert answer.status_code == 200
    assert answer.json()["id"] == "resp_7"
    assert seen[-1].path == "/v1/responses/resp_7"
    assert gateway.get("/v1/responses/..").status_code == 404


@pytest.mark.parametrize("path", ["/v1/embeddings", "/classify", "/v2/rerank", "/v2/embed"])
def test_a_route_the_engine_lacks_for_its_model_says_why(
    gateway: httpx.Client, seen: list[Seen], path: str
) -> None:
    answer = gateway.post(path, json={"model": "demo", "input": "hi"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "route_not_served"
    assert "pooling model" in error["message"]
    assert "/v1/chat/completions" in error["message"]
    assert seen[-1].path == path  # the engine was asked, and said Not Found


def test_an_unknown_model_is_refused_before_the_engine(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    answer = gateway.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"
    assert engine_paths(seen) == []


def test_models_are_retrieved_by_id_from_the_gateways_list(gateway: httpx.Client) -> None:
    assert gateway.get("/v1/models/demo").json()["id"] == "demo"
    missing = gateway.get("/v1/models/fox")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_audio_uploads_pass_through_with_the_model_renamed(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    audio = b"RIFF" + bytes(range(256)) * 4
    answer = gateway.post(
        "/v1/audio/transcriptions",
        data={"model": "demo", "language": "en"},
        files={"file": ("clip.wav", audio, "audio/wav")},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"text": f"engine-base heard {len(audio)} bytes in en", "model": "demo"}
    assert seen[-1].headers["content-type"].startswith("multipart/form-data; boundary=")


def test_audio_routes_want_an_upload(gateway: httpx.Client, seen: list[Seen]) -> None:
    answer = gateway.post("/v1/audio/translations", json={"model": "demo"})
    assert answer.status_code == 415
    assert engine_paths(seen) == []


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_trace_context_reaches_the_engine_and_the_access_log(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    # A handler on the access logger itself: other tests may have set up logging so that its
    # records do not propagate to pytest's capture.
    access = logging.getLogger("loragate.access")
    handler, level = _Lines(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
        gateway.post(
            "/v1/chat/completions", json={"model": "demo", "messages": []}, headers=headers
        )
        gateway.post("/tokenize", json={"prompt": "hi"}, headers=headers)
        deadline = time.monotonic() + 5  # the line is written just after the answer is sent
        while not any("/tokenize" in line for line in handler.lines):
            assert time.monotonic() < deadline, handler.lines
            time.sleep(0.01)
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    forwarded = [s for s in seen if s.path in ("/v1/chat/completions", "/tokenize")]
    assert [s.path for s in forwarded] == ["/tokenize"]  # the empty chat was refused (400)
    assert forwarded[0].headers["traceparent"] == TRACEPARENT
    assert forwarded[0].headers["tracestate"] == "vendor=1"
    assert any(
        "/tokenize" in line and "trace_id=4bf92f3577b34da6" in line for line in handler.lines
    )


def test_only_valid_trace_parents_travel() -> None:
    assert trace_headers_of({"traceparent": TRACEPARENT}) == {"traceparent": TRACEPARENT}
    for bad in (
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "junk\r\nX-Evil: 1",
    ):
        assert trace_headers_of({"traceparent": bad, "tracestate": "a=b"}) == {}


def png_data_uri() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 10)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_input(image: dict[str, Any]) -> dict[str, Any]:
    part = {"type": "input_image", **image}
    return {
        "model": "demo",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "?"}, part]}],
    }


def test_responses_images_get_the_chat_routes_media_policy(
    gateway: httpx.Client, seen: list[Seen], tmp_path: Path
) -> None:
    private = gateway.post(
        "/v1/responses", json=image_input({"image_url": "http://127.0.0.1:9/x.png"})
    )
    assert private.status_code == 403
    by_id = gateway.post("/v1/responses", json=image_input({"file_id": "file-1"}))
    assert by_id.status_code == 400
    outside = gateway.post("/v1/responses", json=image_input({"image_url": "/etc/passwd"}))
    assert outside.status_code in (400, 403)
    mcp = gateway.post(
        "/v1/responses",
        json={"model": "demo", "input": "hi", "tools": [{"type": "mcp", "server_url": "http://x"}]},
    )
    assert mcp.status_code == 400
    assert engine_paths(seen) == []
    (tmp_path / "green.png").write_bytes(base64.b64decode(png_data_uri().split(",", 1)[1]))
    local = gateway.post(
        "/v1/responses", json=image_input({"image_url": str(tmp_path / "green.png")})
    )
    assert local.status_code == 200, local.text
    sent = orjson.loads(seen[-1].body)["input"][0]["content"][1]
    assert sent["image_url"].startswith("data:image/png;base64,")


def test_every_version_of_an_adapter_is_renamed_to_its_public_name() -> None:
    rename = AnyVersionRename("__base__@0123456789ab", "demo")
    data = b'{"model":"fox@00112233aabb","x":{"model":"__base__@0123456789ab"}}'
    assert rename.model_field(data) == b'{"model":"fox","x":{"model":"demo"}}'
    assert rename.everywhere(b"no such model fox@00112233aabb.") == b"no such model fox."


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_on_a_pooling_engine_says_why(
    gateway: httpx.Client, seen: list[Seen], path: str
) -> None:
    """vLLM answers a bare Not Found for generation routes when it runs a pooling model."""
    body: dict[str, Any] = {"model": "demo", "max_tokens": 4}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    answer = gateway.post(path, json=body)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "route_not_served"
    assert "pooling model" in error["message"] and "/v1/embeddings" in error["message"]
    assert seen[-1].path == path  # the engine was asked, and said Not Found
