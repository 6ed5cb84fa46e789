"""One adapter never takes the others down: a damaged manifest entry, an adapter whose load
raises something unexpected, a boot adapter that cannot be prepared, and a manifest that cannot
be saved each cost that adapter alone, are reported, and leave nothing half-applied.

The manager runs as the gateway runs it (real store, real manifest file), with the engine's
LoRA API answered by a double that remembers what it holds."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loragate.adapters.errors import AdapterError
from loragate.adapters.intake.pipeline import PreparedVersion
from loragate.adapters.manager import AdapterManager
from loragate.adapters.manifest import Manifest
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore, StoredAdapter
from tests.engine_doubles import QuietEngine, ServingSupervisor
from tests.unit.test_manager_event_loop import adapter_source


class Adapters:
    """A store holding versions v1..v3, a manifest file, and a manager made from them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.store = AdapterStore(tmp_path / "store")
        self.versions: dict[str, StoredAdapter] = {
            tag: self.store.put_dir(adapter_source(tmp_path / tag, 1024, tag))
            for tag in ("v1", "v2", "v3")
        }
        self.manifest_path = tmp_path / "manifests" / "base.json"
        self.failing: dict[str, Exception] = {}
        self.engine = QuietEngine()

    def record(self, name: str, tag: str) -> dict[str, object]:
        return {"name": name, "active": self.versions[tag].digest, "source": tag}

    def write_manifest(self, adapters: dict[str, object]) -> None:
        self.manifest_path.parent.mkdir(parents=True, exist_ok=True)
        self.manifest_path.write_text(json.dumps({"version": 1, "adapters": adapters}))

    async def prepare(self, source: str, revision: str | None) -> PreparedVersion:
        if source in self.failing:
            raise self.failing[source]
        return PreparedVersion(self.versions[source], Provenance(source, revision))

    def manager(self) -> AdapterManager:
        """A manager as a gateway start makes it: the manifest read from its file."""
        return AdapterManager(
            store=self.store,
            manifest=Manifest(self.manifest_path).load(),
            engine=self.engine,  # type: ignore[arg-type]
            supervisor=ServingSupervisor(),  # type: ignore[arg-type]
            base_name="base",
            base_config={},
            prepare=self.prepare,
            zero_adapter_root=None,
        )

    def eid(self, name: str, tag: str) -> str:
        return f"{name}@{self.versions[tag].digest[:12]}"


@pytest.fixture
async def adapters(tmp_path: Path) -> AsyncIterator[Adapters]:
    yield Adapters(tmp_path)


def on_disk(adapters: Adapters) -> dict[str, object]:
    return json.loads(adapters.manifest_path.read_text())["adapters"]


async def test_a_wrongly_typed_entry_boots_serves_the_others_and_is_reported(
    adapters: Adapters,
) -> None:
    bad = {**adapters.record("owl", "v2"), "active": 12345}
    adapters.write_manifest(
        {"fox": adapters.record("fox", "v1"), "owl": bad, "yak": adapters.record("yak", "v3")}
    )
    manager = adapters.manager()
    # The engine boots with the good ones, and the ready hook routes them.
    assert set(manager.boot_modules()) == {adapters.eid("fox", "v1"), adapters.eid("yak", "v3")}
    await manager.on_engine_ready()
    assert manager.routes.get("fox") == adapters.eid("fox", "v1")
    assert manager.routes.get("yak") == adapters.eid("yak", "v3")
    assert manager.routes.get("owl") is None
    # Reported where the manager reports every adapter's failure: the admin list (one entry,
    # state failed, saying which file and what to do) and /health's reason.
    listed = {item["name"]: item for item in manager.list()}
    assert listed["fox"]["state"] == listed["yak"]["state"] == "ready"
    assert listed["owl"]["state"] == "failed"
    assert "'active' must be" in listed["owl"]["error"]
    assert str(adapters.manifest_path) in manager.failures["owl"]
    assert not manager.all_loaded
    json.dumps(manager.list())  # the admin API's answer serializes (it was a 500)

    # DELETE clears it (from the file too); the others are untouched.
    await manager.remove("owl")
    assert "owl" not in on_disk(adapters) and set(on_disk(adapters)) == {"fox", "yak"}
    assert manager.all_loaded and [item["name"] for item in manager.list()] == ["fox", "yak"]
    await manager.aclose()


