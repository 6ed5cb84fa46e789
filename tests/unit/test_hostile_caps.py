"""What a hostile client cannot get past (issue #33): the token cap on every generation route,
request ids that cannot forge access-log lines, and open admin routes behind a proxy.

Each request goes through a gateway served on its own port, both ways a client meets it: on
``gateway serve``'s own server (chat and completions answered by its hot routes, without
ASGI) and on plain uvicorn (every route through the ASGI app).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.responses import Response

from loragate.adapters.preset import Preset
from loragate.gateway.app import create_app
from loragate.gateway.requests.parameters import Route
from loragate.gateway.requests.presets import apply_preset, parameter_rules
from loragate.gateway.runtime import Gateway
from tests.backend_double import ManagedBackendDouble, RecordingBackend, serving, settings_for

CAP = 64
WAYS = ["served", "asgi"]


class EchoingBackend(RecordingBackend):
    """A RecordingBackend whose answers carry the request id, as the engine proxy's do."""

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        await super().forward(path, payload, public_model, stream, request_id)
        body = orjson.dumps({"id": request_id, "object": "chat.completion", "choices": []})
        return Response(body, media_type="application/json", headers={"X-Request-ID": request_id})


@contextlib.contextmanager
def gateway(
    tmp_path: Path, way: str, backend: Any = None, **values: Any
) -> Iterator[tuple[httpx.Client, Any]]:
    """A client of a gateway with ``values`` served ``way``, and the backend behind it."""
    backend = backend if backend is not None else RecordingBackend()
    app = create_app(settings_for(tmp_path, **values), backend=backend)
    with serving(app, as_served=way == "served") as url, httpx.Client(base_url=url) as client:
        yield client, backend


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "base", "messages": [{"role": "user", "content": "hi"}], **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "base", "prompt": "hi", **extra}


def vi(**extra: Any) -> dict[str, Any]:
    return {"model": "base", "user_prompt": "What is in it?", **extra}


def anthropic(**extra: Any) -> dict[str, Any]:
    return {"model": "base", "messages": [{"role": "user", "content": "hi"}], **extra}


# ----- the token cap ----------------------------------------------------------------------------


# A request that asks no limit, and the field the engine reads the cap from.
ASKS_NO_LIMIT = {
    "chat": ("/v1/chat/completions", chat(), "max_tokens"),
    "chat-null": ("/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=None),
                  "max_tokens"),
    "chat-stream": ("/v1/chat/completions", chat(stream=True), "max_tokens"),
    "completions-null": ("/v1/completions", completion(max_tokens=None), "max_tokens"),
    "responses": ("/v1/responses", {"model": "base", "input": "hi"}, "max_output_tokens"),
    "responses-null": ("/v1/responses", {"input": "hi", "max_output_tokens": None},
                       "max_output_tokens"),
    "vi": ("/v1/chat/completions", vi(), "max_tokens"),
    "vi-config": ("/v1/chat/completions", vi(generation_config={"do_sample": False}),
                  "max_tokens"),
}  # fmt: skip


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("path", "body", "field"), ASKS_NO_LIMIT.values(), ids=list(ASKS_NO_LIMIT))
def test_a_generation_that_asks_no_limit_reaches_the_engine_with_the_cap(
    tmp_path: Path, way: str, path: str, body: dict[str, Any], field: str
) -> None:
    with gateway(tmp_path, way, max_tokens_cap=CAP) as (client, backend):
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
    [(forwarded_path, forwarded)] = backend.forwarded
    assert forwarded_path == path
    assert forwarded[field] == CAP


