"""Chat requests before any backend sees them: the Vi shape, images, structured outputs."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from PIL import Image

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.chat import ChatRequest, normalize_chat_request
from loragate.gateway.requests.images import files as media_files
from loragate.gateway.requests.images import resolve as media
from loragate.gateway.requests.images.vision_model import config_takes_images, model_takes_images
from loragate.settings import Settings


def png_bytes(color: tuple[int, int, int] = (200, 10, 10), size: tuple[int, int] = (8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "cat.png").write_bytes(png_bytes())
    return folder


@pytest.fixture
def settings(media_dir: Path, tmp_path: Path) -> Settings:
    return Settings(allowed_media_dir=media_dir, cache_dir=tmp_path / "cache")


async def normalize(payload: dict[str, Any], settings: Settings) -> ChatRequest:
    return await normalize_chat_request(payload, settings)


async def refused(payload: dict[str, Any], settings: Settings, status: int = 400) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        await normalize_chat_request(payload, settings)
    assert caught.value.status == status, caught.value.message
    return caught.value


# ----- the Vi shape -------------------------------------------------------------------------


async def test_vi_request_becomes_one_user_message_image_first_then_text(
    settings: Settings,
) -> None:
    body = await normalize(
        {"model": "m", "source": "cat.png", "user_prompt": "What is it?"}, settings
    )
    assert list(body) == ["model", "messages"]
    [message] = body["messages"]
    assert message["role"] == "user"
    image, text = message["content"]
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith(
        "data:image/png;base64,"
    )
    assert text == {"type": "text", "text": "What is it?"}


async def test_vi_system_prompt_becomes_a_system_message_first(settings: Settings) -> None:
    body = await normalize({"user_prompt": "hi", "system_prompt": "Be brief."}, settings)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][1]["content"] == [{"type": "text", "text": "hi"}]


async def test_vi_request_is_remembered_with_its_checked_image(settings: Settings) -> None:
    body = await normalize(
        {
            "source": "cat.png",
            "user_prompt": "What?",
            "system_prompt": "S",
            "generation_config": {"max_new_tokens": 3},
        },
        settings,
    )
    assert body.vi is not None
    assert body.vi.source == body["messages"][1]["content"][0]["image_url"]["url"]
    assert body.vi.source is not None
    assert body.vi.source.startswith("data:image/png;base64,")
    assert (body.vi.user_prompt, body.vi.system_prompt) == ("What?", "S")
    assert body.vi.generation_config == {"max_new_tokens": 3}


async def test_openai_request_has_no_vi_record(settings: Settings) -> None:
    body = await normalize({"messages": [{"role": "user", "content": "hi"}]}, settings)
    assert body.vi is None


async def test_the_body_sent_on_is_the_plain_openai_body(settings: Settings) -> None:
    body = await normalize(
        {"model": "m", "source": "cat.png", "user_prompt": "q", "stream": True}, settings
    )
    sent = orjson.loads(orjson.dumps(body))
    assert set(sent) == {"model", "messages", "stream"}


async def test_generation_config_maps_hugging_face_names(settings: Settings) -> None:
    config = {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "repetition_penalty": 1.1,
        "seed": 3,
        "stop_strings": ["\n"],
        "num_return_sequences": 2,
    }
    body = await normalize({"user_prompt": "hi", "generation_config": config}, settings)
    expected = {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "repetition_penalty": 1.1,
    }
    assert {k: body[k] for k in expected} == expected
    assert (body["seed"], body["stop"], body["n"]) == (3, ["\n"], 2)
    assert "generation_config" not in body


async def test_top_level_parameters_take_precedence_over_generation_config(
    settings: Settings,
) -> None:
    body = await normalize(
        {
            "user_prompt": "hi",
            "max_tokens": 2,
            "generation_config": {"max_new_tokens": 9, "top_k": 5},
        },
        settings,
    )
    assert (body["max_tokens"], body["top_k"]) == (2, 5)


async def test_null_top_level_parameter_does_not_hide_generation_config(settings: Settings) -> None:
    body = await normalize(
        {"user_prompt": "hi", "max_tokens": None, "generation_config": {"max_new_tokens": 9}},
        settings,
    )
    assert body["max_tokens"] == 9


async def test_do_sample_false_means_greedy(settings: Settings) -> None:
    body = await normalize(
        {"user_prompt": "hi", "generation_config": {"do_sample": False, "temperature": 0.8}},
        settings,
    )
    assert body["temperature"] == 0.0


async def test_generation_config_also_applies_to_openai_messages(settings: Settings) -> None:
    body = await normalize(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "generation_config": {"max_new_tokens": 4},
        },
        settings,
    )
    assert body["max_tokens"] == 4


async def test_unknown_generation_config_key_is_refused_naming_the_supported_ones(
    settings: Settings,
) -> None:
    error = await refused({"user_prompt": "hi", "generation_config": {"num_beams": 4}}, settings)
    assert "num_beams" in error.message and "max_new_tokens" in error.message
    assert error.param == "generation_config.num_beams"


async def test_both_shapes_are_refused(settings: Settings) -> None:
    error = await refused(
        {"messages": [{"role": "user", "content": "hi"}], "user_prompt": "hi"}, settings
    )
    assert error.code == "ambiguous_request_format"
    await refused({"messages": [{"role": "user", "content": "hi"}], "source": "cat.png"}, settings)
    await refused({"messages": [{"role": "user", "content": "hi"}], "system_prompt": "S"}, settings)


async def test_neither_shape_is_refused(settings: Settings) -> None:
    error = await refused({"model": "m", "max_tokens": 3}, settings)
    assert error.code == "missing_messages"
    assert "messages" in error.message and "user_prompt" in error.message
    await refused({"system_prompt": "only this"}, settings)


async def test_null_fields_count_as_absent(settings: Settings) -> None:
    body = await normalize(
        {"messages": [{"role": "user", "content": "hi"}], "source": None, "user_prompt": None},
        settings,
    )
    assert "source" not in body and body.vi is None


async def test_empty_messages_beside_vi_fields_count_as_absent(settings: Settings) -> None:
    # The OpenAI SDK needs `messages`; Vi fields then travel in extra_body with messages=[].
    body = await normalize({"messages": [], "user_prompt": "hi"}, settings)
    assert body.vi is not None and body["messages"][0]["content"] == [
        {"type": "text", "text": "hi"}
    ]


async def test_wrong_vi_types_are_refused(settings: Settings) -> None:
    assert (await refused({"user_prompt": 3}, settings)).param == "user_prompt"
    assert (await refused({"source": ["a"], "user_prompt": "x"}, settings)).param == "source"
    assert (
        await refused({"user_prompt": "x", "generation_config": [1]}, settings)
    ).param == "generation_config"


# ----- images -------------------------------------------------------------------------------


def image_request(url: str) -> dict[str, Any]:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "?"},
                ],
            }
        ]
    }


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the media checks open."""
    paths: list[str] = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any) -> int:
        paths.append(str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(media_files.os, "open", spy)
    return paths


async def test_local_file_inside_the_allowed_dir_is_sent_as_a_data_uri(
    settings: Settings, media_dir: Path
) -> None:
    body = await normalize(image_request(str(media_dir / "cat.png")), settings)
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url == data_uri(png_bytes())


async def test_relative_and_file_url_paths_resolve_inside_the_allowed_dir(
    settings: Settings, media_dir: Path
) -> None:
    for url in ("cat.png", f"file://{media_dir}/cat.png"):
        body = await normalize(image_request(url), settings)
        assert body["messages"][0]["content"][0]["image_url"]["url"] == data_uri(png_bytes())


async def test_path_outside_the_allowed_dir_is_refused_without_reading_it(
    settings: Settings, opened: list[str]
) -> None:
    error = await refused(image_request("/etc/passwd"), settings, status=403)
    assert error.code == "media_path_forbidden" and "not read" in error.message
    assert opened == []


async def test_dotdot_escape_is_refused(
    settings: Settings, media_dir: Path, opened: list[str]
) -> None:
    (media_dir.parent / "secret.png").write_bytes(png_bytes())
    for url in ("../secret.png", f"{media_dir}/../secret.png"):
        assert (
            await refused(image_request(url), settings, status=403)
        ).code == "media_path_forbidden"
    assert opened == []


async def test_symlink_pointing_out_of_the_allowed_dir_is_refused(
    settings: Settings, media_dir: Path, opened: list[str]
) -> None:
    (media_dir / "passwd.png").symlink_to("/etc/passwd")
    error = await refused(image_request(str(media_dir / "passwd.png")), settings, status=403)
    assert error.code == "media_path_forbidden"
    assert opened == []


async def test_symlink_within_the_allowed_dir_is_followed(
    settings: Settings, media_dir: Path
) -> None:
    (media_dir / "alias.png").symlink_to(media_dir / "cat.png")
    body = await normalize(image_request("alias.png"), settings)
    assert body["messages"][0]["content"][0]["image_url"]["url"] == data_uri(png_bytes())


async def test_missing_files_outside_look_the_same_as_existing_ones(settings: Settings) -> None:
    # No oracle for which files exist elsewhere on the host.
    assert (
        await refused(image_request("/etc/no-such-file"), settings, status=403)
    ).code == "media_path_forbidden"


async def test_missing_file_inside_is_named(settings: Settings) -> None:
    error = await refused(image_request("nope.png"), settings)
    assert error.code == "image_not_found" and "nope.png" in error.message


async def test_odd_paths_are_a_400_not_a_crash(settings: Settings) -> None:
    assert "NUL" in (await refused(image_request("cat\x00.png"), settings)).message
    error = await refused(image_request("~no-such-user-here/cat.png"), settings)
    assert "home directory" in error.message


async def test_local_paths_are_refused_when_no_dir_is_allowed(tmp_path: Path) -> None:
    error = await refused(image_request(str(tmp_path / "x.png")), Settings(cache_dir=tmp_path))
    assert error.code == "local_media_disabled" and "--allowed-media-dir" in error.message


async def test_directory_and_fifo_are_not_images(settings: Settings, media_dir: Path) -> None:
    (media_dir / "sub").mkdir()
    os.mkfifo(media_dir / "pipe")
    assert "regular file" in (await refused(image_request("sub"), settings)).message
    assert "regular file" in (await refused(image_request("pipe"), settings)).message


async def test_corrupt_image_is_refused_naming_the_problem(
    settings: Settings, media_dir: Path
) -> None:
    (media_dir / "broken.png").write_bytes(png_bytes()[:40])
    error = await refused(image_request("broken.png"), settings)
    assert error.code == "invalid_image" and "PNG" in error.message and "corrupt" in error.message


async def test_a_file_that_is_no_image_is_refused(settings: Settings, media_dir: Path) -> None:
    (media_dir / "notes.png").write_text("just text")
    assert "not a PNG, JPEG" in (await refused(image_request("notes.png"), settings)).message


async def test_images_over_the_byte_and_pixel_caps_are_refused(
    media_dir: Path, tmp_path: Path
) -> None:
    small = Settings(allowed_media_dir=media_dir, cache_dir=tmp_path, max_image_bytes=20)
    assert (await refused(image_request("cat.png"), small)).code == "image_too_large"
    assert (await refused(image_request(data_uri(png_bytes())), small)).code == "image_too_large"
    few_pixels = Settings(allowed_media_dir=media_dir, cache_dir=tmp_path, max_image_pixels=10)
    error = await refused(image_request("cat.png"), few_pixels)
    assert error.code == "image_too_large" and "8x6" in error.message


async def test_data_uri_is_checked_and_labelled_with_its_real_format(settings: Settings) -> None:
    wrapped = data_uri(png_bytes(), mime="application/octet-stream")
    wrapped = wrapped[:60] + "\n" + wrapped[60:]  # line-wrapped base64 is common
    body = await normalize(image_request(wrapped), settings)
    assert body["messages"][0]["content"][0]["image_url"]["url"] == data_uri(png_bytes())


async def test_bad_data_uris_are_refused(settings: Settings) -> None:
    assert "base64" in (await refused(image_request("data:image/png;base64,@@@"), settings)).message
    assert (
        "data:image/png;base64"
        in (await refused(image_request("data:image/png,raw"), settings)).message
    )
    truncated = data_uri(png_bytes()[:30])
    assert "corrupt" in (await refused(image_request(truncated), settings)).message


async def test_other_url_schemes_are_refused(settings: Settings) -> None:
    assert "scheme" in (await refused(image_request("ftp://example.com/cat.png"), settings)).message


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/v1/models",
        "http://localhost/cat.png",
        "http://api.localhost./cat.png",
        "http://10.1.2.3/cat.png",
        "http://192.168.0.7/cat.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:9000/cat.png",
        "http://[::ffff:127.0.0.1]/cat.png",
        "http://0.0.0.0/cat.png",
    ],
)
async def test_image_urls_naming_this_machine_or_a_private_network_are_refused(
    settings: Settings, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = await refused(image_request(url), settings, status=403)
    assert error.code == "image_url_forbidden", error.message
    assert "--private-image-urls" in error.message
    # Allowed, the gateway fetches it itself (here from a stand-in for the network).
    fetched: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        fetched.append(str(request.url))
        return httpx.Response(200, stream=httpx.ByteStream(png_bytes()))

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    monkeypatch.setattr(
        media,
        "_media_policy",
        lambda *args: media.MediaPolicy(
            *args, resolver=resolver, transport=httpx.MockTransport(answer)
        ),
    )
    allowed = settings.model_copy(update={"private_image_urls": True})
    body = await normalize(image_request(url), allowed)
    assert body["messages"][0]["content"][0]["image_url"]["url"] == data_uri(png_bytes())
    assert len(fetched) == 1


def test_the_engine_fetches_no_url_and_has_the_gateway_limits() -> None:
    from loragate.supervisor.command import EngineSpec, engine_env

    for cap, megabytes in ((20 * 1024 * 1024, "20"), (1000, "1")):
        env = engine_env(EngineSpec("m", "m", max_loras=1, max_lora_rank=8, max_media_bytes=cap))
        assert env["VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB"] == megabytes
        assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


async def test_vi_sdk_image_parts_become_image_url_parts(settings: Settings) -> None:
    payload = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "?"}],
            }
        ]
    }
    body = await normalize(payload, settings)
    assert body["messages"][0]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": data_uri(png_bytes())},
    }


