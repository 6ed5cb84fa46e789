"""Drop-in for Datature Vi users: the real Vi SDK server and loragate side by side.

The Vi SDK's local server (``vi.deployment.local.server.create_server(backend=...)``) and
``loragate.create_server(backend=...)`` serve the same backend, a subclass of the Vi SDK's own
``InferenceBackend`` (``vi/deployment/local/backends/base.py``), each under a real uvicorn on
its own port; the same requests go to both, and what each answered and what each handed the
backend are compared. Every difference asserted here is a row of docs/vi-sdk.md's table, which
tests/unit/test_vi_differences.py checks against the whole corpus (tests/vi_side_by_side/).
Then the Vi SDK's ``ViStreamingClient`` (``vi/deployment/local/stream.py``) against
``python -m loragate`` started with the Vi server's flags (on the stand-in engine).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import loragate
from loragate.settings import SettingsError
from tests.gateway_process import GatewayProcess

vi_server = pytest.importorskip("vi.deployment.local.server", reason="needs vi-sdk")
from vi.deployment.local.stream import ViStreamingClient  # noqa: E402

from tests.vi_side_by_side.corpus import PNG_BASE64, PNG_URI  # noqa: E402
from tests.vi_side_by_side.servers import RecordingViBackend, serving  # noqa: E402


@dataclass
class Answer:
    status: int
    content: str | None  # the assistant text, streamed pieces joined
    body: Any


def ask(url: str, body: dict[str, Any]) -> Answer:
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        data = response.json()
        content = data["choices"][0]["message"]["content"] if response.status_code == 200 else None
        return Answer(response.status_code, content, data)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if response.status_code != 200:
            response.read()
            return Answer(response.status_code, None, response.json())
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return Answer(200, text, events)


@dataclass
class SideBySide:
    vi_url: str
    vi_backend: RecordingViBackend
    lg_url: str
    lg_backend: RecordingViBackend

    def both(self, body: dict[str, Any]) -> tuple[Answer, Answer, list[Any], list[Any]]:
        self.vi_backend.calls.clear()
        self.lg_backend.calls.clear()
        vi, lg = ask(self.vi_url, body), ask(self.lg_url, body)
        return vi, lg, list(self.vi_backend.calls), list(self.lg_backend.calls)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SideBySide]:
    vi_backend, lg_backend = RecordingViBackend(), RecordingViBackend()
    vi_app = vi_server.create_server(backend=vi_backend)
    lg_app = loragate.create_server(
        backend=lg_backend, cache_dir=tmp_path_factory.mktemp("vi-dropin")
    )
    with serving(vi_app) as vi_url, serving(lg_app) as lg_url:
        yield SideBySide(vi_url, vi_backend, lg_url, lg_backend)


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "Caption",
        "schema": {
            "type": "object",
            "properties": {
                "caption": {"type": "string"},
                "boxes": {"type": "array", "items": {"type": "integer"}},
                "score": {"type": "number"},
            },
            "required": ["caption"],
        },
    },
}

# Requests both servers answer alike, and hand the backend alike.
SAME: dict[str, dict[str, Any]] = {
    "openai": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
    "openai-stream": {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    "openai-sampling": {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 7,
        "stop": ["END"],
        "logit_bias": {"12": 1.5},
    },
    "openai-penalties": {
        "messages": [{"role": "user", "content": "q"}],
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
    },
    "vi": {"source": PNG_URI, "user_prompt": "what is this?", "max_tokens": 9},
    "vi-stream": {"source": PNG_URI, "user_prompt": "describe", "stream": True},
    "vi-text-only": {"user_prompt": "no image"},
    "vi-generation-config": {
        "user_prompt": "q",
        "temperature": 0,
        "generation_config": {"max_new_tokens": 9, "top_p": 0.5, "temperature": 1.5},
    },
    "schema": {"user_prompt": "json please", "response_format": SCHEMA},
    "schema-stream": {
        "messages": [{"role": "user", "content": "json"}],
        "response_format": SCHEMA,
        "stream": True,
    },
    "json-object": {"user_prompt": "json", "response_format": {"type": "json_object"}},
}


@pytest.mark.parametrize("name", list(SAME))
def test_same_request_same_answer_and_same_backend_call(
    side_by_side: SideBySide, name: str
) -> None:
    vi, lg, vi_calls, lg_calls = side_by_side.both({"model": "vi-model", **SAME[name]})
    assert (vi.status, lg.status) == (200, 200), (vi.body, lg.body)
    assert lg.content == vi.content
    # What the backend got: the same method, keywords and values (vi/deployment/local/server.py:
    # chat_completions, stream_completion; utils.py: build_generation_config_from_request;
    # schema_utils.py: convert_response_format_to_pydantic).
    assert lg_calls == vi_calls
    assert len(lg_calls) == 1
    if not SAME[name].get("stream"):
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: lg.body["usage"][k] for k in counts} == {k: vi.body["usage"][k] for k in counts}
        assert lg.body["choices"][0]["finish_reason"] == vi.body["choices"][0]["finish_reason"]
        assert lg.body["model"] == vi.body["model"] == "vi-model"


def test_the_backend_gets_vi_conversions_not_loragate_ones(side_by_side: SideBySide) -> None:
    _, _, _, calls = side_by_side.both(
        {"model": "vi-model", **SAME["openai-penalties"], "response_format": SCHEMA}
    )
    [(method, kwargs)] = calls
    assert method == "generate"
    assert set(kwargs) == {"messages", "response_format", "generation_config"}  # no model=
    assert kwargs["response_format"]["pydantic_model"] == "Caption"  # a Pydantic class
    config = kwargs["generation_config"]
    assert config["temperature"] == 0.7 and config["do_sample"] is True  # Vi's default
    assert config["repetition_penalty"] == pytest.approx(1.08)  # penalties folded, as Vi does
    assert "frequency_penalty" not in config


def test_raw_base64_source_is_an_image_to_both(side_by_side: SideBySide) -> None:
    vi, lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "source": PNG_BASE64, "user_prompt": "raw"}
    )
    assert (vi.status, lg.status) == (200, 200) and lg.content == vi.content
    # Differs (table: "source"): Vi hands the string as sent, loragate the checked data URI.
    assert vi_calls[0][1]["source"] == PNG_BASE64
    assert lg_calls[0][1]["source"] == PNG_URI


def test_errors_differ_only_as_the_table_says(side_by_side: SideBySide) -> None:
    unknown_vi, unknown_lg, _, _ = side_by_side.both({"model": "nope", "user_prompt": "x"})
    assert unknown_vi.status == unknown_lg.status == 404
    assert (
        "vi-model" in unknown_vi.body["detail"]
        and "vi-model" in unknown_lg.body["error"]["message"]
    )

    both_vi, both_lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "user_prompt": "x", "messages": [{"role": "user", "content": "y"}]}
    )
    assert both_vi.status == both_lg.status == 400 and vi_calls == lg_calls == []
    assert set(both_lg.body["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape

    neither_vi, neither_lg, _, _ = side_by_side.both({"model": "vi-model"})
    assert neither_vi.status == neither_lg.status == 400

    # Table: "a backend's ValueError": Vi answers 500, loragate 400 (a bad request).
    bad_vi, bad_lg, _, _ = side_by_side.both({"model": "vi-model", "user_prompt": "explode"})
    assert (bad_vi.status, bad_lg.status) == (500, 400)
    assert "refuses to explode" in bad_vi.body["detail"]
    assert "refuses to explode" in bad_lg.body["error"]["message"]

    # Table: "out-of-range values": Vi's schema answers 422, loragate 400.
    range_vi, range_lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "user_prompt": "x", "max_tokens": 0}
    )
    assert (range_vi.status, range_lg.status) == (422, 400) and vi_calls == lg_calls == []

    # Table: "local paths": loragate reads them only inside --allowed-media-dir.
    _, path_lg, _, lg_calls = side_by_side.both(
        {"model": "vi-model", "source": "/etc/hostname", "user_prompt": "x"}
    )
    assert path_lg.status == 400 and lg_calls == []
    assert path_lg.body["error"]["code"] == "local_media_disabled"


def test_system_prompt_to_a_vi_backend_is_a_clear_400(side_by_side: SideBySide) -> None:
    # Vi's schema has no system_prompt: its server drops it silently; loragate says so.
    vi, lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "user_prompt": "x", "system_prompt": "S"}
    )
    assert vi.status == 200 and "system_prompt" not in vi_calls[0][1]
    assert lg.status == 400 and lg.body["error"]["param"] == "system_prompt" and lg_calls == []


def test_a_streamed_value_error_before_any_output(side_by_side: SideBySide) -> None:
    # Table: "a backend raising ValueError", streamed: the Vi server has answered 200 before
    # the backend runs and sends the error as an event; loragate waits for the first piece.
    body = {"model": "vi-model", "user_prompt": "explode", "stream": True}
    url = f"{side_by_side.vi_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert "refuses to explode" in json.loads(lines[-1])["error"]["message"]
    lg = httpx.post(f"{side_by_side.lg_url}/v1/chat/completions", json=body, timeout=30)
    assert lg.status_code == 400 and "refuses to explode" in lg.json()["error"]["message"]


# ----- issue #35: what the Vi server refuses, loragate refuses too --------------------------


@contextlib.contextmanager
def both_backends(side_by_side: SideBySide, **state: Any) -> Iterator[None]:
    """Both recording backends with ``state`` (``models``, ``models_fail``) for a while."""
    backends = (side_by_side.vi_backend, side_by_side.lg_backend)
    saved = [{name: getattr(backend, name) for name in state} for backend in backends]
    for backend in backends:
        for name, value in state.items():
            setattr(backend, name, value)
    try:
        yield
    finally:
        for backend, values in zip(backends, saved, strict=True):
            for name, value in values.items():
                setattr(backend, name, value)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_backend_that_cannot_list_its_models_is_a_json_500_on_both(
    side_by_side: SideBySide, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "vi-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    side_by_side.lg_backend.calls.clear()
    with both_backends(side_by_side, models_fail=True):
        vi = httpx.post(f"{side_by_side.vi_url}/v1/chat/completions", json=body, timeout=30)
        lg = httpx.post(f"{side_by_side.lg_url}/v1/chat/completions", json=body, timeout=30)
    assert vi.status_code == lg.status_code == 500
    assert "registry is down" in vi.json()["detail"]
    assert lg.headers["content-type"] == "application/json"  # not "Internal Server Error"
    error = lg.json()["error"]
    assert "registry is down" in error["message"] and error["type"] == "api_error"
    assert side_by_side.lg_backend.calls == []
    # One line in loragate's log, no traceback from it or from the ASGI server.
    assert not [r for r in caplog.records if r.exc_info and not r.name.startswith("vi.")]


def _vi_schema_bounds() -> dict[str, tuple[Any, Any]]:
    """The bounds (``ge``, ``le``) the Vi server's request schema puts on its fields, read
    from the installed SDK (vi/deployment/local/schemas.py: ``ChatCompletionRequest``)."""
    from vi.deployment.local.schemas import ChatCompletionRequest

    bounds = {}
    for name, field in ChatCompletionRequest.model_fields.items():
        least = next((m.ge for m in field.metadata if getattr(m, "ge", None) is not None), None)
        most = next((m.le for m in field.metadata if getattr(m, "le", None) is not None), None)
        if least is not None or most is not None:
            bounds[name] = (least, most)
    return bounds


VI_SCHEMA_BOUNDS = _vi_schema_bounds()
OUT_OF_RANGE = [
    (name, value)
    for name, (least, most) in VI_SCHEMA_BOUNDS.items()
    for value in ([least - 1] if least is not None else [])
    + ([most + 1] if most is not None else [])
]


def test_loragate_bounds_a_vi_backend_as_the_installed_sdk_does() -> None:
    from loragate.gateway.backends.custom_parameters import VI_BOUNDS

    assert VI_BOUNDS == VI_SCHEMA_BOUNDS and {"temperature", "top_p", "top_k"} <= set(VI_BOUNDS)


@pytest.mark.parametrize(
    ("field", "value"), OUT_OF_RANGE, ids=[f"{f}={v}" for f, v in OUT_OF_RANGE]
)
def test_values_out_of_the_vi_schemas_range_are_refused_by_both(
    side_by_side: SideBySide, field: str, value: Any
) -> None:
    # Table: "out-of-range values": Vi's schema answers 422, loragate 400, the backend unasked.
    vi, lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "user_prompt": "x", field: value}
    )
    assert (vi.status, lg.status) == (422, 400) and vi_calls == lg_calls == []
    assert lg.body["error"]["param"] == field


def test_the_vi_schemas_own_edges_reach_the_backend_on_both(side_by_side: SideBySide) -> None:
    edges = {"temperature": 2, "top_k": 1, "top_p": 1, "max_tokens": 1}
    vi, lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "user_prompt": "x", **edges}
    )
    assert (vi.status, lg.status) == (200, 200) and lg_calls == vi_calls


@pytest.mark.parametrize("model", [{}, {"model": None}], ids=["absent", "null"])
def test_a_request_without_a_model_is_refused_by_both(
    side_by_side: SideBySide, model: dict[str, Any]
) -> None:
    # Vi's schema requires `model` (422); loragate names it (400), whichever model is first.
    vi, lg, vi_calls, lg_calls = side_by_side.both(
        {**model, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert (vi.status, lg.status) == (422, 400) and vi_calls == lg_calls == []
    assert lg.body["error"]["param"] == "model"


def test_two_models_are_listed_as_the_backend_lists_them(side_by_side: SideBySide) -> None:
    with both_backends(side_by_side, models=["vi-model", "vi-other"]):
        vi = httpx.get(f"{side_by_side.vi_url}/v1/models").json()["data"]
        lg = httpx.get(f"{side_by_side.lg_url}/v1/models").json()["data"]
        asked_vi, asked_lg, _, _ = side_by_side.both({"model": "vi-other", "user_prompt": "x"})
    assert [m["id"] for m in lg] == [m["id"] for m in vi] == ["vi-model", "vi-other"]
    assert all("parent" not in m for m in vi)
    assert [m["parent"] for m in lg] == [None, None]  # neither an adapter of the other
    assert asked_vi.status == asked_lg.status == 200
    assert asked_lg.body["model"] == asked_vi.body["model"] == "vi-other"


# Messages Vi's schema (ChatMessage: role system, user or assistant; content a string or a
# list of parts) refuses, with the field loragate names.
Q = {"role": "user", "content": "q"}
OUTSIDE_VI_MESSAGES = {
    "developer-role": ([{"role": "developer", "content": "Be brief."}, Q], "messages[0].role"),
    "tool-role": ([Q, {"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages[1].role"),
    "function-role": ([Q, {"role": "function", "content": "4", "name": "f"}], "messages[1].role"),
    "null-content": ([Q, {"role": "assistant", "content": None}], "messages[1].content"),
}


@pytest.mark.parametrize("name", list(OUTSIDE_VI_MESSAGES))
def test_messages_outside_the_vi_schema_are_refused_by_both(
    side_by_side: SideBySide, name: str
) -> None:
    messages, param = OUTSIDE_VI_MESSAGES[name]
    vi, lg, vi_calls, lg_calls = side_by_side.both({"model": "vi-model", "messages": messages})
    assert (vi.status, lg.status) == (422, 400) and vi_calls == lg_calls == []
    assert lg.body["error"]["param"] == param


def test_raw_base64_in_an_image_url_is_an_image_to_both(side_by_side: SideBySide) -> None:
    content = [
        {"type": "image_url", "image_url": {"url": PNG_BASE64}},
        {"type": "text", "text": "q"},
    ]
    vi, lg, vi_calls, lg_calls = side_by_side.both(
        {"model": "vi-model", "messages": [{"role": "user", "content": content}]}
    )
    assert (vi.status, lg.status) == (200, 200)
    # Differs (table: "the image a backend gets"): Vi hands it as sent, loragate a data URI.
    assert vi_calls[0][1]["messages"][0]["content"][0]["image_url"]["url"] == PNG_BASE64
    assert lg_calls[0][1]["messages"][0]["content"][0]["image_url"]["url"] == PNG_URI


def test_health_answers_as_vi_on_both_routes(side_by_side: SideBySide) -> None:
    for route in ("/health", "/v1/health"):
        vi = httpx.get(side_by_side.vi_url + route).json()
        lg = httpx.get(side_by_side.lg_url + route)
        assert lg.status_code == 200
        assert vi == {"status": "healthy", "models": ["vi-model"]}
        assert {k: lg.json()[k] for k in ("status", "models")} == vi
    vi_models = httpx.get(side_by_side.vi_url + "/v1/models").json()
    lg_models = httpx.get(side_by_side.lg_url + "/v1/models").json()
    assert [m["id"] for m in lg_models["data"]] == [m["id"] for m in vi_models["data"]]


def test_vi_streaming_client_against_both(side_by_side: SideBySide) -> None:
    answers = []
    for url in (side_by_side.vi_url, side_by_side.lg_url):
        client = ViStreamingClient(base_url=f"{url}/v1")
        streamed = "".join(
            client.create(model="vi-model", source=PNG_URI, user_prompt="hi", show_progress=False)
        )
        whole = client.create(model="vi-model", source=PNG_URI, user_prompt="hi", stream=False)
        answers.append((streamed, whole.choices[0].message.content))
    assert answers[0] == answers[1] and answers[1][1].startswith("answer to hi")


# ----- create_server's keywords ---------------------------------------------------------------


def test_create_server_takes_vi_keywords_and_names_those_it_cannot(tmp_path: Path) -> None:
    app = loragate.create_server(
        backend=RecordingViBackend(), model_name="vi-model", cache_dir=tmp_path
    )
    assert app is not None
    for keyword, hint in (("device_map", "engine_args"), ("save_path", "cache_dir")):
        with pytest.raises(SettingsError, match=f"'{keyword}'.*{hint}"):
            loragate.create_server(
                backend=RecordingViBackend(), cache_dir=tmp_path, **{keyword: "auto"}
            )
    with pytest.raises(SettingsError, match="unknown setting 'modle_name'"):
        loragate.create_server(backend=RecordingViBackend(), cache_dir=tmp_path, modle_name="x")


def test_a_class_with_none_of_the_methods_is_still_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Vi SDK backend"):
        loragate.create_server(backend=object(), cache_dir=tmp_path)
    with pytest.raises(TypeError, match="instance"):
        loragate.create_server(backend=RecordingViBackend, cache_dir=tmp_path)


# ----- python -m loragate with the Vi server's flags ------------------------------------------


def test_python_m_loragate_takes_the_vi_servers_flags(tmp_path: Path) -> None:
    """``python -m loragate --pretrained-model-name-or-path DIR --port P --host H`` (the Vi
    server's ``__main__`` flags, vi/deployment/local/server.py) serves like `gateway serve`: the
    directory under its folder name, its whole path accepted too, ``/v1/health`` ready."""
    from tools.bench.targets import write_fake_model

    model = write_fake_model(tmp_path / "my-vi-model")
    config = tmp_path / "gateway.yaml"  # JSON is YAML: the stand-in engine instead of vLLM
    config.write_text(
        json.dumps({"engine_command": [sys.executable, "-m", "tools.bench.fake_engine"]})
    )
    gateway = GatewayProcess(
        cache_dir=tmp_path / "cache",
        launcher=[sys.executable, "-m", "loragate"],
        args=[
            "--pretrained-model-name-or-path",
            str(model),
            "--host",
            "127.0.0.1",
            "--config",
            str(config),
        ],
    ).start()
    try:
        gateway.wait_ready(120)
        health = httpx.get(f"{gateway.url}/v1/health").json()
        assert health["status"] == "healthy" and health["models"] == ["my-vi-model"]
        models = httpx.get(f"{gateway.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["my-vi-model"]
        client = ViStreamingClient(base_url=f"{gateway.url}/v1")
        streamed = "".join(
            client.create(
                model="my-vi-model", source=PNG_URI, user_prompt="hi", show_progress=False
            )
        )
        assert streamed
        for name in ("my-vi-model", str(model)):  # the whole path is an alias
            reply = client.create(model=name, source=PNG_URI, user_prompt="hi", stream=False)
            assert reply.model == "my-vi-model" and reply.choices[0].message.content
    finally:
        gateway.stop()
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
