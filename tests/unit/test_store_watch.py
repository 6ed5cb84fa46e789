"""The store watch: a live version modified on disk is stored again from its source."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from loragate.adapters.manager import AdapterError
from loragate.adapters.manifest import Manifest, ManifestEntry
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore
from loragate.adapters.store_watch import StoreWatch


class FakeManager:
    """What the watch uses of AdapterManager; ``put`` stores the source dir again."""

    def __init__(self, root: Path, source_gone: bool = False) -> None:
        self.store = AdapterStore(root / "store")
        self.manifest = Manifest(root / "manifest.json")
        self.failures: dict[str, str] = {}
        self.counters: defaultdict[str, int] = defaultdict(int)
        self.puts: list[str] = []
        self.source_gone = source_gone

    async def put(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        *,
        digest: str | None = None,
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
    watch = StoreWatch(manager, interval=1)  # type: ignore[arg-type]
    assert await watch.check() == {}
    assert await watch.check() == {} and manager.puts == []

    tamper(weights)
    damaged = await watch.check()
    assert list(damaged) == ["pong"] and "sha256" in damaged["pong"]
    assert manager.puts == ["pong"] and manager.counters["store_repairs"] == 1
    assert weights.read_bytes() == b"weights of pong"  # the same content, back in its place
    assert await watch.check() == {} and manager.failures == {}


async def test_a_version_that_cannot_be_restored_is_marked_failed_once(tmp_path: Path) -> None:
    manager = FakeManager(tmp_path, source_gone=True)
    weights = live_adapter(manager, tmp_path, "owl")
    watch = StoreWatch(manager, interval=1)  # type: ignore[arg-type]
    tamper(weights)
    assert list(await watch.check()) == ["owl"]
    assert "could not be stored again" in manager.failures["owl"]
    assert "PUT a good copy or roll back" in manager.failures["owl"]
    assert await watch.check() == {} and manager.puts == ["owl"]  # not retried while unchanged


async def test_missing_files_count_as_damage(tmp_path: Path) -> None:
    manager = FakeManager(tmp_path)
    weights = live_adapter(manager, tmp_path, "pong")
    weights.unlink()
    watch = StoreWatch(manager, interval=1)  # type: ignore[arg-type]
    assert "missing" in (await watch.check())["pong"]
    assert weights.read_bytes() == b"weights of pong"


async def test_a_version_with_garbled_metadata_is_stored_again_from_its_source(
    tmp_path: Path,
) -> None:
    manager = FakeManager(tmp_path)
    weights = live_adapter(manager, tmp_path, "pong")
    (weights.parent / ".loragate.json").write_text('{"files": ')
    watch = StoreWatch(manager, interval=1)  # type: ignore[arg-type]
    damaged = await watch.check()
    assert list(damaged) == ["pong"] and "damaged" in damaged["pong"]
    assert manager.puts == ["pong"]
    assert manager.store.get(manager.manifest.entries["pong"].active) is not None
    assert await watch.check() == {}
