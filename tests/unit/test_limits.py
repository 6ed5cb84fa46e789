"""Input limits and malformed requests: a clear 4xx, and nothing of the request reaches a backend."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from loragate.gateway.app import create_app
from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.images.resolve import MediaPolicy
from loragate.gateway.requests.parameters import MAX_N, check_parameters
from tests.backend_double import RecordingBackend, settings_for

JSON = {"Content-Type": "application/json"}
LIMITS = {
    "max_body_bytes": 64 * 1024,
    "max_messages": 3,
    "max_tokens_cap": 64,
    "max_image_bytes": 2000,
    "max_image_pixels": 32 * 32,
}


def png(width: int = 8, height: int = 8, noise: bool = False) -> bytes:
    """A PNG; with ``noise`` its pixels are random, so it hardly compresses."""
    image = Image.new("RGB", (width, height), "red")
    if noise:
        image = Image.frombytes(
            "RGB", (width, height), random.Random(0).randbytes(width * height * 3)
        )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def chat(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "base", "messages": [{"role": "user", "content": content}], **extra}


def image_chat(url: str) -> dict[str, Any]:
    return chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}])


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
async def client(tmp_path: Path, backend: RecordingBackend) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings_for(tmp_path, **LIMITS), backend=backend)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
    ) as c:
        yield c


async def refused(
    client: httpx.AsyncClient, backend: RecordingBackend, status: int, code: str, **request: Any
) -> dict[str, Any]:
    """Send one request; check its status and error code and that the backend saw nothing."""
    path = request.pop("path", "/v1/chat/completions")
    response = await client.post(path, **request)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert set(error) == {"message", "type", "param", "code"}
    assert backend.forwarded == []
    return dict(error)


# ----- the body ---------------------------------------------------------------------------------


async def test_a_body_over_the_cap_is_413_naming_the_flag(
    client: httpx.AsyncClient, backend: RecordingBackend
) -> None:
    body = chat("x" * 70_000)
    error = await refused(client, backend, 413, "request_too_large", json=body)
    assert "larger than 65536 bytes (--max-body-bytes)" in error["message"]


async def test_a_streamed_body_without_a_length_is_cut_off_at_the_cap(
    client: httpx.AsyncClient, backend: RecordingBackend
) -> None:
    async def endless() -> AsyncIterator[bytes]:
        for _ in range(1000):  # 1 MB in 1 kB chunks, with no Content-Length to refuse up front
            yield b" " * 1024

    await refused(client, backend, 413, "request_too_large", content=endless(), headers=JSON)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "body is empty"),
        (b"{not json", "not valid JSON"),
        (b'{"model": NaN}', "not valid JSON"),
        (b"\xef\xbb\xbf{}", "not valid JSON"),
        (b'{"a": "\xff"}', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),
        (b'[{"role": "user"}]', "must be a JSON object"),
        (b'"just a string"', "must be a JSON object"),
    ],
    ids=["empty", "truncated", "nan", "bom", "not-utf8", "too-deep", "array", "string"],
)
async def test_malformed_json_is_a_400_that_says_so(
    client: httpx.AsyncClient, backend: RecordingBackend, raw: bytes, fragment: str
) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        error = await refused(
            client, backend, 400, "invalid_json", path=path, content=raw, headers=JSON
        )
        assert fragment in error["message"]


# ----- the fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "base", "messages": "hi"}, "invalid_request", "messages"),
        ({"model": "base", "messages": []}, "invalid_request", "messages"),
        ({"model": "base", "messages": ["hi"]}, "invalid_request", "messages[0]"),
        (
            {"model": "base", "messages": [{"role": "root", "content": "hi"}]},
            "invalid_role",
            "messages[0].role",
        ),
        (
            {"model": "base", "messages": [{"content": "hi"}]},
            "invalid_role",
            "messages[0].role",
        ),
        (
            {"model": "base", "messages": [{"role": ["user"], "content": "hi"}]},
            "invalid_role",
            "messages[0].role",
        ),
        (
            {"model": "base", "messages": [{"role": {"user": 1}, "content": "hi"}]},
            "invalid_role",
            "messages[0].role",
        ),
        (chat(42), "invalid_request", "messages[0].content"),
        (chat([{"text": "no type"}]), "invalid_request", "messages[0].content[0]"),
        (chat([{"type": "text", "text": 7}]), "invalid_request", "messages[0].content[0].text"),
        (chat(max_tokens="8"), "invalid_value", "max_tokens"),
        (chat(max_tokens=0), "invalid_value", "max_tokens"),
        (chat(max_tokens=True), "invalid_value", "max_tokens"),
        (chat(max_tokens=65), "max_tokens_too_large", "max_tokens"),
        (chat(max_completion_tokens=1000), "max_tokens_too_large", "max_completion_tokens"),
        ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "invalid_type", "model"),
        (
            {"messages": [{"role": "user", "content": "hi"}] * 4},
            "too_many_messages",
            "messages",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "source": "a.png",
                "user_prompt": "?",
            },
            "ambiguous_request_format",
            None,
        ),
        ({"model": "base", "temperature": 0.5}, "missing_messages", "messages"),
        ({"user_prompt": 5}, "invalid_request", "user_prompt"),
        ({"user_prompt": "?", "generation_config": {"evil": 1}}, "unsupported_parameter", None),
    ],
    ids=[
        "messages-string",
        "messages-empty",
        "message-not-object",
        "unknown-role",
        "missing-role",
        "role-a-list",
        "role-an-object",
        "content-number",
        "part-without-type",
        "text-not-string",
        "max-tokens-string",
        "max-tokens-zero",
        "max-tokens-bool",
        "max-tokens-over-cap",
        "max-completion-tokens-over-cap",
        "model-number",
        "too-many-messages",
        "both-formats",
        "neither-format",
        "vi-prompt-number",
        "vi-unknown-generation-key",
    ],
)
async def test_wrong_fields_are_a_400_naming_the_field(
    client: httpx.AsyncClient,
    backend: RecordingBackend,
    body: dict[str, Any],
    code: str,
    param: str | None,
) -> None:
    error = await refused(client, backend, 400, code, json=body)
    if param is not None:
        assert error["param"] == param
    assert error["message"]


async def test_an_unknown_model_is_404_naming_the_valid_ones(
    client: httpx.AsyncClient, backend: RecordingBackend
) -> None:
    error = await refused(client, backend, 404, "model_not_found", json=chat(model="nope"))
    assert "base" in error["message"] and "pong" in error["message"]


async def test_legacy_completions_have_the_same_token_cap(
    client: httpx.AsyncClient, backend: RecordingBackend
) -> None:
    body = {"model": "base", "prompt": "hi", "max_tokens": 65}
    await refused(client, backend, 400, "max_tokens_too_large", path="/v1/completions", json=body)


async def test_requests_within_every_limit_do_reach_the_backend(
    client: httpx.AsyncClient, backend: RecordingBackend
) -> None:
    body = {
        "model": "pong",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 64,
    }
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert (
        await client.post("/v1/chat/completions", json=image_chat(data_uri(png())))
    ).status_code == 200
    assert [path for path, _ in backend.forwarded] == ["/v1/chat/completions"] * 2


# ----- images ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "code", "fragment"),
    [
        (data_uri(png(), "png").replace(";base64", ""), "invalid_image", "must look like"),
        ("data:image/png;base64,!!!notbase64", "invalid_image", "not valid base64"),
        (data_uri(b"just some text, not an image"), "invalid_image", "not a PNG, JPEG"),
        (data_uri(png()[:40]), "invalid_image", "truncated or corrupt"),
        (data_uri(png(30, 30, noise=True)), "image_too_large", "(--max-image-bytes)"),
        (data_uri(png(33, 32)), "image_too_large", "(--max-image-pixels)"),
        ("ftp://example.com/cat.png", "invalid_image", "Unsupported image URL scheme"),
        ("gopher://example.com/cat.png", "invalid_image", "Unsupported image URL scheme"),
        ("https://[::1/cat.png", "invalid_image", "no valid host"),
        ("http:///cat.png", "invalid_image", "no valid host"),
        ("", "invalid_image", "non-empty string"),
        ("cat.png", "local_media_disabled", "--allowed-media-dir"),
        ("/etc/passwd", "local_media_disabled", "--allowed-media-dir"),
        ("file:///etc/passwd", "local_media_disabled", "--allowed-media-dir"),
    ],
    ids=[
        "data-uri-not-base64-form",
        "bad-base64",
        "not-an-image",
        "truncated-png",
        "too-many-bytes",
        "too-many-pixels",
        "ftp",
        "gopher",
        "bad-ipv6-host",
        "no-host",
        "empty",
        "relative-path-no-media-dir",
        "absolute-path-no-media-dir",
        "file-url-no-media-dir",
    ],
)
async def test_bad_images_are_a_400_naming_the_problem(
    client: httpx.AsyncClient, backend: RecordingBackend, url: str, code: str, fragment: str
) -> None:
    error = await refused(client, backend, 400, code, json=image_chat(url))
    assert fragment in error["message"]
    assert error["param"] == "messages[0].content[0].image_url.url"
    # The Vi shape is checked the same way and names its own field.
    vi = {"model": "base", "source": url, "user_prompt": "?"}
    if url:
        error = await refused(client, backend, 400, code, json=vi)
        assert error["param"] == "source"


@pytest.mark.parametrize(
    "path",
    ["a\x00b.png", "/etc/passwd\x00.png", "~no-such-user-here/x.png"],
    ids=["nul", "nul-after-real-path", "unknown-home"],
)
async def test_odd_local_paths_are_a_400_not_a_crash(tmp_path: Path, path: str) -> None:
    policy = MediaPolicy(tmp_path, 10_000, 10_000)
    with pytest.raises(OpenAIError) as caught:
        await policy.image(path, "source")
    assert caught.value.status == 400


# ----- generation parameters -------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "route", "param"),
    [
        ({"stream": "yes"}, "chat", "stream"),
        ({"temperature": "hot"}, "chat", "temperature"),
        ({"temperature": -0.1}, "chat", "temperature"),
        ({"top_p": 0}, "chat", "top_p"),
        ({"top_p": 1.5}, "chat", "top_p"),
        ({"top_k": -2}, "chat", "top_k"),
        ({"top_k": 1.5}, "chat", "top_k"),
        ({"n": 0}, "chat", "n"),
        ({"n": MAX_N + 1}, "chat", "n"),
        ({"n": 10**9}, "completions", "n"),
        ({"seed": 2**64}, "chat", "seed"),
        ({"stop": 5}, "chat", "stop"),
        ({"stop": ["ok", 5]}, "chat", "stop"),
        ({"presence_penalty": 3}, "chat", "presence_penalty"),
        ({"repetition_penalty": 0}, "chat", "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "chat", "logit_bias"),
        ({"logit_bias": {"42": 101}}, "chat", "logit_bias"),
        ({"logit_bias": [1, 2]}, "chat", "logit_bias"),
        ({"logprobs": 5}, "chat", "logprobs"),
        ({"logprobs": True, "prompt": "x"}, "completions", "logprobs"),
        ({"top_logprobs": 21}, "chat", "top_logprobs"),
        ({"stream_options": {"include_usage": "yes"}}, "chat", "stream_options.include_usage"),
        ({"tools": ["not an object"]}, "chat", "tools"),
        ({"prompt": 5}, "completions", "prompt"),
        ({"prompt": []}, "completions", "prompt"),
        ({"prompt": ["ok", 5]}, "completions", "prompt"),
        ({"max_tokens": 5}, "completions", "prompt"),
    ],
)
def test_generation_parameters_of_the_wrong_type_or_range_are_refused(
    payload: dict[str, Any], route: Any, param: str
) -> None:
    with pytest.raises(OpenAIError) as caught:
        check_parameters(payload, route)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert param.split(".")[0] in caught.value.message


@pytest.mark.parametrize(
    ("payload", "route"),
    [
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": 0,
                "top_p": 1,
                "top_k": -1,
                "min_p": 0.1,
                "n": 2,
                "seed": -(2**63),
                "stop": ["\n"],
                "presence_penalty": -2,
                "frequency_penalty": 2,
                "repetition_penalty": 1.1,
                "logit_bias": {"42": -100},
                "logprobs": True,
                "top_logprobs": 5,
                "user": "me",
            },
            "chat",
        ),
        ({"prompt": [1, 2, 3], "logprobs": 3, "echo": True}, "completions"),
        ({"prompt": [[1, 2], [3]]}, "completions"),
        ({"prompt": "x", "temperature": None, "n": None, "stop": None}, "completions"),
        ({"chat_template_kwargs": {"anything": "goes"}, "priority": 3}, "chat"),
    ],
    ids=["every-chat-parameter", "token-prompt", "token-batches", "nulls", "unknown-extensions"],
)
def test_valid_generation_parameters_pass(payload: dict[str, Any], route: Any) -> None:
    check_parameters(payload, route)