async def test_image_error_names_the_part(settings: Settings) -> None:
    error = await refused(image_request("nope.png"), settings)
    assert error.param == "messages[0].content[0].image_url.url"
    vi_error = await refused({"source": "nope.png", "user_prompt": "?"}, settings)
    assert vi_error.param == "source"


# ----- vision models ------------------------------------------------------------------------


@pytest.fixture
def vision(settings: Settings) -> Settings:
    return settings.model_copy(update={"vision_model": True})


async def test_plain_text_to_a_vision_model_says_how_to_send_the_image(vision: Settings) -> None:
    error = await refused(
        {"messages": [{"role": "user", "content": "What is in the image?"}]}, vision
    )
    assert error.code == "image_required"
    assert '"type": "image_url"' in error.message and '"source"' in error.message
    vi_error = await refused({"user_prompt": "What is in the image?"}, vision)
    assert vi_error.param == "source"


async def test_vision_model_takes_text_parts_without_an_image_on_purpose(vision: Settings) -> None:
    body = await normalize(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, vision
    )
    assert body["messages"][0]["content"] == [{"type": "text", "text": "hi"}]


async def test_vision_model_takes_a_plain_follow_up_after_an_image(vision: Settings) -> None:
    payload = image_request("cat.png")
    payload["messages"] += [
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": "colour?"},
    ]
    await normalize(payload, vision)


