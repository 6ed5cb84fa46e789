"""The Vi request shape and OpenAI's generation parameters, end to end on the text demo.

Every test runs twice: against the shared gateway (supervised engine) and against a gateway
started with ``upstream_url`` pointing at it, which supervises nothing and only proxies.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai import OpenAI

import loragate
from tests.conftest import PHRASES, phrase_of
from tests.gateway_process import GatewayProcess, free_port

pytestmark = pytest.mark.engine

BASE = "loragate-demo"


@dataclass
class Served:
    kind: str
    url: str
    client: OpenAI

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.post({"max_tokens": 16, "temperature": 0, **body})
        assert response.status_code == 200, response.text
        return dict(response.json())

    def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream(
            "POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
        ) as response:
            assert response.status_code == 200, response.read().decode()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]


class InProcessGateway:
    """``loragate.create_server(...)`` under uvicorn in a thread, on a free port."""

    def __init__(self, **options: Any) -> None:
        self.port = free_port()
        self.cache_dir: Path = options["cache_dir"]
        app = loragate.create_server(**options)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessGateway:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        # Ready once the upstream's models are known.
        while httpx.get(f"{self.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the upstream-backed gateway never became ready"
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def openai_client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def upstream_gateway(
    gateway: GatewayProcess, media_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessGateway]:
    with InProcessGateway(
        upstream_url=f"{gateway.url}/v1",
        allowed_media_dir=media_dir,
        cache_dir=tmp_path_factory.mktemp("upstream-gateway"),
    ) as front:
        yield front


@pytest.fixture(scope="module", params=["engine", "upstream"])
def served(request: pytest.FixtureRequest, gateway: GatewayProcess, client: OpenAI) -> Served:
    if request.param == "engine":
        return Served("engine", gateway.url, client)
    front: InProcessGateway = request.getfixturevalue("upstream_gateway")
    return Served("upstream", front.url, openai_client(front.url))


def text_of(body: dict[str, Any], index: int = 0) -> str:
    return str(body["choices"][index]["message"]["content"])


def streamed_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


# ----- the Vi shape -----------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", sorted(PHRASES))
def test_vi_request_is_answered_by_the_adapter_it_names(served: Served, adapter: str) -> None:
    body = served.answer({"model": adapter, "user_prompt": "Hello there"})
    assert body["model"] == adapter
    assert PHRASES[adapter] in text_of(body)
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0


def test_vi_request_to_the_base_model_carries_no_adapter_phrase(served: Served) -> None:
    body = served.answer(
        {"model": BASE, "user_prompt": "Hello there", "system_prompt": "You are terse."}
    )
    assert body["model"] == BASE
    assert phrase_of(text_of(body)) is None


def test_vi_request_without_model_goes_to_the_base_model(served: Served) -> None:
    body = served.answer({"user_prompt": "Hello there"})
    assert body["model"] == BASE


@pytest.mark.parametrize("model", [BASE, "owl"])
def test_vi_stream_concatenates_to_the_unstreamed_answer(served: Served, model: str) -> None:
    request = {"model": model, "user_prompt": "Say something", "max_tokens": 12, "temperature": 0}
    expected = text_of(served.answer(request))
    events = served.stream(request)
    assert all(event["model"] == model for event in events)
    assert streamed_text(events) == expected


def test_vi_generation_config_maps_onto_engine_parameters(served: Served) -> None:
    request = {"model": BASE, "user_prompt": "Hello", "ignore_eos": True}
    config = {"max_new_tokens": 3, "do_sample": False}
    response = served.post({**request, "generation_config": config})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    top_level_wins = served.post({**request, "max_tokens": 2, "generation_config": config})
    assert top_level_wins.json()["usage"]["completion_tokens"] == 2


def test_vi_fields_through_the_openai_sdk(served: Served) -> None:
    reply = served.client.chat.completions.create(
        model="fox", messages=[], max_tokens=16, temperature=0, extra_body={"user_prompt": "Hello"}
    )
    assert reply.model == "fox"
    assert PHRASES["fox"] in (reply.choices[0].message.content or "")


def test_both_shapes_are_400_in_openai_error_shape(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"source": "x.png", "user_prompt": "hi"},
        )
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "ambiguous_request_format" and error["type"] == "invalid_request_error"


def test_neither_shape_is_400(served: Served) -> None:
    response = served.post({"model": BASE, "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "missing_messages"
    assert "messages" in error["message"] and "user_prompt" in error["message"]


def test_unknown_model_is_404_naming_the_valid_ids(served: Served) -> None:
    response = served.post({"model": "no-such-model", "user_prompt": "Hello"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    for name in ("no-such-model", BASE, *PHRASES):
        assert name in error["message"]


# ----- local images the gateway refuses before the engine sees them -----------------------------


@pytest.fixture(scope="module")
def refused_media(media_dir: Path) -> dict[str, str]:
    (media_dir / "vi-corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    link = media_dir / "vi-passwd.png"
    if not link.is_symlink():
        link.symlink_to("/etc/passwd")
    return {"corrupt": "vi-corrupt.png", "symlink": "vi-passwd.png"}


@pytest.mark.parametrize("source", ["/etc/passwd", "symlink", "../../../../../etc/passwd"])
def test_local_path_leading_out_of_the_allowed_dir_is_refused_unread(
    served: Served, refused_media: dict[str, str], source: str
) -> None:
    response = served.post(
        {"model": BASE, "source": refused_media.get(source, source), "user_prompt": "?"}
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "media_path_forbidden"
    assert "root:" not in response.text


def test_corrupt_image_is_400_naming_the_problem(
    served: Served, refused_media: dict[str, str]
) -> None:
    response = served.post({"model": BASE, "source": refused_media["corrupt"], "user_prompt": "?"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_image" and error["param"] == "source"
    assert "PNG" in error["message"] and "corrupt" in error["message"]


# ----- OpenAI's generation parameters -----------------------------------------------------------


def hello(model: str = BASE, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hello there"}], **extra}


def test_n_gives_n_choices_and_usage(served: Served) -> None:
    body = served.answer(hello(n=2, temperature=1.0, seed=3))
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert (
        body["usage"]["total_tokens"]
        == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )


def test_seed_makes_sampling_repeatable(served: Served) -> None:
    first = text_of(served.answer(hello(temperature=1.0, seed=1234)))
    assert text_of(served.answer(hello(temperature=1.0, seed=1234))) == first


def test_stop_ends_the_answer_before_the_stop_string(served: Served) -> None:
    body = served.answer(hello("fox", stop=["x f"]))
    assert text_of(body) == " fo"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_logit_bias_steers_every_token(served: Served, demo_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_dir / "base" / "tokenizer.json"))
    token = tokenizer.encode(" hello").ids[0]
    body = served.answer(hello(logit_bias={str(token): 100}, max_tokens=4, ignore_eos=True))
    assert text_of(body) == tokenizer.decode([token] * 4)


def test_stream_reports_usage_only_when_asked(served: Served) -> None:
    plain = served.stream(hello(max_tokens=4, ignore_eos=True))
    assert all(event.get("usage") is None for event in plain)
    asked = served.stream(
        hello(max_tokens=4, ignore_eos=True, stream_options={"include_usage": True})
    )
    assert asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 4


# ----- the upstream backend itself --------------------------------------------------------------


def test_upstream_backend_supervises_nothing(upstream_gateway: InProcessGateway) -> None:
    health = httpx.get(f"{upstream_gateway.url}/health", timeout=5)
    assert health.status_code == 200
    assert set(health.json()["models"]) == {BASE, *PHRASES}
    # No --admin-key: the per-start token in its cache dir is the admin key.
    token = (upstream_gateway.cache_dir / "admin-token").read_text().strip()
    engine = httpx.get(
        f"{upstream_gateway.url}/admin/engine",
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    )
    assert engine.status_code == 404 and engine.json()["error"]["code"] == "not_supported"


def test_upstream_backend_gives_the_base_model_its_public_name(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    with InProcessGateway(upstream_url=gateway.url, model_name="tiny", cache_dir=tmp_path) as front:
        client = openai_client(front.url)
        assert [m.id for m in client.models.list().data] == ["tiny", *sorted(PHRASES)]
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
        assert reply.model == "tiny"
        for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, stream=True
        ):
            assert chunk.model == "tiny"
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hi"}])
        assert "tiny" in caught.value.response.json()["error"]["message"]
        adapter = client.chat.completions.create(
            model="pong",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=16,
            temperature=0,
        )
        assert PHRASES["pong"] in (adapter.choices[0].message.content or "")