@pytest.mark.parametrize("way", WAYS)
def test_a_completion_that_asks_no_limit_keeps_the_engines_16_unless_the_cap_is_lower(
    tmp_path: Path, way: str
) -> None:
    # vLLM, like OpenAI, generates 16 tokens for a completion without max_tokens.
    with gateway(tmp_path / "low", way, max_tokens_cap=8) as (client, low):
        assert client.post("/v1/completions", json=completion()).status_code == 200
    with gateway(tmp_path / "high", way, max_tokens_cap=CAP) as (client, high):
        assert client.post("/v1/completions", json=completion()).status_code == 200
    assert low.forwarded[0][1]["max_tokens"] == 8
    assert high.forwarded[0][1]["max_tokens"] == 16


# A request over the cap: the parameter the 400 names, and its code.
OVER_THE_CAP = {
    "messages": ("/v1/messages", anthropic(max_tokens=100_000), "max_tokens",
                 "max_tokens_too_large"),
    # vLLM's request models read "100000" and 1e5 as the number: never past the cap either.
    "messages-string": ("/v1/messages", anthropic(max_tokens="100000"), "max_tokens",
                        "invalid_type"),
    "messages-float": ("/v1/messages", anthropic(max_tokens=1e5), "max_tokens", "invalid_type"),
    "chat-min-tokens": ("/v1/chat/completions", chat(min_tokens=100_000, ignore_eos=True),
                        "min_tokens", "min_tokens_too_large"),
    "chat-min-over-max": ("/v1/chat/completions", chat(max_tokens=10, min_tokens=100_000),
                          "min_tokens", "min_tokens_too_large"),
    "completions-min-tokens": ("/v1/completions", completion(min_tokens=100_000, ignore_eos=True),
                               "min_tokens", "min_tokens_too_large"),
    "vi-min-new-tokens": ("/v1/chat/completions",
                          vi(generation_config={"min_new_tokens": 100_000}), "min_tokens",
                          "min_tokens_too_large"),
}  # fmt: skip


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    ("path", "body", "param", "code"), OVER_THE_CAP.values(), ids=list(OVER_THE_CAP)
)
def test_a_limit_above_the_cap_is_a_400_and_reaches_no_engine(
    tmp_path: Path, way: str, path: str, body: dict[str, Any], param: str, code: str
) -> None:
    with gateway(tmp_path, way, max_tokens_cap=CAP) as (client, backend):
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert backend.forwarded == []


@pytest.mark.parametrize("way", WAYS)
def test_limits_within_the_cap_reach_the_engine_as_asked(tmp_path: Path, way: str) -> None:
    with gateway(tmp_path, way, max_tokens_cap=CAP) as (client, backend):
        for path, body in [
            ("/v1/messages", anthropic(max_tokens=CAP)),
            ("/v1/chat/completions", chat(max_completion_tokens=5, min_tokens=CAP)),
            ("/v1/chat/completions", vi(generation_config={"max_new_tokens": 7})),
        ]:
            assert client.post(path, json=body).status_code == 200
    sent = [body for _, body in backend.forwarded]
    assert sent[0]["max_tokens"] == CAP
    assert (sent[1]["max_completion_tokens"], sent[1]["min_tokens"]) == (5, CAP)
    assert "max_tokens" not in sent[1]  # one limit asked: none added beside it
    assert sent[2]["max_tokens"] == 7


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_presets_token_clamp_below_the_cap_is_the_limit_of_a_request_that_asked_none(
    tmp_path: Path, route: Route
) -> None:
    """The cap the gateway filled in is not the client's ask: the preset's clamp lowers it
    (no 400), its default stands when lower, and nothing the preset sets passes the cap."""
    runtime = Gateway(settings_for(tmp_path, max_tokens_cap=CAP), RecordingBackend())
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"

    def shaped(raw: dict[str, Any], body: dict[str, Any]) -> Any:
        preset = Preset.from_dict(raw, parameter_rules)
        runtime.cap_tokens(path, body)
        return apply_preset(preset, body, route).get("max_tokens")

    base = chat if route == "chat" else lambda: completion(max_tokens=None)
    assert shaped({"clamps": {"max_tokens": 16}}, base()) == 16
    assert shaped({"defaults": {"max_tokens": 5}}, base()) == 5
    assert shaped({"defaults": {"max_tokens": 500}}, base()) == CAP
    assert shaped({"clamps": {"max_tokens": 500}}, base()) == CAP
    assert shaped({}, base()) == CAP