def test_vision_model_is_detected_from_config_json(tmp_path: Path) -> None:
    vlm = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "vision_config": {"hidden_size": 64},
    }
    assert config_takes_images(vlm)
    assert config_takes_images({"architectures": ["Qwen2VLForConditionalGeneration"]})
    assert not config_takes_images({"architectures": ["LlamaForCausalLM"], "hidden_size": 128})
    model_dir = tmp_path / "vlm"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(orjson.dumps(vlm).decode())
    assert model_takes_images(Settings(model=str(model_dir), cache_dir=tmp_path))
    assert not model_takes_images(
        Settings(model=str(model_dir), cache_dir=tmp_path, vision_model=False)
    )
    assert not model_takes_images(Settings(cache_dir=tmp_path))  # the bundled text demo


# ----- structured outputs -------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def with_format(response_format: Any, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": response_format,
        **extra,
    }


async def test_valid_json_schema_passes_with_a_default_name(settings: Settings) -> None:
    body = await normalize(
        with_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}}), settings
    )
    assert body["response_format"]["json_schema"] == {"name": "response", "schema": SCHEMA}


async def test_json_object_passes(settings: Settings) -> None:
    body = await normalize(with_format({"type": "json_object"}), settings)
    assert body["response_format"] == {"type": "json_object"}


