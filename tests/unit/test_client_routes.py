"""The routes clients expect of a vLLM server, through the gateway against a stand-in engine.

Anthropic's Messages API (``/v1/messages``, streamed and not, and ``count_tokens``), as the
Anthropic SDK sends it (``x-api-key``, ``anthropic-version``); ``max_model_len`` in the model
list; and a ``--tool-parser-plugin`` whose parser ``--tool-call-parser`` may name. The stand-in
is a FastAPI app shaped like vLLM 0.32's API server, proxied by URL with ``--model-name demo``
naming its ``engine-base``: a rename both ways to check.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from PIL import Image
from starlette.responses import JSONResponse, Response, StreamingResponse

from loragate.gateway.app import create_app
from loragate.plan.tool_parsers import ToolParserError, check_tool_parser
from loragate.settings import Settings
from tests.backend_double import serving

KEY = "client-routes-key"
MAX_MODEL_LEN = 4096


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **data}) + b"\n\n"


def stand_in_engine(bodies: list[dict[str, Any]]) -> FastAPI:
    """vLLM's model list (with ``max_model_len``) and its Anthropic routes."""
    engine = FastAPI()

    @engine.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": "engine-base", "object": "model", "max_model_len": MAX_MODEL_LEN}
        return {"object": "list", "data": [entry]}

    @engine.get("/health")
    async def health() -> Response:
        return Response()

    @engine.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await request.json()
        bodies.append(body)
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [{"type": "text", "text": "hello"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 1},
        }
        if not body.get("stream"):
            return JSONResponse(message)

        async def events() -> AsyncIterator[bytes]:
            start = {**message, "content": [], "stop_reason": None}
            yield _event("message_start", {"message": start})
            block = {"type": "text", "text": ""}
            yield _event("content_block_start", {"index": 0, "content_block": block})
            delta = {"type": "text_delta", "text": "hello"}
            yield _event("content_block_delta", {"index": 0, "delta": delta})
            yield _event("content_block_stop", {"index": 0})
            stop = {"stop_reason": "end_turn", "stop_sequence": None}
            yield _event("message_delta", {"delta": stop, "usage": {"output_tokens": 1}})
            yield _event("message_stop", {})

        return StreamingResponse(events(), media_type="text/event-stream")

    @engine.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        bodies.append(await request.json())
        return {"input_tokens": 7}

    return engine


@pytest.fixture
def bodies() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def gateway_url(tmp_path: Path, bodies: list[dict[str, Any]]) -> Iterator[str]:
    with serving(stand_in_engine(bodies)) as engine_url:
        settings = Settings(
            upstream_url=engine_url + "/v1",
            model_name="demo",
            cache_dir=tmp_path,
            api_key=[KEY],
            allowed_media_dir=tmp_path,
        )
        with serving(create_app(settings)) as url:
            yield url


@pytest.fixture
def client(gateway_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway_url, api_key=KEY, max_retries=0)


HELLO = [{"role": "user", "content": "hi"}]


def test_anthropic_messages_reach_the_engine_by_its_id_and_answer_with_the_public_name(
    client: anthropic.Anthropic, bodies: list[dict[str, Any]]
) -> None:
    message = client.messages.create(model="demo", max_tokens=8, messages=HELLO)  # type: ignore[arg-type]
    assert message.model == "demo"
    assert message.content[0].text == "hello"  # type: ignore[union-attr]
    assert bodies[-1]["model"] == "engine-base"


def test_anthropic_streamed_messages_carry_the_public_name(
    client: anthropic.Anthropic, bodies: list[dict[str, Any]]
) -> None:
    with client.messages.stream(model="demo", max_tokens=8, messages=HELLO) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (text, final.model) == ("hello", "demo")
    assert bodies[-1]["model"] == "engine-base" and bodies[-1]["stream"] is True


def test_anthropic_count_tokens_is_forwarded(
    client: anthropic.Anthropic, bodies: list[dict[str, Any]]
) -> None:
    counted = client.messages.count_tokens(model="demo", messages=HELLO)  # type: ignore[arg-type]
    assert counted.input_tokens == 7
    assert bodies[-1]["model"] == "engine-base"


def test_anthropic_messages_without_a_key_are_refused_before_the_engine(
    gateway_url: str, bodies: list[dict[str, Any]]
) -> None:
    for headers in ({}, {"x-api-key": "wrong"}):
        answer = httpx.post(
            gateway_url + "/v1/messages",
            json={"model": "demo", "max_tokens": 8, "messages": HELLO},
            headers={"anthropic-version": "2023-06-01", **headers},
        )
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert bodies == []


