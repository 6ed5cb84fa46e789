"""What only some backends do, the routes ask with ``isinstance`` against a protocol of
``gateway.backends.base`` (never ``getattr`` by name: ``test_import_graph.py``). These pin
that each backend has the methods its protocols name, so that a method renamed on either side
fails here rather than switching a feature off without a word."""

from __future__ import annotations

import pytest

from loragate.gateway.backends.base import (
    KnowsContextLength,
    ListsModels,
    RelaysEngineCalls,
    ReportsStart,
    ResolvesModels,
    RunsEngine,
    ServesPresets,
)
from loragate.gateway.backends.catalog import CatalogBackend
from loragate.gateway.backends.custom_adapter import ViBackendAdapter
from loragate.gateway.backends.supervised import SupervisedEngineBackend
from loragate.gateway.backends.upstream import UpstreamBackend

DOES: dict[type, set[type]] = {
    SupervisedEngineBackend: {
        RunsEngine,
        ReportsStart,
        KnowsContextLength,
        ServesPresets,
        RelaysEngineCalls,
    },
    CatalogBackend: {RunsEngine, ListsModels, ResolvesModels, ServesPresets, RelaysEngineCalls},
    UpstreamBackend: {KnowsContextLength, RelaysEngineCalls},
    ViBackendAdapter: {ListsModels},
}


@pytest.mark.parametrize("backend", DOES, ids=lambda backend: backend.__name__)
def test_each_backend_has_the_methods_its_interfaces_name(backend: type) -> None:
    assert {p.__name__ for p in DOES[backend] if not issubclass(backend, p)} == set()
