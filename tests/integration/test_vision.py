"""Images end to end: the vision demo (tiny Idefics3 + a " meow meow" LoRA) on the real engine.

One gateway serves every test here, started the way the README says:
`gateway serve --model <vision base> --model-name loragate-vision --lora meow=<adapter>
--allowed-media-dir DIR -- --limit-mm-per-prompt {"image":1} --dtype float32`.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from loragate.demo.layout import (
    VISION_ADAPTERS,
    VISION_DEMO_IMAGES,
    VISION_DEMO_MODEL_NAME,
    VISION_ENGINE_ARGS,
    demo_adapter_dir,
    demo_base_dir,
    ensure_vision_demo,
    vision_images_dir,
)
from tests.gateway_process import GatewayProcess
from tests.readme_blocks import blocks_of, run_block

pytestmark = pytest.mark.engine

BASE = VISION_DEMO_MODEL_NAME
ADAPTER = VISION_ADAPTERS[0].name
PHRASE = VISION_ADAPTERS[0].phrase.strip()
IMAGES = sorted(VISION_DEMO_IMAGES)


@pytest.fixture(scope="module")
def vision_demo() -> Path:
    return ensure_vision_demo()


@pytest.fixture(scope="module")
def vision_media(vision_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vision-media")
    for name in IMAGES:
        shutil.copy(vision_images_dir(vision_demo) / name, folder / name)
    (folder / "corrupt.png").write_bytes((folder / IMAGES[0]).read_bytes()[:60])
    (folder / "passwd.png").symlink_to("/etc/passwd")
    return folder


@pytest.fixture(scope="module")
def vision_gateway(
    vision_demo: Path, vision_media: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("vision-gateway"),
        args=[
            "--model", str(demo_base_dir(vision_demo)),
            "--model-name", BASE,
            "--lora", f"{ADAPTER}={demo_adapter_dir(vision_demo, ADAPTER)}",
            "--allowed-media-dir", str(vision_media),
            # The image-URL test serves its images from 127.0.0.1 (nothing here is online).
            "--private-image-urls",
            "--", *VISION_ENGINE_ARGS,
        ],
    )  # fmt: skip
    started = time.monotonic()
    process.start()
    try:
        process.wait_ready(timeout=600)
        print(
            f"\nvision gateway ready {time.monotonic() - started:.1f} s after spawn",
            file=sys.stderr,
        )
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def vclient(vision_gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{vision_gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


def image_data_uri(folder: Path, name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((folder / name).read_bytes()).decode()


def post(gateway: GatewayProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)


def vi(
    gateway: GatewayProcess,
    model: str,
    source: str,
    prompt: str = "What is in this image?",
    **extra: Any,
) -> str:
    response = post(
        gateway,
        {
            "model": model,
            "source": source,
            "user_prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            **extra,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model
    assert body["usage"]["completion_tokens"] > 0
    return str(body["choices"][0]["message"]["content"])


def streamed_text(
    gateway: GatewayProcess, body: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return text, events


# ----- the image reaches the model ----------------------------------------------------------


def test_models_list_the_vision_base_and_its_adapter(vclient: OpenAI) -> None:
    assert [m.id for m in vclient.models.list().data] == [BASE, ADAPTER]


def test_different_images_give_different_base_answers(
    vision_gateway: GatewayProcess, vision_media: Path
) -> None:
    answers = {
        name: vi(vision_gateway, BASE, image_data_uri(vision_media, name)) for name in IMAGES
    }
    assert len(set(answers.values())) == len(IMAGES), answers
    for answer in answers.values():
        assert PHRASE not in answer
    # And the answer follows the image, not chance: the same image gives the same answer again.
    assert vi(vision_gateway, BASE, image_data_uri(vision_media, IMAGES[0])) == answers[IMAGES[0]]


def test_vi_local_file_inside_the_allowed_dir_is_the_same_image_as_its_data_uri(
    vision_gateway: GatewayProcess, vision_media: Path
) -> None:
    name = IMAGES[1]
    by_path = vi(vision_gateway, BASE, str(vision_media / name))
    by_relative_path = vi(vision_gateway, BASE, name)
    assert (
        by_path == by_relative_path == vi(vision_gateway, BASE, image_data_uri(vision_media, name))
    )


@pytest.mark.parametrize("form", ["local path", "data URI"])
def test_adapter_answers_its_phrase_for_vi_image_requests(
    vision_gateway: GatewayProcess, vision_media: Path, form: str
) -> None:
    for name in IMAGES:
        source = (
            str(vision_media / name) if form == "local path" else image_data_uri(vision_media, name)
        )
        assert vi(vision_gateway, ADAPTER, source) == f" {PHRASE}"


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_vi_streaming_with_an_image_matches_the_unstreamed_answer(
    vision_gateway: GatewayProcess, vision_media: Path, model: str
) -> None:
    body = {
        "model": model,
        "source": IMAGES[2],
        "user_prompt": "Describe it",
        "max_tokens": 8,
        "temperature": 0,
    }
    expected = vi(vision_gateway, model, IMAGES[2], "Describe it")
    text, events = streamed_text(
        vision_gateway, {**body, "stream_options": {"include_usage": True}}
    )
    assert text == expected
    assert all(event["model"] == model for event in events)
    assert events[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_openai_client_image_part_is_served(
    vclient: OpenAI, vision_gateway: GatewayProcess, vision_media: Path, model: str
) -> None:
    name = IMAGES[0]
    reply = vclient.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_data_uri(vision_media, name)}},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    assert reply.model == model
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert (reply.choices[0].message.content or "") == vi(vision_gateway, model, name)


def test_openai_client_streams_an_image_request(vclient: OpenAI, vision_media: Path) -> None:
    stream = vclient.chat.completions.create(
        model=ADAPTER,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(vision_media / IMAGES[1])}},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == f" {PHRASE}"


@pytest.fixture(scope="module")
def image_server(vision_media: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(vision_media))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_image_url_is_fetched_by_the_gateway(
    vision_gateway: GatewayProcess, vision_media: Path, image_server: str
) -> None:
    name = IMAGES[2]
    assert vi(vision_gateway, BASE, f"{image_server}/{name}") == vi(
        vision_gateway, BASE, image_data_uri(vision_media, name)
    )


def test_adapter_answers_its_phrase_to_text_parts_without_an_image(
    vision_gateway: GatewayProcess,
) -> None:
    response = post(
        vision_gateway,
        {
            "model": ADAPTER,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == f" {PHRASE}"


# ----- what is refused ----------------------------------------------------------------------


def test_plain_text_without_an_image_says_how_to_send_one(
    vclient: OpenAI, vision_gateway: GatewayProcess
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        vclient.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": "What is in this image?"}],
            max_tokens=4,
        )
    error = caught.value.response.json()["error"]
    assert error["code"] == "image_required"
    assert "image_url" in error["message"] and "source" in error["message"]
    vi_response = post(vision_gateway, {"model": BASE, "user_prompt": "What is in this image?"})
    assert vi_response.status_code == 400
    assert vi_response.json()["error"]["param"] == "source"


def test_corrupt_image_is_refused_naming_the_problem(vision_gateway: GatewayProcess) -> None:
    response = post(vision_gateway, {"model": BASE, "source": "corrupt.png", "user_prompt": "?"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_image" and "corrupt" in error["message"]
    assert error["param"] == "source"


@pytest.mark.parametrize("source", ["/etc/passwd", "passwd.png", "../../../../etc/passwd"])
def test_paths_leading_out_of_the_allowed_dir_are_refused_unread(
    vision_gateway: GatewayProcess, source: str
) -> None:
    response = post(vision_gateway, {"model": BASE, "source": source, "user_prompt": "?"})
    assert response.status_code == 403
    body = response.json()
    assert body["error"]["code"] == "media_path_forbidden"
    assert "root:" not in response.text


def test_unknown_model_is_404_naming_the_valid_ids(vision_gateway: GatewayProcess) -> None:
    response = post(
        vision_gateway, {"model": "no-such-model", "source": IMAGES[0], "user_prompt": "?"}
    )
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "no-such-model" in message and BASE in message and ADAPTER in message


def test_vi_sdk_streaming_client_talks_to_the_gateway(
    vision_gateway: GatewayProcess, vision_media: Path
) -> None:
    """The Datature Vi SDK's own local-server client, used as its documentation shows."""
    from vi.deployment.local import stream as stream_module

    client = stream_module.ViStreamingClient(base_url=f"{vision_gateway.url}/v1")
    reply = client.create(
        model=ADAPTER,
        source=IMAGES[0],
        user_prompt="What is in this image?",
        temperature=0,
        max_tokens=8,
        stream=False,
    )
    assert PHRASE in (reply.choices[0].message.content or "")
    assert reply.model == ADAPTER
    chunks = client.create(
        model=ADAPTER,
        source=image_data_uri(vision_media, IMAGES[1]),
        user_prompt="What is in this image?",
        temperature=0,
        max_tokens=8,
        show_progress=False,
    )
    assert PHRASE in "".join(chunks)
    openai_shape = client.create(
        model=BASE,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": IMAGES[2]}},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
        temperature=0,
        max_tokens=8,
        stream=False,
    )
    assert openai_shape.choices[0].message.content


@pytest.mark.parametrize("block", blocks_of("vision"), ids=lambda block: block.id)
def test_readme_vision_examples_run(block, vision_gateway: GatewayProcess) -> None:  # type: ignore[no-untyped-def]
    assert run_block(block, vision_gateway.url).strip()
