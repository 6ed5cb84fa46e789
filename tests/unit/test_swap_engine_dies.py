"""A swap whose engine dies under it: a clear 503 and nothing changed (the soak found a 500)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loragate.adapters.errors import AdapterError
from loragate.adapters.store import AdapterStore
from loragate.supervisor.engine import EngineUnavailable
from tests.unit.test_manager_event_loop import adapter_source, make_manager


async def test_a_swap_whose_engine_dies_is_a_503_and_the_old_version_still_serves(
    tmp_path: Path,
) -> None:
    store = AdapterStore(tmp_path / "store")
    first = store.put_dir(adapter_source(tmp_path / "first", 1024, "first"))
    second = store.put_dir(adapter_source(tmp_path / "second", 1024, "second"))
    manager, engine = make_manager(tmp_path, store, {"first": first, "second": second})
    await manager.put("fox", "first")
    before = (manager.manifest.snapshot(), manager.routes.get("fox"), dict(engine.loaded))

    async def dies(engine_id: str, path: Path) -> None:
        raise EngineUnavailable("the engine did not answer /v1/load_lora_adapter: ReadError('')")

    engine.load_adapter = dies  # type: ignore[method-assign]
    with pytest.raises(AdapterError) as refused:
        await manager.put("fox", "second")
    assert refused.value.status == 503
    assert refused.value.code == "engine_unavailable"
    assert "not swapped" in str(refused.value)
    assert (manager.manifest.snapshot(), manager.routes.get("fox"), dict(engine.loaded)) == before
    await manager.aclose()
