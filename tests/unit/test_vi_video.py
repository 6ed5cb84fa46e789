"""Video ``source`` files in the Vi shape (issue 27): Vi's ``video-freeform`` task names a video
where an image would go (the Vi SDK's ``VIDEO_SUPPORTED_MODELS``: Cosmos Reason2). The gateway
reads it as it reads an image (inside --allowed-media-dir, the same size caps), checks its bytes
are a video container, and sends the engine a ``video_url`` part with a data URI; a model whose
``config.json`` names no video input gets a 400 saying so.

Real parts: real MP4, MOV and WebM files written with PyAV (the ``vi`` extra), real model
directories with their ``config.json``.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.chat import normalize_chat_request
from loragate.gateway.requests.images.video import names_a_video, sniff_video
from loragate.gateway.requests.images.vision_model import config_takes_video
from loragate.settings import Settings

# Qwen3-VL's config (Cosmos Reason2's base) names its video token; SmolVLM's has images only.
VIDEO_MODEL = {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655,
               "video_token_id": 151656, "vision_config": {"depth": 2}}  # fmt: skip
IMAGE_MODEL = {"architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190,
               "vision_config": {"patch_size": 16}}  # fmt: skip
CONTAINERS = {"mp4": ("mp4", "mpeg4"), "mov": ("mov", "mpeg4"), "webm": ("webm", "libvpx")}
MIMES = {"mp4": "video/mp4", "mov": "video/quicktime", "webm": "video/webm"}


def video_bytes(extension: str, frames: int = 4) -> bytes:
    """A real, tiny video in ``extension``'s container (32x32, a few grey frames)."""
    av = pytest.importorskip("av")
    import numpy as np

    container_format, codec = CONTAINERS[extension]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(frames):
            pixels = np.full((32, 32, 3), index * 40, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    return folder


def settings_for(
    tmp_path: Path, media_dir: Path, config: dict[str, Any], **values: Any
) -> Settings:
    return Settings(
        model=str(model_dir(tmp_path, config)),
        allowed_media_dir=media_dir,
        cache_dir=tmp_path / "cache",
        **values,
    )


async def refused(payload: dict[str, Any], settings: Settings, status: int = 400) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        await normalize_chat_request(payload, settings)
    assert caught.value.status == status, caught.value.message
    return caught.value


@pytest.mark.parametrize("extension", ["mp4", "mov", "webm"])
async def test_a_video_file_source_reaches_the_engine_as_a_video_url_data_uri(
    tmp_path: Path, media_dir: Path, extension: str
) -> None:
    data = video_bytes(extension)
    (media_dir / f"clip.{extension}").write_bytes(data)
    settings = settings_for(tmp_path, media_dir, VIDEO_MODEL)
    request = await normalize_chat_request(
        {"source": f"clip.{extension}", "user_prompt": "What happens?"}, settings
    )
    uri = f"data:{MIMES[extension]};base64,{base64.b64encode(data).decode()}"
    assert request["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": uri}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    assert request.vi is not None and request.vi.source == uri  # a Vi backend gets it too


async def test_a_video_as_a_data_uri_or_raw_base64_is_a_video_part_too(
    tmp_path: Path, media_dir: Path
) -> None:
    data = video_bytes("mp4")
    encoded = base64.b64encode(data).decode()
    settings = settings_for(tmp_path, media_dir, VIDEO_MODEL)
    for source in (f"data:video/mp4;base64,{encoded}", encoded):
        request = await normalize_chat_request({"source": source, "user_prompt": "?"}, settings)
        part = request["messages"][0]["content"][0]
        assert part == {
            "type": "video_url",
            "video_url": {"url": f"data:video/mp4;base64,{encoded}"},
        }


async def test_a_video_to_a_model_that_takes_no_video_is_a_400_saying_so(
    tmp_path: Path, media_dir: Path
) -> None:
    (media_dir / "clip.mp4").write_bytes(video_bytes("mp4"))
    error = await refused(
        {"source": "clip.mp4", "user_prompt": "?"}, settings_for(tmp_path, media_dir, IMAGE_MODEL)
    )
    assert error.param == "source" and error.code == "video_unsupported"
    assert "takes no video" in error.message and "Cosmos Reason2" in error.message


async def test_a_vision_model_asked_with_a_video_needs_no_image(
    tmp_path: Path, media_dir: Path
) -> None:
    (media_dir / "clip.webm").write_bytes(video_bytes("webm"))
    settings = settings_for(tmp_path, media_dir, VIDEO_MODEL, vision_model=True)
    request = await normalize_chat_request({"source": "clip.webm", "user_prompt": "?"}, settings)
    assert request["messages"][0]["content"][0]["type"] == "video_url"


async def test_a_file_named_as_a_video_that_is_none_is_a_400(
    tmp_path: Path, media_dir: Path
) -> None:
    (media_dir / "clip.mp4").write_bytes(b"not a video at all, only text")
    error = await refused(
        {"source": "clip.mp4", "user_prompt": "?"}, settings_for(tmp_path, media_dir, VIDEO_MODEL)
    )
    assert error.param == "source" and error.code == "invalid_video"
    assert "MP4, MOV, WebM" in error.message


async def test_a_video_obeys_the_image_caps_and_the_allowed_media_dir(
    tmp_path: Path, media_dir: Path
) -> None:
    data = video_bytes("mp4")
    (media_dir / "clip.mp4").write_bytes(data)
    capped = settings_for(tmp_path, media_dir, VIDEO_MODEL, max_image_bytes=len(data) - 1)
    too_large = await refused({"source": "clip.mp4", "user_prompt": "?"}, capped)
    assert too_large.param == "source" and too_large.code == "image_too_large"

    outside = tmp_path / "outside.mp4"
    outside.write_bytes(data)
    settings = settings_for(tmp_path, media_dir, VIDEO_MODEL)
    forbidden = await refused({"source": str(outside), "user_prompt": "?"}, settings, 403)
    assert forbidden.code == "media_path_forbidden"
    no_dir = Settings(model=settings.model, cache_dir=tmp_path / "cache")
    disabled = await refused({"source": str(outside), "user_prompt": "?"}, no_dir)
    assert disabled.code == "local_media_disabled"


async def test_a_model_with_no_config_to_read_leaves_the_video_to_the_engine(
    tmp_path: Path, media_dir: Path
) -> None:
    (media_dir / "clip.mov").write_bytes(video_bytes("mov"))
    settings = Settings(allowed_media_dir=media_dir, cache_dir=tmp_path / "cache")  # no model
    request = await normalize_chat_request({"source": "clip.mov", "user_prompt": "?"}, settings)
    assert request["messages"][0]["content"][0]["video_url"]["url"].startswith(
        "data:video/quicktime;base64,"
    )


def test_a_video_source_is_told_apart_by_its_name_and_checked_by_its_bytes() -> None:
    for source in ("clip.mp4", "/media/a.MOV", "https://host/v.webm?x=1", "data:video/mp4;base64,"):
        assert names_a_video(source), source
    for source in ("cat.png", "https://host/mp4", "data:image/png;base64,", "clip.mp4.png"):
        assert not names_a_video(source), source
    assert sniff_video(video_bytes("mp4")) == "video/mp4"
    assert sniff_video(video_bytes("mov")) == "video/quicktime"
    assert sniff_video(video_bytes("webm")) == "video/webm"
    assert sniff_video(b"RIFF\x00\x00\x00\x00AVI LIST") == "video/x-msvideo"
    assert sniff_video(b"\x89PNG\r\n\x1a\n") is None


def test_video_input_is_read_from_the_models_config() -> None:
    assert config_takes_video(VIDEO_MODEL)
    assert config_takes_video({"text_config": {"video_token_index": 3}})  # LLaVA OneVision
    assert not config_takes_video(IMAGE_MODEL)
    assert not config_takes_video({"architectures": ["LlamaForCausalLM"]})


async def test_an_openai_video_part_to_a_model_that_takes_no_video_is_a_400_naming_it(
    tmp_path: Path, media_dir: Path
) -> None:
    encoded = base64.b64encode(video_bytes("mp4")).decode()
    video = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{encoded}"}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [{"type": "text", "text": "What happens?"}, video]},
    ]
    error = await refused({"messages": messages}, settings_for(tmp_path, media_dir, IMAGE_MODEL))
    assert error.param == "messages[1].content[1]" and error.code == "video_unsupported"
    assert "takes no video" in error.message
    # A video model gets the part as it was sent (inline data: the engine decodes it).
    other = tmp_path / "video-model"  # another directory: verdicts are kept per model
    other.mkdir()
    request = await normalize_chat_request(
        {"messages": messages}, settings_for(other, media_dir, VIDEO_MODEL)
    )
    assert request["messages"][1]["content"][1] == video
