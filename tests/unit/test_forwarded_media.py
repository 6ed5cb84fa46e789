"""The chat route's media policy on every other JSON route the gateway forwards.

A gateway in ``--upstream-url`` mode in front of the stand-in engine (shaped like vLLM, it
records every request it gets): a link-local image URL anywhere in an embeddings, pooling,
classify, tokenize, score or rerank body, or in a Responses ``function_call_output``, is
refused before the engine sees a byte, and images the gateway may take arrive as data URIs.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import serving
from tests.unit.test_engine_passthrough import Seen, engine_paths, png_data_uri, stand_in_engine

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_shaped(url: str) -> dict[str, Any]:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, image_part(url)]}],
    }


def documents_shaped(url: str) -> dict[str, Any]:
    return {"model": "demo", "query": "q", "documents": [{"content": [image_part(url)]}]}


def score_shaped(url: str) -> dict[str, Any]:
    return {"model": "demo", "data_1": "q", "data_2": {"content": [image_part(url)]}}


ROUTES = [
    ("/v1/embeddings", chat_shaped),
    ("/v2/embed", chat_shaped),
    ("/pooling", chat_shaped),
    ("/classify", chat_shaped),
    ("/tokenize", chat_shaped),
    ("/v1/score", score_shaped),
    ("/score", score_shaped),
    ("/v1/rerank", documents_shaped),
    ("/rerank", documents_shaped),
    ("/v2/rerank", documents_shaped),
]


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
            allowed_media_dir=tmp_path,
            max_images_per_request=2,
        )
        with serving(create_app(settings)) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield client


@pytest.mark.parametrize(("path", "shape"), ROUTES)
def test_a_link_local_image_url_never_reaches_the_engine(
    gateway: httpx.Client, seen: list[Seen], path: str, shape: Any
) -> None:
    answer = gateway.post(path, json=shape(METADATA))
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["code"] == "image_url_forbidden"
    assert "169.254.169.254" in error["message"]
    assert engine_paths(seen) == []


def test_an_image_in_a_function_call_output_gets_the_same_policy(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    body = {
        "model": "demo",
        "input": [
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "input_image", "image_url": METADATA}],
            }
        ],
    }
    answer = gateway.post("/v1/responses", json=body)
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["param"] == "input[0].output[0].image_url"
    assert engine_paths(seen) == []


def test_images_the_gateway_may_take_arrive_as_checked_data_uris(
    gateway: httpx.Client, seen: list[Seen], tmp_path: Path
) -> None:
    (tmp_path / "green.png").write_bytes(base64.b64decode(png_data_uri().split(",", 1)[1]))
    answer = gateway.post("/tokenize", json=chat_shaped(str(tmp_path / "green.png")))
    assert answer.status_code == 200, answer.text
    sent = orjson.loads(seen[-1].body)["messages"][0]["content"]
    assert sent[0] == {"type": "text", "text": "?"}
    assert sent[1]["image_url"]["url"] == png_data_uri()
    inline = gateway.post("/tokenize", json=chat_shaped(png_data_uri()))
    assert inline.status_code == 200, inline.text


def test_other_media_must_be_inline_and_files_are_refused(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    video = {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}}
    body = {"model": "demo", "messages": [{"role": "user", "content": [video]}]}
    answer = gateway.post("/v1/embeddings", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "unsupported_content_part"
    stray = {"type": "text", "text": "x", "audio_url": "http://10.0.0.1/a.wav"}
    body = {"model": "demo", "messages": [{"role": "user", "content": [stray]}]}
    assert gateway.post("/pooling", json=body).status_code == 400
    by_id = {"type": "input_image", "file_id": "file-1"}
    body = {"model": "demo", "messages": [{"role": "user", "content": [by_id]}]}
    assert gateway.post("/v1/embeddings", json=body).status_code == 400
    assert engine_paths(seen) == []


def test_the_image_count_is_capped_before_anything_is_fetched(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    body = documents_shaped(METADATA)
    body["documents"] *= 3  # three images over a cap of two: refused before the first fetch
    answer = gateway.post("/v1/rerank", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "too_many_images"
    assert engine_paths(seen) == []


def test_a_deeply_nested_body_is_a_clean_400(gateway: httpx.Client, seen: list[Seen]) -> None:
    nested: Any = "x"
    for _ in range(200):
        nested = [nested]
    answer = gateway.post("/v1/embeddings", json={"model": "demo", "input": nested})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "body_too_deep"
    assert engine_paths(seen) == []


def test_a_json_schema_naming_an_image_url_property_is_not_a_media_part(
    gateway: httpx.Client, seen: list[Seen]
) -> None:
    schema = {"type": "object", "properties": {"image_url": {"type": "string"}}}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "schema": schema}
    assert gateway.post("/tokenize", json=body).status_code == 200
    assert orjson.loads(seen[-1].body)["schema"] == schema
