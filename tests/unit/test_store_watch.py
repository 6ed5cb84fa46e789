"""The watchers of ``adapters.watch``: the store watch (a live version modified on disk is
stored again from its source), and the follower. The loop both run on: test_periodic.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from loragate.adapters.manager import AdapterError
from loragate.adapters.manifest import Manifest, ManifestEntry
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore
from loragate.adapters.watch import AdapterFollower, StoreWatch


class FakeManager:
    """What the watch asks of the manager (``RepairedAdapters``); ``put`` stores the source dir
    again."""

    def __init__(self, root: Path, source_gone: bool = False) -> None:
        self.store = AdapterStore(root / "store")
        self.manifest = Manifest(root / "manifest.json")
        self.failures: dict[str, str] = {}
        self.repairs = 0
        self.puts: list[str] = []
        self.source_gone = source_gone

    def adapter_entries(self) -> Mapping[str, ManifestEntry]:
        return self.manifest.entries

    def note_store_repair(self) -> None:
        self.repairs += 1

    def mark_failed(self, name: str, reason: str) -> None:
        self.failures[name] = reason

    async def put(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        *,
        digest: str | None = None,
        preset: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.puts.append(name)
        if self.source_gone:
            raise AdapterError(f"{source} does not exist")
        stored = self.store.put_dir(Path(source))
        if digest is not None and not stored.digest.startswith(digest):
            raise AdapterError("another version", status=409, code="digest_mismatch")
        self.failures.pop(name, None)
        return {}


def live_adapter(manager: FakeManager, tmp_path: Path, name: str) -> Path:
    source = tmp_path / f"src-{name}"
    source.mkdir()
    (source / "adapter_config.json").write_text(json.dumps({"r": 8, "name": name}))
    (source / "adapter_model.safetensors").write_bytes(b"weights of " + name.encode())
    stored = manager.store.put_dir(source)
    manager.manifest.entries[name] = ManifestEntry(
        name=name, active=stored.digest, provenance=Provenance(str(source))
    )
    return stored.path / "adapter_model.safetensors"


def tamper(path: Path) -> None:
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1] + b"!")


async def test_untouched_versions_pass_and_a_modified_one_is_stored_again(tmp_path: Path) -> None:
    manager = FakeManager(tmp_path)
    weights = live_adapter(manager, tmp_path, "pong")
    live_adapter(manager, tmp_path, "fox")
    watch = StoreWatch(manager, manager.store, interval=1)
    assert await watch.check() == {}
    assert await watch.check() == {} and manager.puts == []

    tamper(weights)
    damaged = await watch.check()
    assert list(damaged) == ["pong"] and "sha256" in damaged["pong"]
    assert manager.puts == ["pong"] and manager.repairs == 1
    assert weights.read_bytes() == b"weights of pong"  # the same content, back in its place
    assert await watch.check() == {} and manager.failures == {}


async def test_a_version_that_cannot_be_restored_is_marked_failed_once(tmp_path: Path) -> None:
    manager = FakeManager(tmp_path, source_gone=True)
    weights = live_adapter(manager, tmp_path, "owl")
    watch = StoreWatch(manager, manager.store, interval=1)
    tamper(weights)
    assert list(await watch.check()) == ["owl"]
    assert "could not be stored again" in manager.failures["owl"]
    assert "PUT a good copy or roll back" in manager.failures["owl"]
    assert await watch.check() == {} and manager.puts == ["owl"]  # not retried while unchanged


async def test_missing_files_count_as_damage(tmp_path: Path) -> None:
    manager = FakeManager(tmp_path)
    weights = live_adapter(manager, tmp_path, "pong")
    weights.unlink()
    watch = StoreWatch(manager, manager.store, interval=1)
    assert "missing" in (await watch.check())["pong"]
    assert weights.read_bytes() == b"weights of pong"


async def test_a_version_with_garbled_metadata_is_stored_again_from_its_source(
    tmp_path: Path,
) -> None:
    manager = FakeManager(tmp_path)
    weights = live_adapter(manager, tmp_path, "pong")
    (weights.parent / ".loragate.json").write_text('{"files": ')
    watch = StoreWatch(manager, manager.store, interval=1)
    damaged = await watch.check()
    assert list(damaged) == ["pong"] and "damaged" in damaged["pong"]
    assert manager.puts == ["pong"]
    assert manager.store.get(manager.manifest.entries["pong"].active) is not None
    assert await watch.check() == {}


# ----- with the real manager and pipeline: a repair restores the same version or nothing ----


async def _served_from_a_directory(tmp_path: Path) -> tuple[Any, Path, Path]:
    """A real manager serving ``fox`` from a source directory; (manager, source, weights)."""
    from loragate.adapters.intake.pipeline import AdapterPipeline
    from tests.unit.test_provenance import TINY_LLAMA, make_manager, tiny_adapter

    store = AdapterStore(tmp_path / "store")
    manager = make_manager(
        tmp_path, store, AdapterPipeline(store, tmp_path / "base", TINY_LLAMA, 16)
    )
    source = tiny_adapter(tmp_path / "fox-source", rank=4)
    await manager.put("fox", str(source))
    stored = store.get(manager.manifest.entries["fox"].active)
    assert stored is not None
    return manager, source, stored.path / "adapter_model.safetensors"


async def test_a_damaged_version_whose_source_changed_is_not_swapped(tmp_path: Path) -> None:
    from tests.unit.test_provenance import tiny_adapter

    manager, source, weights = await _served_from_a_directory(tmp_path)
    served = manager.manifest.entries["fox"].active
    shutil.rmtree(source)
    tiny_adapter(source, rank=8)  # the source now holds other weights
    tamper(weights)

    damaged = await StoreWatch(manager, manager.store, interval=1).check()
    assert list(damaged) == ["fox"] and "sha256" in damaged["fox"]
    assert manager.manifest.entries["fox"].active == served  # not the source's new weights
    assert manager.routes.get("fox") == f"fox@{served[:12]}"
    described = manager.describe("fox")
    assert described["state"] == "failed" and described["version"] == served
    assert "the source no longer holds this version" in described["error"]
    assert "PUT a good copy or roll back" in described["error"]
    await manager.aclose()


async def test_a_damaged_version_whose_source_is_unchanged_is_repaired(tmp_path: Path) -> None:
    manager, _source, weights = await _served_from_a_directory(tmp_path)
    served = manager.manifest.entries["fox"].active
    good = weights.read_bytes()
    tamper(weights)

    damaged = await StoreWatch(manager, manager.store, interval=1).check()
    assert list(damaged) == ["fox"]
    assert weights.read_bytes() == good and manager.counters["store_repairs"] == 1
    assert manager.manifest.entries["fox"].active == served
    assert manager.describe("fox")["state"] == "ready" and manager.failures == {}
    await manager.aclose()


# ----- follow mode: a moved source goes through ``put``; a refused version is skipped once -----


class Followed:
    """What the follower asks of the manager (``ServedAdapters``): entries and ``put``; and
    each source's change marker, as the fingerprint function reads it."""

    def __init__(self) -> None:
        self.entries: dict[str, ManifestEntry] = {}
        self.markers: dict[str, str] = {}
        self.puts: list[str] = []
        self.refuse = False

    def adapter_entries(self) -> Mapping[str, ManifestEntry]:
        return self.entries

    async def put(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        *,
        digest: str | None = None,
        preset: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.puts.append(name)
        if self.refuse:
            raise AdapterError("adapter_config.json: rank 64 is above --max-lora-rank 16")
        old = self.entries[name]
        marker = self.markers[source]
        self.entries[name] = replace(old, provenance=Provenance(source, revision, marker))
        return {}


async def test_the_follower_swaps_a_moved_source_and_skips_a_refused_version_once() -> None:
    adapters = Followed()
    adapters.markers["hub:fox"] = "commit-1"
    adapters.entries["fox"] = ManifestEntry(
        name="fox", active="a" * 64, provenance=Provenance("hub:fox", None, "commit-1"), follow=True
    )
    follower = AdapterFollower(adapters, 3600, fingerprint=lambda src, _: adapters.markers[src])
    assert not await follower.check("fox") and adapters.puts == []  # unchanged: nothing fetched

    adapters.markers["hub:fox"] = "commit-2"
    adapters.refuse = True
    assert not await follower.check("fox") and adapters.puts == ["fox"]
    assert "rank 64" in (follower.error("fox") or "")
    assert not await follower.check("fox") and adapters.puts == ["fox"]  # not retried

    adapters.markers["hub:fox"] = "commit-3"
    adapters.refuse = False
    assert await follower.check("fox") and adapters.puts == ["fox", "fox"]
    assert follower.error("fox") is None


async def test_the_follower_polls_exactly_the_adapters_marked_follow() -> None:
    adapters = Followed()
    for name, follow in (("fox", True), ("owl", False)):
        adapters.entries[name] = ManifestEntry(
            name=name, active="a" * 64, provenance=Provenance(name), follow=follow
        )
    follower = AdapterFollower(adapters, 3600, fingerprint=lambda _source, _rev: None)
    follower.sync()
    polling = {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("follow-")}
    assert polling == {"follow-fox"}
    adapters.entries["fox"] = replace(adapters.entries["fox"], follow=False)
    follower.sync()
    await asyncio.sleep(0)
    polling = {
        t.get_name()
        for t in asyncio.all_tasks()
        if t.get_name().startswith("follow-") and not t.done()
    }
    assert polling == set()
    await follower.aclose()
