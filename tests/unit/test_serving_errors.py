"""The serving core's refusals reach clients as the OpenAI errors they got before the core had
words of its own: each kind's status, code, ``param`` and ``Retry-After``, one row each; a new
kind without a row fails here."""

from __future__ import annotations

import inspect

import pytest

from loragate.adapters.errors import AdapterError
from loragate.gateway.errors import openai_error_of
from loragate.serving import errors
from loragate.serving.errors import (
    AmbiguousBase,
    ModelNotFound,
    NotServing,
    OwnedByManifest,
    ServingError,
    UnknownAdapter,
)

# (the refusal, status, code, param, Retry-After)
ROWS: list[tuple[ServingError | AdapterError, int, str, str | None, str | None]] = [
    (ModelNotFound("owl", ["base", "fox"]), 404, "model_not_found", "model", None),
    (NotServing("preparing", "engine_starting", 10), 503, "engine_starting", None, "10"),
    (NotServing("could not prepare", "engine_failed"), 503, "engine_failed", None, None),
    (NotServing("restarting", "engine_unavailable", 3), 503, "engine_unavailable", None, "3"),
    (NotServing("busy", "adapter_slots_busy", 5), 503, "adapter_slots_busy", None, "5"),
    (NotServing("no room", "model_capacity", 10), 503, "model_capacity", None, "10"),
    (UnknownAdapter("owl"), 404, "adapter_not_found", None, None),
    (OwnedByManifest("https://host/manifest.json"), 409, "managed_by_manifest", None, None),
    (AmbiguousBase("owl", 2), 400, "ambiguous_base_model", None, None),
    (AdapterError("too large", 413, "adapter_too_large"), 413, "adapter_too_large", None, None),
]


@pytest.mark.parametrize("row", ROWS, ids=lambda row: type(row[0]).__name__)
def test_each_refusal_is_the_openai_error_clients_saw(
    row: tuple[ServingError | AdapterError, int, str, str | None, str | None],
) -> None:
    refusal, status, code, param, retry_after = row
    error = openai_error_of(refusal)
    assert (error.status, error.code, error.param) == (status, code, param)
    assert error.headers.get("Retry-After") == retry_after
    assert error.message == str(refusal)


def test_every_kind_of_refusal_has_a_row() -> None:
    kinds = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, ServingError) and cls is not ServingError
    }
    assert kinds == {type(refusal) for refusal, *_ in ROWS if isinstance(refusal, ServingError)}


def test_a_model_nobody_has_names_the_models_and_the_places_looked_at() -> None:
    missing = ModelNotFound("owl", ["base", "fox"], ["/adapters/owl", "hf://org/owl"])
    assert missing.message == (
        "The model `owl` does not exist. Valid models: base, fox "
        "Looked for it at: /adapters/owl; hf://org/owl"
    )


def test_a_new_kind_of_refusal_answers_as_its_parent() -> None:
    class Draining(NotServing):
        pass

    error = openai_error_of(Draining("draining", "engine_draining", 2))
    assert (error.status, error.headers.get("Retry-After")) == (503, "2")
