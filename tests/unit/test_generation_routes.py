"""The generation routes are declared once (``loragate.gateway.generation_routes``), and every
place that treats them apart reads that table: the endpoints the gateway answers itself, the
parameter checks, the presets, the metrics' route labels and usage chunks, the OpenAPI
description and the token cap."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import get_args

import pytest
from fastapi import FastAPI

from loragate.gateway.errors import OpenAIError
from loragate.gateway.generation_routes import (
    BY_KIND,
    GENERATION_ROUTES,
    HOT_PATHS,
    GenerationRoute,
    Route,
    kind_of,
)
from loragate.gateway.observe.metrics import observed_route
from loragate.gateway.openapi_schemas import install_openapi
from loragate.gateway.requests.parameters import ROUTES
from loragate.gateway.routes.inference import HOT_ROUTES
from loragate.gateway.runtime import Gateway
from tests.backend_double import RecordingBackend, settings_for
from tests.import_graph import PACKAGE

# Code that writes a generation path itself, and why it cannot read the table.
WRITTEN_ELSEWHERE = {
    "supervisor/engine.py": "below the gateway: it probes the engine's own /v1/completions",
    "cli_chat.py": "a client of a gateway, which it reaches by URL",
}


def test_each_path_the_gateway_answers_itself_is_written_once() -> None:
    """A string constant equal to the path, f-strings' pieces included; not the docstrings and
    messages that name it in a sentence."""
    written: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in HOT_PATHS:
                written[path.relative_to(PACKAGE).as_posix()].add(node.value)
    assert written.pop("gateway/generation_routes.py") == HOT_PATHS
    assert set(written) == set(WRITTEN_ELSEWHERE)  # and each allowance is still needed


def test_the_places_that_treat_the_generation_routes_apart_agree() -> None:
    assert set(get_args(Route)) == set(BY_KIND) == set(ROUTES)
    hot = [route for route in GENERATION_ROUTES if route.hot]
    assert HOT_PATHS == {route.path for route in hot} == set(HOT_ROUTES)
    assert all(route.kind is not None for route in hot)  # the gateway checks what it answers
    assert all(observed_route(path) == path for path in HOT_PATHS)
    app = FastAPI()
    install_openapi(app, docs_page=False)
    described = app.openapi()["paths"]
    assert all("post" in described[path] for path in HOT_PATHS)


@pytest.mark.parametrize("route", BY_KIND.values(), ids=lambda route: route.path)
def test_a_preset_shapes_each_route_of_the_parameter_table(route: GenerationRoute) -> None:
    assert kind_of(route.path) == route.kind
    assert kind_of(route.path + "?stream=true") == route.kind


def test_routes_outside_the_parameter_table_get_no_preset() -> None:
    passed_through = [route.path for route in GENERATION_ROUTES if route.kind is None]
    assert passed_through and all(kind_of(path) is None for path in passed_through)
    assert kind_of("/v1/embeddings") is None


@pytest.mark.parametrize("route", GENERATION_ROUTES, ids=lambda route: route.path)
def test_the_token_cap_bounds_every_generation_route(
    tmp_path: Path, route: GenerationRoute
) -> None:
    runtime = Gateway(settings_for(tmp_path, max_tokens_cap=100), RecordingBackend())
    with pytest.raises(OpenAIError, match="above this gateway's cap"):
        runtime.cap_tokens(route.path, {route.token_limits[0]: 101})
