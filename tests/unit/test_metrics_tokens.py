"""Usage an operator bills and plans on: tokens by public model from each answer's ``usage``
(streamed answers included, whether or not the client asked for the usage chunk), time per
output token, the access log's trace id, adapter version and tokens, the status page's
activity list, and no ``loragate_process_*`` copies of ``process_*``.

Against the stand-in engine (it answers ``usage`` as vLLM does: 8 prompt tokens, ``max_tokens``
generated, and the last usage chunk of a stream only when ``stream_options.include_usage``),
through the app in-process (ASGI) and under ``gateway serve``'s own protocol.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from starlette.responses import Response

from loragate.gateway.app import create_app
from loragate.gateway.backends.base import json_post
from loragate.logs import JsonFormatter
from loragate.serving.engine_names import Rename
from loragate.settings import Settings
from tests.backend_double import ProxiedBackend, engine_snapshot, serving
from tests.unit.test_metrics import Samples, parse, value
from tools.bench.fake_engine import FakeEngine, start_server

ADMIN = "admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
VERSION = "0123456789ab"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class VersionedBackend(ProxiedBackend):
    """Sends ``tuned`` to the engine as ``tuned@VERSION`` (a supervised engine's adapter id)
    and renames it back in the answer, as the managed backend does; reports a serving
    engine whose own /metrics it scrapes."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url, ["base", "tuned"], engine=engine_snapshot(), engine_url=base_url)

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        engine_id = f"{public_model}@{VERSION}" if public_model == "tuned" else public_model
        call = json_post(path, payload, public_model, stream, request_id)
        return await self.proxy.forward(
            self.base_url + path,
            call.body(engine_id),
            {"Content-Type": "application/json", "X-Request-Id": request_id},
            stream=stream,
            rename=Rename.of(engine_id, public_model),
            on_done=lambda: None,
            response_headers={"X-Request-ID": request_id},
        )


@pytest_asyncio.fixture(loop_scope="function")
async def engine() -> AsyncIterator[str]:
    fake = FakeEngine(api_key=None, models=["base", f"tuned@{VERSION}"], kv_cache_usage=0.25)
    server = await start_server(fake)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def gateway(engine: str, tmp_path: Path, how: str, **settings: Any) -> Iterator[httpx.AsyncClient]:
    """A client of the gateway in front of ``engine``: in-process (``asgi``) or as ``gateway
    serve`` runs it (``served``: uvicorn with the hot-route protocol, on a real socket)."""
    app = create_app(
        Settings(cache_dir=tmp_path, admin_key=ADMIN, **settings), backend=VersionedBackend(engine)
    )
    if how == "asgi":
        yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
        return
    with serving(app, as_served=True) as url:
        yield httpx.AsyncClient(base_url=url, timeout=10)


def events(body: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in body.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.parametrize("how", ["asgi", "served"])
async def test_token_counters_move_by_exactly_the_usage_of_each_answer(
    engine: str, tmp_path: Path, how: str
) -> None:
    prompt = {"base": 0, "tuned": 0}
    completion = {"base": 0, "tuned": 0}
    messages = [{"role": "user", "content": "hi"}]
    with gateway(engine, tmp_path, how) as client:
        async with client:
            # Plain answers: the usage the client reads is what is counted.
            for model, route, body in (
                ("base", "/v1/chat/completions", {"messages": messages, "max_tokens": 3}),
                ("tuned", "/v1/completions", {"prompt": "x", "max_tokens": 5}),
                ("tuned", "/v1/chat/completions", {"messages": messages, "max_tokens": 7}),
            ):
                answer = await client.post(route, json={"model": model, **body})
                assert answer.status_code == 200, answer.text
                usage = answer.json()["usage"]
                prompt[model] += usage["prompt_tokens"]
                completion[model] += usage["completion_tokens"]
            # A stream whose client asked for usage: it gets the usage chunk, and it counts.
            asked = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "base",
                    "messages": messages,
                    "max_tokens": 6,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            usage_chunks = [e for e in events(asked.text) if e.get("usage")]
            assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == []
            prompt["base"] += usage_chunks[0]["usage"]["prompt_tokens"]
            completion["base"] += usage_chunks[0]["usage"]["completion_tokens"]
            # Streams whose clients did not ask: counted all the same (the gateway asked the
            # engine), and the client sees the stream it asked for, with no usage chunk.
            for model, route, body in (
                ("tuned", "/v1/chat/completions", {"messages": messages, "max_tokens": 4}),
                ("base", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                (
                    "tuned",
                    "/v1/completions",
                    {"prompt": "x", "max_tokens": 9, "stream_options": {"include_usage": False}},
                ),
            ):
                streamed = await client.post(route, json={"model": model, "stream": True, **body})
                assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
                seen = events(streamed.text)
                assert len(seen) == body["max_tokens"] and all("usage" not in e for e in seen)
                assert {e["model"] for e in seen} == {model}
                prompt[model] += 8  # the stand-in engine's usage: 8, and max_tokens generated
                completion[model] += body["max_tokens"]
            samples = parse((await client.get("/metrics")).text)
    for model in ("base", "tuned"):
        assert value(samples, "loragate_prompt_tokens_total", model_name=model) == prompt[model]
        assert (
            value(samples, "loragate_completion_tokens_total", model_name=model)
            == completion[model]
        )
    assert completion == {"base": 3 + 6 + 2, "tuned": 5 + 7 + 4 + 9}
    # Time per output token: each stream of more than one token, once.
    assert value(samples, "loragate_time_per_output_token_seconds_count", model_name="base") == 2
    assert value(samples, "loragate_time_per_output_token_seconds_count", model_name="tuned") == 2


async def test_a_failed_request_counts_no_tokens(engine: str, tmp_path: Path) -> None:
    with gateway(engine, tmp_path, "asgi") as client:
        async with client:
            missing = await client.post(
                "/v1/chat/completions",
                json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert missing.status_code == 404
            samples = parse((await client.get("/metrics")).text)
    assert not [name for name, _ in samples if name.startswith("loragate_prompt_tokens")]


async def test_the_json_access_log_line_carries_trace_id_adapter_version_and_tokens(
    engine: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loragate.access")
    with gateway(engine, tmp_path, "asgi", access_log=True) as client:
        async with client:
            answer = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tuned",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                },
                headers={"traceparent": TRACEPARENT, "X-Request-ID": "req-7"},
            )
    assert answer.status_code == 200 and answer.json()["model"] == "tuned"
    records = [r for r in caplog.records if r.name == "loragate.access"]
    assert len(records) == 1
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["trace_id"] == TRACE_ID
    assert line["request_id"] == "req-7"
    assert line["model"] == "tuned" and line["version"] == VERSION
    assert line["prompt_tokens"] == 8 and line["completion_tokens"] == 3
    assert f"version={VERSION}" in line["message"] and "tokens=8+3" in line["message"]


async def test_the_scrape_has_no_loragate_copies_of_the_process_series(
    engine: str, tmp_path: Path
) -> None:
    with gateway(engine, tmp_path, "asgi") as client:
        async with client:
            text = (await client.get("/metrics")).text
    samples: Samples = parse(text)
    names = {name for name, _ in samples}
    assert not [name for name in names if name.startswith("loragate_process_")]
    # prometheus_client's own collector says the same, once.
    assert value(samples, "process_resident_memory_bytes") > 0
    assert "process_cpu_seconds_total" in names


async def test_the_status_pages_activity_shows_each_request_its_tokens_and_the_kv_cache(
    engine: str, tmp_path: Path
) -> None:
    with gateway(engine, tmp_path, "asgi") as client:
        async with client:
            assert (await client.get("/admin/activity")).status_code == 401
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            await client.post("/v1/chat/completions", json={"model": "base", **body})
            await client.post(
                "/v1/chat/completions", json={"model": "tuned", "stream": True, **body}
            )
            await client.post("/v1/chat/completions", json={"model": "nope", **body})
            answer = await client.get("/admin/activity", headers=AUTH)
    assert answer.status_code == 200
    activity = answer.json()
    newest, streamed, plain = activity["requests"]
    assert (newest["model"], newest["status"], newest["prompt_tokens"]) == ("unknown", 404, None)
    assert (streamed["model"], streamed["version"], streamed["stream"]) == ("tuned", VERSION, True)
    assert (streamed["prompt_tokens"], streamed["completion_tokens"]) == (8, 4)
    assert (plain["model"], plain["status"], plain["completion_tokens"]) == ("base", 200, 4)
    assert plain["latency_s"] >= 0 and plain["at"] > 0
    assert activity["tokens_per_second"] == pytest.approx(8 / 10)
    assert activity["kv_cache_usage"] == 0.25


async def test_the_activity_list_keeps_the_last_fifty_requests(engine: str, tmp_path: Path) -> None:
    with gateway(engine, tmp_path, "asgi") as client:
        async with client:
            for _ in range(55):
                await client.post("/v1/completions", json={"model": "base", "prompt": "x"})
            activity = (await client.get("/admin/activity", headers=AUTH)).json()
    assert len(activity["requests"]) == 50