async def test_putting_a_damaged_entry_again_replaces_it(adapters: Adapters) -> None:
    adapters.write_manifest({"owl": {**adapters.record("owl", "v2"), "follow": "sometimes"}})
    manager = adapters.manager()
    await manager.on_engine_ready()
    assert manager.describe("owl")["state"] == "failed"
    await manager.put("owl", "v2")
    assert manager.describe("owl")["state"] == "ready" and manager.all_loaded
    assert on_disk(adapters)["owl"]["follow"] is False  # type: ignore[index]
    assert Manifest(adapters.manifest_path).load().unreadable == {}
    await manager.aclose()


class FlakyEngine(QuietEngine):
    """An engine whose load of one id raises what no one expected."""

    def __init__(self, breaks: str) -> None:
        super().__init__()
        self.breaks = breaks

    async def load_adapter(self, engine_id: str, path: Path) -> None:
        if engine_id == self.breaks:
            raise RuntimeError("the engine's LoRA API answered something new")
        await super().load_adapter(engine_id, path)


async def test_an_unexpected_error_re_applying_one_adapter_does_not_stop_the_others(
    adapters: Adapters,
) -> None:
    adapters.write_manifest(
        {name: adapters.record(name, tag) for name, tag in [("ant", "v1"), ("bee", "v2")]}
    )
    adapters.engine = FlakyEngine(breaks=adapters.eid("ant", "v1"))
    manager = adapters.manager()
    await manager.on_engine_ready()  # the engine's ready hook: raising here fails the engine
    assert manager.routes.get("bee") == adapters.eid("bee", "v2")
    assert "RuntimeError" in manager.failures["ant"]
    assert manager.describe("ant")["state"] == "failed"
    await manager.aclose()


async def test_a_boot_adapter_that_cannot_be_prepared_does_not_stop_the_others(
    adapters: Adapters,
) -> None:
    adapters.failing["v1"] = FileNotFoundError(errno.ENOENT, "No such file", "/srv/ant")
    adapters.failing["v2"] = AdapterError("adapter_config.json: rank 64 is above 16")
    manager = adapters.manager()
    await manager.declare_all([("ant", "v1"), ("bee", "v2"), ("cat", "v3")])
    assert set(manager.manifest.entries) == {"cat"}
    assert "FileNotFoundError" in manager.failures["ant"]
    assert "rank 64" in manager.failures["bee"]
    assert set(manager.boot_modules()) == {adapters.eid("cat", "v3")}
    await manager.aclose()


@pytest.fixture
def full_disk(adapters: Adapters, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """While its one value is True, renaming anything onto the manifest fails: disk full."""
    failing = [False]
    real_replace = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if failing[0] and Path(dst) == adapters.manifest_path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return failing


async def test_a_swap_whose_manifest_cannot_be_saved_changes_nothing(
    adapters: Adapters, full_disk: list[bool]
) -> None:
    manager = adapters.manager()
    await manager.put("fox", "v1")
    before = adapters.manifest_path.read_bytes()
    full_disk[0] = True
    with pytest.raises(AdapterError, match="no space left on device") as failed:
        await manager.put("fox", "v2")
    assert failed.value.status == 507
    # The route, the file, the entry and the engine are as before the swap.
    assert manager.routes.get("fox") == adapters.eid("fox", "v1")
    assert adapters.manifest_path.read_bytes() == before
    assert manager.manifest.entries["fox"].active == adapters.versions["v1"].digest
    assert set(adapters.engine.loaded) == {adapters.eid("fox", "v1")}
    assert adapters.eid("fox", "v2") not in manager.engine_versions.loaded

    with pytest.raises(AdapterError, match="no space left on device"):
        await manager.put("owl", "v3")  # a new name: not routed, not loaded, not listed
    assert manager.routes.get("owl") is None and "owl" not in manager.manifest.entries
    assert set(adapters.engine.loaded) == {adapters.eid("fox", "v1")}

    with pytest.raises(AdapterError, match="no space left on device"):
        await manager.remove("fox")  # still served, still in the file
    assert manager.routes.get("fox") == adapters.eid("fox", "v1") and "fox" in on_disk(adapters)

    full_disk[0] = False
    await manager.put("fox", "v2")  # space again: the swap goes through
    assert manager.routes.get("fox") == adapters.eid("fox", "v2")
    await manager.aclose()
