"""What only some backends do, the routes ask with ``isinstance`` against a protocol of
``gateway.backends.base`` (never ``getattr`` by name: ``test_import_graph.py``). These pin
that each backend has the methods its protocols name, so that a method renamed on either side
fails here rather than switching a feature off without a word."""

from __future__ import annotations

import pytest

from loragate.gateway.backends.base import (
    AdminBackend,
    CatalogAdmin,
    KnowsContextLength,
    ListsModels,
    ModelsAdmin,
    RelaysEngineCalls,
    ReportsStart,
    ResolvesModels,
    RunsEngine,
    ServesPresets,
)
from loragate.gateway.backends.custom_adapter import ViBackendAdapter
from loragate.gateway.backends.managed import ManagedBackend, ManagedCatalogBackend
from loragate.gateway.backends.upstream import UpstreamBackend

# One model and a catalog: the same interfaces (one model is a catalog of one), a catalog's
# engines also reported one by one.
MANAGED = {
    RunsEngine,
    ReportsStart,
    KnowsContextLength,
    ServesPresets,
    RelaysEngineCalls,
    ListsModels,
    ResolvesModels,
    ModelsAdmin,
    AdminBackend,
}
DOES: dict[type, set[type]] = {
    ManagedBackend: MANAGED,
    ManagedCatalogBackend: MANAGED | {CatalogAdmin},
    UpstreamBackend: {KnowsContextLength, RelaysEngineCalls},
    ViBackendAdapter: {ListsModels},
}


@pytest.mark.parametrize("backend", DOES, ids=lambda backend: backend.__name__)
def test_each_backend_has_the_methods_its_interfaces_name(backend: type) -> None:
    assert {p.__name__ for p in DOES[backend] if not issubclass(backend, p)} == set()