def test_anthropic_messages_for_an_unknown_model_get_an_openai_error(
    client: anthropic.Anthropic, bodies: list[dict[str, Any]]
) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="nope", max_tokens=8, messages=HELLO)  # type: ignore[arg-type]
    assert raised.value.body["error"]["code"] == "model_not_found"  # type: ignore[index]
    assert bodies == []


def _png(size: tuple[int, int] = (8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def _image_message(source: dict[str, Any]) -> list[dict[str, Any]]:
    block = {"type": "image", "source": source}
    return [{"role": "user", "content": [block, {"type": "text", "text": "what is it?"}]}]


def test_anthropic_image_url_source_is_read_by_the_gateway_and_sent_as_base64(
    client: anthropic.Anthropic, bodies: list[dict[str, Any]], tmp_path: Path
) -> None:
    picture = tmp_path / "red.png"
    picture.write_bytes(_png())
    source = {"type": "url", "url": str(picture)}  # inside allowed_media_dir
    client.messages.create(model="demo", max_tokens=8, messages=_image_message(source))  # type: ignore[arg-type]
    sent = bodies[-1]["messages"][0]["content"][0]["source"]
    assert sent["type"] == "base64" and sent["media_type"] == "image/png"
    assert Image.open(io.BytesIO(base64.b64decode(sent["data"]))).size == (8, 8)
    assert "url" not in sent


def test_anthropic_image_sources_the_policy_refuses_never_reach_the_engine(
    gateway_url: str, bodies: list[dict[str, Any]]
) -> None:
    refused = [
        {"type": "url", "url": "http://127.0.0.1:1/secret.png"},  # loopback: not allowed
        {"type": "url", "url": "/etc/passwd"},  # outside allowed_media_dir
        {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"},
        {"type": "file", "file_id": "file_1"},
    ]
    for source in refused:
        answer = httpx.post(
            gateway_url + "/v1/messages",
            json={"model": "demo", "max_tokens": 8, "messages": _image_message(source)},
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        )
        assert answer.status_code in (400, 403), (source, answer.text)
        error = answer.json()["error"]
        assert error["param"].startswith("messages[0].content[0].source"), error
    assert bodies == []


def test_every_model_list_entry_has_the_engines_max_model_len(gateway_url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    listing = httpx.get(gateway_url + "/v1/models", headers=headers).json()
    assert [(m["id"], m["max_model_len"]) for m in listing["data"]] == [("demo", MAX_MODEL_LEN)]
    one = httpx.get(gateway_url + "/v1/models/demo", headers=headers).json()
    assert one["max_model_len"] == MAX_MODEL_LEN


# ----- --tool-parser-plugin -------------------------------------------------------------------

PLUGIN = """
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager


@ToolParserManager.register_module("acme_calls")
class AcmeToolParser(ToolParser):
    pass


@ToolParserManager.register_module(name=["acme_v2", "acme_v3"])
class AcmeV2ToolParser(ToolParser):
    pass


@ToolParserManager.register_module()
class Unnamed(ToolParser):
    pass
"""


def test_a_parser_a_plugin_registers_is_accepted_by_name(tmp_path: Path) -> None:
    plugin = tmp_path / "acme_parser.py"
    plugin.write_text(PLUGIN)
    for name in ("acme_calls", "acme_v2", "acme_v3", "Unnamed", "hermes"):
        args = ["--tool-parser-plugin", str(plugin)]
        assert check_tool_parser(name, engine_args=args) == name
    assert check_tool_parser("acme_v2", engine_args=[f"--tool_parser_plugin={plugin}"]) == "acme_v2"
    with pytest.raises(ToolParserError, match="acme_calls"):  # the list names the plugin's
        check_tool_parser("acme_v9", engine_args=["--tool-parser-plugin", str(plugin)])
    with pytest.raises(ToolParserError, match="not one vLLM knows"):
        check_tool_parser("acme_calls")  # without the plugin


def test_a_plugin_whose_names_are_computed_is_trusted(tmp_path: Path) -> None:
    plugin = tmp_path / "computed.py"
    plugin.write_text(
        "NAMES = ['x']\n@ToolParserManager.register_module(NAMES)\nclass P(ToolParser): ...\n"
    )
    assert check_tool_parser("x", engine_args=["--tool-parser-plugin", str(plugin)]) == "x"


def test_a_plugin_file_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ToolParserError, match="cannot be read"):
        check_tool_parser("x", engine_args=["--tool-parser-plugin", str(tmp_path / "nope.py")])
