"""`create_server(backend=...)` with a custom InferenceBackend, under a real uvicorn server."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai import OpenAI
from PIL import Image

import loragate
from loragate import GenerationResult, InferenceBackend
from tests.gateway_process import free_port


@dataclass
class Call:
    method: str
    args: dict[str, Any]


@dataclass
class RecordingBackend(InferenceBackend):
    """Answers "echo: <last user text>" (in words when streamed) and records every call."""

    calls: list[Call] = field(default_factory=list)
    started: bool = False
    stopped: bool = False

    def available_models(self) -> list[str]:
        return ["echo-base", "echo-lora"]

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def record(self, method: str, **args: Any) -> None:
        self.calls.append(Call(method, args))

    @staticmethod
    def answer(messages: list[dict[str, Any]]) -> str:
        content = messages[-1]["content"]
        text = (
            content
            if isinstance(content, str)
            else " ".join(p["text"] for p in content if p["type"] == "text")
        )
        if text == "fail please":
            raise RuntimeError("the model fell over")
        if text == "bad please":
            raise ValueError("this backend needs a question mark")
        return f"echo: {text}"

    async def generate(
        self,
        messages: list[dict[str, Any]],
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        self.record(
            "generate",
            messages=messages,
            response_format=response_format,
            generation_config=generation_config,
            **kwargs,
        )
        text = self.answer(messages)
        return GenerationResult(text, prompt_tokens=11, completion_tokens=len(text.split()))

    async def generate_stream(
        self,
        messages: list[dict[str, Any]],
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[str | None]:
        self.record(
            "generate_stream", messages=messages, generation_config=generation_config, **kwargs
        )
        text = self.answer(messages)
        for index, word in enumerate(text.split(" ")):
            yield None  # skipped, as the interface says
            yield word if index == 0 else " " + word


class ViAwareBackend(RecordingBackend):
    """Overrides the Vi entry points, as a Vi SDK backend does."""

    async def generate_vi_format(
        self,
        source: str | None = None,
        user_prompt: str | None = None,
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> GenerationResult | str:
        self.record(
            "generate_vi_format",
            source=source,
            user_prompt=user_prompt,
            generation_config=generation_config,
            **kwargs,
        )
        return f"vi saw {'an image' if source else 'no image'} and {user_prompt!r}"

    async def generate_stream_vi_format(
        self,
        source: str | None = None,
        user_prompt: str | None = None,
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[str | None]:
        self.record("generate_stream_vi_format", source=source, user_prompt=user_prompt, **kwargs)
        for piece in ("vi ", "streamed ", str(user_prompt)):
            yield piece


@dataclass
class Served:
    url: str
    backend: RecordingBackend
    client: OpenAI
    media_dir: Path

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=30)

    def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream(
            "POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
        ) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]


def png_data_uri() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 200, 0)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@contextlib.contextmanager
def running(backend: RecordingBackend, tmp_path: Path) -> Iterator[Served]:
    """``create_server(backend=...)`` under uvicorn on a free port, as a user would run it."""
    media_dir = tmp_path / "media"
    media_dir.mkdir(parents=True, exist_ok=True)
    (media_dir / "green.png").write_bytes(base64.b64decode(png_data_uri().split(",", 1)[1]))
    app = loragate.create_server(
        backend=backend, allowed_media_dir=media_dir, cache_dir=tmp_path / "cache"
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        yield Served(url, backend, client, media_dir)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("custom-backend")


@pytest.fixture(scope="module")
def plain_server(module_tmp: Path) -> Iterator[Served]:
    with running(RecordingBackend(), module_tmp / "plain") as served:
        yield served


@pytest.fixture(scope="module")
def vi_server(module_tmp: Path) -> Iterator[Served]:
    with running(ViAwareBackend(), module_tmp / "vi") as served:
        yield served


@pytest.fixture
def plain(plain_server: Served) -> Served:
    plain_server.backend.calls.clear()
    return plain_server


@pytest.fixture
def vi_aware(vi_server: Served) -> Served:
    vi_server.backend.calls.clear()
    return vi_server


def hello(model: str = "echo-base", text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


# ----- serving and life cycle ---------------------------------------------------------------


def test_the_backend_is_started_before_serving_and_stopped_after(tmp_path: Path) -> None:
    backend = RecordingBackend()
    with running(backend, tmp_path) as served:
        assert backend.started and not backend.stopped
        assert httpx.get(f"{served.url}/health").status_code == 200
    assert backend.stopped


def test_models_and_health_come_from_the_backend(plain: Served) -> None:
    models = {m.id: m for m in plain.client.models.list().data}
    assert list(models) == ["echo-base", "echo-lora"]
    assert (
        models["echo-lora"].model_extra and models["echo-lora"].model_extra["parent"] == "echo-base"
    )
    health = httpx.get(f"{plain.url}/health")
    assert health.status_code == 200
    body = health.json()
    assert body.pop("uptime_s") >= 0  # the gateway's own, beside what the backend says
    assert body == {"status": "healthy", "models": ["echo-base", "echo-lora"]}


def test_openai_request_gets_a_chat_completion_with_usage(plain: Served) -> None:
    reply = plain.client.chat.completions.create(**hello("echo-lora"))
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "echo-lora"
    assert reply.choices[0].message.content == "echo: hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        11,
        3,
        14,
    )
    [call] = plain.backend.calls
    assert call.method == "generate" and call.args["model"] == "echo-lora"
    assert call.args["messages"] == [{"role": "user", "content": "hello there"}]


def test_openai_stream_concatenates_to_the_answer_and_reports_usage_when_asked(
    plain: Served,
) -> None:
    chunks = list(
        plain.client.chat.completions.create(
            **hello("echo-lora"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(
        chunk.model == "echo-lora" and chunk.object == "chat.completion.chunk" for chunk in chunks
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3  # one per piece the backend yielded
    assert plain.backend.calls[0].method == "generate_stream"


def test_stream_without_include_usage_has_no_usage_event(plain: Served) -> None:
    events = plain.stream(hello())
    assert all(event["choices"] for event in events)
    assert all("usage" not in event for event in events)


def test_generation_parameters_reach_the_backend_under_hugging_face_names(plain: Served) -> None:
    plain.client.chat.completions.create(
        **hello(),
        max_tokens=5,
        temperature=0.3,
        top_p=0.9,
        seed=7,
        stop="zzz",
        logit_bias={"42": 5},
    )
    assert plain.backend.calls[0].args["generation_config"] == {
        "max_new_tokens": 5,
        "temperature": 0.3,
        "do_sample": True,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["zzz"],
        "logit_bias": {"42": 5},
    }


def test_n_gives_n_choices(plain: Served) -> None:
    reply = plain.client.chat.completions.create(**hello(), n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.message.content for c in reply.choices} == {"echo: hello there"}
    assert reply.usage is not None and reply.usage.completion_tokens == 9
    events = plain.stream(hello(n=2))
    finished = [
        e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"] == "stop"
    ]
    assert finished == [0, 1]


def test_stop_cuts_the_answer_even_when_the_backend_ignores_it(plain: Served) -> None:
    reply = plain.client.chat.completions.create(
        **hello(text="hello there friend"), stop=["there", "zz"]
    )
    assert reply.choices[0].message.content == "echo: hello "
    assert reply.choices[0].finish_reason == "stop"
    events = plain.stream(hello(text="hello there friend", stop="re fr"))
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "echo: hello the"
    )


def test_backend_errors_keep_openai_shape(plain: Served) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        plain.client.chat.completions.create(**hello(text="bad please"))
    assert "question mark" in bad.value.response.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as failed:
        plain.client.chat.completions.create(**hello(text="fail please"))
    error = failed.value.response.json()["error"]
    assert error["code"] == "backend_error" and "fell over" in error["message"]
    # A stream that fails before its first piece fails with a status, not a broken stream.
    streamed = plain.post(hello(text="fail please", stream=True))
    assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "backend_error"


def test_unknown_model_is_404_naming_the_valid_ids(plain: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        plain.client.chat.completions.create(**hello("nope"))
    message = caught.value.response.json()["error"]["message"]
    assert "nope" in message and "echo-base" in message and "echo-lora" in message
    assert plain.backend.calls == []


def test_legacy_completions_are_refused_clearly(plain: Served) -> None:
    response = httpx.post(
        f"{plain.url}/v1/completions", json={"model": "echo-base", "prompt": "hi"}
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_supported"


def test_create_server_refuses_what_is_not_a_backend(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="InferenceBackend"):
        loragate.create_server(backend=object(), cache_dir=tmp_path)
    with pytest.raises(TypeError, match="instance"):
        loragate.create_server(backend=RecordingBackend, cache_dir=tmp_path)


# ----- the Vi format --------------------------------------------------------------------------


def test_vi_request_reaches_generate_vi_format(vi_aware: Served) -> None:
    response = vi_aware.post(
        {
            "model": "echo-lora",
            "source": "green.png",
            "user_prompt": "what?",
            "system_prompt": "Be brief.",
        }
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "echo-lora"
    assert body["choices"][0]["message"]["content"] == "vi saw an image and 'what?'"
    assert (
        body["usage"]["total_tokens"]
        == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        > 0
    )
    [call] = vi_aware.backend.calls
    assert call.method == "generate_vi_format"
    assert call.args["source"] == png_data_uri()  # the checked image, read from the allowed dir
    assert call.args["user_prompt"] == "what?"
    assert call.args["system_prompt"] == "Be brief." and call.args["model"] == "echo-lora"


def test_vi_stream_reaches_generate_stream_vi_format(vi_aware: Served) -> None:
    events = vi_aware.stream(
        {"model": "echo-base", "source": png_data_uri(), "user_prompt": "why?"}
    )
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "vi streamed why?"
    )
    assert vi_aware.backend.calls[0].method == "generate_stream_vi_format"


def test_vi_generation_config_reaches_the_backend_with_top_level_precedence(
    vi_aware: Served,
) -> None:
    vi_aware.post(
        {
            "user_prompt": "q",
            "temperature": 0.5,
            "generation_config": {"max_new_tokens": 9, "do_sample": False},
        }
    )
    assert vi_aware.backend.calls[0].args["generation_config"] == {
        "max_new_tokens": 9,
        "temperature": 0.5,
        "do_sample": True,
    }


def test_vi_methods_default_to_the_openai_ones(plain: Served) -> None:
    response = plain.post(
        {"model": "echo-base", "source": png_data_uri(), "user_prompt": "hi", "system_prompt": "S"}
    )
    assert response.json()["choices"][0]["message"]["content"] == "echo: hi"
    [call] = plain.backend.calls
    assert call.method == "generate"
    assert call.args["messages"] == [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_uri()}},
                {"type": "text", "text": "hi"},
            ],
        },
    ]
    events = plain.stream({"model": "echo-base", "user_prompt": "streamed hi"})
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        == "echo: streamed hi"
    )
    assert plain.backend.calls[-1].method == "generate_stream"


def test_openai_client_sends_vi_fields_in_extra_body(vi_aware: Served) -> None:
    reply = vi_aware.client.chat.completions.create(
        model="echo-base", messages=[], extra_body={"source": "green.png", "user_prompt": "sdk?"}
    )
    assert reply.choices[0].message.content == "vi saw an image and 'sdk?'"


def test_both_or_neither_format_is_400_before_the_backend(vi_aware: Served) -> None:
    both = vi_aware.post({**hello(), "user_prompt": "x"})
    neither = vi_aware.post({"model": "echo-base"})
    assert (both.status_code, neither.status_code) == (400, 400)
    assert both.json()["error"]["code"] == "ambiguous_request_format"
    assert set(neither.json()["error"]) == {"message", "type", "param", "code"}
    assert vi_aware.backend.calls == []


def test_image_checks_apply_before_the_backend(vi_aware: Served) -> None:
    outside = vi_aware.post({"source": "/etc/passwd", "user_prompt": "?"})
    assert outside.status_code == 403 and outside.json()["error"]["code"] == "media_path_forbidden"
    corrupt = vi_aware.post(
        {
            "source": "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nxx").decode(),
            "user_prompt": "?",
        }
    )
    assert corrupt.status_code == 400 and corrupt.json()["error"]["param"] == "source"
    assert vi_aware.backend.calls == []


def test_response_format_reaches_the_backend_and_bad_schemas_do_not(plain: Served) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    plain.client.chat.completions.create(**hello(), response_format=response_format)  # type: ignore[call-overload]
    assert plain.backend.calls[0].args["response_format"] == response_format
    plain.backend.calls.clear()
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "0"}},
    }
    response = plain.post(hello(response_format=bad))
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json_schema"
    assert plain.backend.calls == []