# ----- request ids ------------------------------------------------------------------------------

FORGED = "x 127.0.0.1 [forged] POST /admin/adapters/prod 200"


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    "given",
    [FORGED, "a\tb", "caf\u00e9", "x" * 129, "", "a/b"],
    ids=["spaces", "tab", "non-ascii", "too-long", "empty", "slash"],
)
def test_a_request_id_outside_the_safe_alphabet_is_replaced(
    tmp_path: Path, way: str, given: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loragate.access")
    with gateway(tmp_path, way, EchoingBackend(), access_log=True) as (client, _):
        for path, body in [("/v1/chat/completions", chat()), ("/v1/responses", {"input": "hi"})]:
            headers = {"X-Request-ID": given.encode()}
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 200, response.text
            assert response.headers["x-request-id"] not in (given, "")
            assert len(response.headers["x-request-id"]) == 32
    lines = [r.getMessage() for r in caplog.records if r.name == "loragate.access"]
    assert len(lines) == 2
    assert all("[forged]" not in line and "request_id=x " not in line for line in lines)
    assert all(len(line.split()) == 10 for line in lines), lines


@pytest.mark.parametrize("way", WAYS)
def test_a_request_id_in_the_safe_alphabet_is_kept(tmp_path: Path, way: str) -> None:
    given = "req_01J9:abc-DEF.7" + "x" * 110
    with gateway(tmp_path, way, EchoingBackend()) as (client, _):
        for path, body in [("/v1/chat/completions", chat()), ("/v1/responses", {"input": "hi"})]:
            response = client.post(path, json=body, headers={"X-Request-ID": given})
            assert response.headers["x-request-id"] == given


@pytest.mark.parametrize("way", WAYS)
def test_the_gateways_own_refusals_carry_the_request_id(tmp_path: Path, way: str) -> None:
    """A 400 (a bad value) and a 404 (a model it does not serve) answered by the gateway
    itself carry the request's id as the backend's answers do: the client's, else a new one."""
    with gateway(tmp_path, way, EchoingBackend()) as (client, _):
        bad = client.post(
            "/v1/chat/completions", json=chat(temperature=-1), headers={"X-Request-ID": "mine"}
        )
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "mine"
        unknown = client.post("/v1/chat/completions", json={**chat(), "model": "nope"})
        assert unknown.status_code == 404 and len(unknown.headers["x-request-id"]) == 32


# ----- open admin behind a proxy ----------------------------------------------------------------

PROXY_HEADERS = [
    "CF-Connecting-IP",
    "True-Client-IP",
    "X-Client-IP",
    "X-Original-Forwarded-For",
    "X-Cluster-Client-IP",
    "Fastly-Client-IP",
    "X-Forwarded-Server",
    "X-Forwarded-Port",
    "X-Original-URI",
    "X-ProxyUser-IP",
    "Client-IP",
]


@pytest.mark.parametrize("way", WAYS)
def test_open_admin_refuses_a_request_any_proxy_header_says_was_forwarded(
    tmp_path: Path, way: str
) -> None:
    backend = ManagedBackendDouble()
    settings = {"host": "127.0.0.1", "open_admin": True}
    with gateway(tmp_path, way, backend, **settings) as (local, _):
        for header in PROXY_HEADERS:
            refused = local.post("/admin/engine/restart", headers={header: "203.0.113.9"})
            assert refused.status_code == 403, header
            assert refused.json()["error"]["code"] == "invalid_admin_key"
        assert backend.supervisor.restart_requests == 0
        assert local.post("/admin/engine/restart").status_code == 202  # straight from loopback
    assert backend.supervisor.restart_requests == 1
