"""The generation parameters' table: its 400s and its OpenAPI description never disagree.

Both come from ``loragate.gateway.requests.parameters.PARAMETERS``; these tests read the
description as a client does (``/openapi.json`` of a served gateway) and probe each row with the
same values both ways, the documented bounds and a step past each among them, so a range
edited in one place and not the other fails here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from loragate.gateway.app import create_app
from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.parameters import (
    PARAMETERS,
    ROUTES,
    Parameter,
    Route,
    check_parameters,
    parameters_of,
)
from loragate.gateway.requests.vi import HF_TO_OPENAI
from tests.backend_double import RecordingBackend, serving, settings_for

REQUEST_SCHEMA: dict[Route, str] = {"chat": "OpenAIChatRequest", "completions": "CompletionRequest"}
# What each route needs besides the parameter probed, so only that parameter can be refused.
REST: dict[Route, dict[str, Any]] = {
    "chat": {"model": "base", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "base", "prompt": "hi"},
}
NUMBERS = [
    *(-(2**63) - 1, -(2**63), -101, -100, -2.001, -2, -1.001, -1, -0.001, 0, 0.001, 0.5),
    *(1, 1.001, 1.5, 2, 2.001, 19, 20, 21, 100, 101, 127, 128, 129, 10**9, 2**63 - 1, 2**63),
]
OTHER_VALUES = [
    *(None, True, False, "", "x", "auto", [], ["a"], ["a", 1], [[]], [[1, 2], [3]], [[1], "a"]),
    *({}, {"": 1}, {"a": 1}, {"50256": "x"}, {"include_usage": True}),
    *({"include_usage": "yes"}, {"continuous_usage_stats": 1}, {"include_usage": None}),
    *([{}], [{"type": "function"}], ["tool"]),
]
BOUNDS = ("minimum", "exclusiveMinimum", "maximum")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    app = create_app(settings_for(tmp_path_factory.mktemp("cache")), backend=RecordingBackend())
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def spec(served: str) -> dict[str, Any]:
    return dict(httpx.get(f"{served}/openapi.json", timeout=10).json())


def documented(spec: dict[str, Any], route: Route, name: str) -> dict[str, Any]:
    return dict(spec["components"]["schemas"][REQUEST_SCHEMA[route]]["properties"][name])


def bound_probes(schema: Any) -> Iterator[Any]:
    """Each bound written anywhere in ``schema``, and a step past it, in the shape it bounds:
    a number, an array item (``items``) or an object value (``additionalProperties``)."""
    if isinstance(schema, list):
        for inner in schema:
            yield from bound_probes(inner)
        return
    if not isinstance(schema, dict):
        return
    step = 1 if schema.get("type") == "integer" else 0.001
    for key in BOUNDS:
        if key in schema:
            yield from _inside_and_past(key, schema[key], step)
    for key, inner in schema.items():
        if key == "items":
            yield from ([value] for value in bound_probes(inner))
        elif key == "additionalProperties":
            yield from ({"42": value} for value in bound_probes(inner))
        elif key in ("anyOf", "properties"):
            yield from bound_probes(list(inner.values()) if key == "properties" else inner)


def _inside_and_past(key: str, bound: Any, step: float) -> tuple[Any, Any]:
    """The last value a bound lets through, then the first it refuses."""
    if key == "minimum":
        return bound, bound - step
    if key == "exclusiveMinimum":
        return bound + step, bound
    return bound, bound + step


def probes(schema: dict[str, Any]) -> list[Any]:
    wrapped = [[number] for number in NUMBERS] + [{"42": number} for number in NUMBERS]
    return [*bound_probes(schema), *NUMBERS, *wrapped, *OTHER_VALUES]


def refusal(parameter: Parameter, route: Route, value: Any) -> OpenAIError | None:
    """The check's 400 for ``value``, or None when it lets the value through."""
    payload = {**REST[route], parameter.name: value}
    try:
        check_parameters(payload, route)
    except OpenAIError as error:
        return error
    return None


ROWS = [(route, parameter) for route in ROUTES for parameter in parameters_of(route)]