async def test_schema_that_is_not_json_schema_is_refused(settings: Settings) -> None:
    bad = {"type": "object", "properties": {"answer": {"type": "strng"}}}
    error = await refused(
        with_format({"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}), settings
    )
    assert error.code == "invalid_json_schema" and "properties/answer/type" in error.message
    missing = await refused(
        with_format({"type": "json_schema", "json_schema": {"name": "x"}}), settings
    )
    assert missing.code == "invalid_json_schema"
    assert (await refused(with_format({"type": "yaml"}), settings)).param == "response_format.type"


async def test_guided_json_becomes_a_json_schema_response_format(settings: Settings) -> None:
    body = await normalize(
        {"messages": [{"role": "user", "content": "hi"}], "guided_json": SCHEMA}, settings
    )
    assert "guided_json" not in body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "guided_json", "schema": SCHEMA},
    }


async def test_other_guided_fields_become_structured_outputs(settings: Settings) -> None:
    body = await normalize(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "guided_choice": ["a", "b"],
            "guided_decoding_backend": "x",
        },
        settings,
    )
    assert body["structured_outputs"] == {"choice": ["a", "b"]}
    assert "guided_choice" not in body and "guided_decoding_backend" not in body


async def test_invalid_guided_json_and_structured_outputs_schemas_are_refused(
    settings: Settings,
) -> None:
    bad = {"type": 5}
    await refused({"messages": [{"role": "user", "content": "hi"}], "guided_json": bad}, settings)
    error = await refused(
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"json": bad}},
        settings,
    )
    assert error.param == "structured_outputs.json"


async def test_guided_json_beside_response_format_is_refused(settings: Settings) -> None:
    await refused(with_format({"type": "json_object"}, guided_json=SCHEMA), settings)


async def test_a_schema_sent_as_a_string_is_parsed_or_refused_naming_its_field(
    settings: Settings,
) -> None:
    text = orjson.dumps(SCHEMA).decode()
    body = await normalize(
        {"messages": [{"role": "user", "content": "hi"}], "guided_json": text}, settings
    )
    assert body["response_format"]["json_schema"]["schema"] == SCHEMA
    for field, payload in (
        ("guided_json", {"guided_json": "{not json"}),
        ("structured_outputs.json", {"structured_outputs": {"json": "{not json"}}),
    ):
        error = await refused(
            {"messages": [{"role": "user", "content": "hi"}], **payload}, settings
        )
        assert (error.code, error.param) == ("invalid_json_schema", field)
        assert error.message == f"'{field}' is not valid JSON."