@pytest.mark.parametrize(
    ("route", "parameter"), ROWS, ids=[f"{route}-{parameter.name}" for route, parameter in ROWS]
)
def test_the_description_and_the_check_accept_the_same_values(
    spec: dict[str, Any], route: Route, parameter: Parameter
) -> None:
    schema = documented(spec, route, parameter.name)
    assert schema["description"] == parameter.description
    validator = jsonschema.Draft202012Validator(schema)
    for value in probes(schema):
        error = refusal(parameter, route, value)
        assert validator.is_valid(value) is (error is None), (value, error and error.message)
        if error is not None:
            assert error.status == 400
            assert error.param is not None and error.param.split(".")[0] == parameter.name
            assert parameter.name in error.message


def test_every_row_is_described_and_every_described_bound_is_a_row(spec: dict[str, Any]) -> None:
    for route in ROUTES:
        request = spec["components"]["schemas"][REQUEST_SCHEMA[route]]
        rows = {parameter.name for parameter in parameters_of(route)}
        assert rows <= set(request["properties"])
        bounded = {
            name
            for name, schema in request["properties"].items()
            if any(bound in str(schema) for bound in BOUNDS)
        }
        assert bounded <= rows, bounded - rows
        required = {parameter.name for parameter in parameters_of(route) if parameter.required}
        assert set(request.get("required", [])) - {"messages"} == required
    names = {parameter.name for parameter in PARAMETERS}
    rows_by_route = [(p.name, route) for p in PARAMETERS for route in p.routes]
    assert len(rows_by_route) == len(set(rows_by_route)), "a parameter is in a route twice"
    assert {"temperature", "top_p", "n", "max_tokens", "logit_bias", "prompt"} <= names


def outside(schema: dict[str, Any]) -> Any:
    """A value a step past the first bound ``schema`` documents."""
    values = list(bound_probes(schema))
    return values[1]


BOUNDED = [
    (route, parameter)
    for route, parameter in ROWS
    if any(bound in str(parameter.schema()) for bound in BOUNDS)
]


@pytest.mark.parametrize(
    ("route", "parameter"),
    BOUNDED,
    ids=[f"{route}-{parameter.name}" for route, parameter in BOUNDED],
)
def test_a_value_past_a_documented_bound_is_a_400_naming_the_parameter(
    served: str, spec: dict[str, Any], route: Route, parameter: Parameter
) -> None:
    value = outside(documented(spec, route, parameter.name))
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    response = httpx.post(f"{served}{path}", json={**REST[route], parameter.name: value})
    assert response.status_code == 400, (value, response.text)
    error = response.json()["error"]
    assert error["param"] == parameter.name and f"'{parameter.name}'" in error["message"]


def test_vi_generation_config_is_described_by_the_rows_it_maps_onto(
    served: str, spec: dict[str, Any]
) -> None:
    config = spec["components"]["schemas"]["ViChatRequest"]["properties"]["generation_config"]
    for hugging_face, openai in HF_TO_OPENAI.items():
        assert config["properties"][hugging_face] == documented(spec, "chat", openai)
    # A Hugging Face name past its documented bound is refused under the OpenAI name.
    body = {"user_prompt": "hi", "generation_config": {"num_return_sequences": 0}}
    response = httpx.post(f"{served}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limits_keep_their_refusals_and_the_cap(tmp_path: Path, field: str) -> None:
    app = create_app(settings_for(tmp_path, max_tokens_cap=50), backend=RecordingBackend())
    chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    with serving(app) as url:
        for value in (0, 1.5, "8", True):
            response = httpx.post(f"{url}/v1/chat/completions", json={**chat, field: value})
            error = response.json()["error"]
            assert (response.status_code, error["code"]) == (400, "invalid_value"), value
            assert error["message"] == f"'{field}' must be a positive integer"
        over = httpx.post(f"{url}/v1/chat/completions", json={**chat, field: 51})
        assert over.json()["error"]["code"] == "max_tokens_too_large"
        assert httpx.post(f"{url}/v1/chat/completions", json={**chat, field: 50}).status_code == 200
