"""The runtime adapter manifest is state, kept apart from the cache: in ``state_dir`` (systemd's
``$STATE_DIRECTORY`` by default), while the content-addressed store stays in the cache dir. A
manifest an older loragate left in the cache dir is moved over, so no runtime adapter is lost.

Real files throughout, and the adapter manager built as ``gateway serve`` builds it.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.manager import AdapterManager
from loragate.adapters.manifest import Manifest, ManifestEntry
from loragate.adapters.wiring import adapter_manager_for, manifest_path_for
from loragate.paths import default_cache_dir
from loragate.settings import Settings
from loragate.supervisor.client import EngineClient
from loragate.supervisor.engine import EngineSupervisor

FOX = {"name": "fox", "active": "a" * 64, "source": "/adapters/fox"}


def manager_for(settings: Settings, model_dir: Path) -> AdapterManager:
    """The manager `gateway serve` builds for ``model_dir`` (its engine never started)."""

    def no_engine(*_: Any) -> Any:
        raise AssertionError("the test starts no engine")

    cache_dir = settings.cache_dir
    supervisor = EngineSupervisor(no_engine, cache_dir=cache_dir)
    return adapter_manager_for(
        settings,
        cache_dir,
        model_dir,
        {},
        engine=EngineClient(supervisor),
        supervisor=supervisor,
        base_name="base",
        zero_adapter=False,
    )


def write_manifest(path: Path) -> None:
    manifest = Manifest(path)
    manifest.entries["fox"] = ManifestEntry.from_record(FOX)
    manifest.save()


@pytest.fixture
def no_systemd_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)


def test_state_dir_defaults_to_systemds_state_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/state:{tmp_path}/other")
    assert Settings(cache_dir=tmp_path / "cache").state_dir == tmp_path / "state"
    monkeypatch.delenv("STATE_DIRECTORY")
    assert Settings(cache_dir=tmp_path / "cache").state_dir is None


def test_the_cache_dir_defaults_to_systemds_cache_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    assert Settings().cache_dir == tmp_path / "cache"
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "loragate"


def test_state_dir_is_a_serve_option_and_an_env_var(
    no_systemd_dirs: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAGATE_STATE_DIR", str(tmp_path / "from-env"))
    assert Settings().state_dir == tmp_path / "from-env"


def test_the_manifest_lands_in_the_state_dir_and_the_store_stays_in_the_cache(
    no_systemd_dirs: None, tmp_path: Path
) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", state_dir=tmp_path / "state")
    manager = manager_for(settings, tmp_path / "model")
    manager.manifest.entries["fox"] = ManifestEntry.from_record(FOX)
    manager.manifest.save()

    (saved,) = (tmp_path / "state").rglob("*.json")
    assert saved == manager.manifest.path
    assert saved.is_relative_to(tmp_path / "state" / "adapters" / "manifests")
    assert json.loads(saved.read_text())["adapters"]["fox"]["active"] == "a" * 64
    assert not list((tmp_path / "cache").rglob("manifests/*.json"))
    assert manager.store.root.is_relative_to(tmp_path / "cache")


def test_without_a_state_dir_the_manifest_stays_where_it_always_was(
    no_systemd_dirs: None, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    path = manifest_path_for(None, cache, tmp_path / "model")
    assert path.parent == cache / "adapters" / "manifests"


def test_a_manifest_left_in_the_cache_dir_is_moved_to_the_state_dir_and_loaded(
    no_systemd_dirs: None, tmp_path: Path
) -> None:
    cache, state, model = tmp_path / "cache", tmp_path / "state", tmp_path / "model"
    old = manifest_path_for(None, cache, model)
    write_manifest(old)

    settings = Settings(cache_dir=cache, state_dir=state)
    manager = manager_for(settings, model)

    assert list(manager.manifest.entries) == ["fox"]
    new = manager.manifest.path
    assert new.is_relative_to(state)
    assert not old.exists(), "the old manifest is moved, not copied: one place holds the state"
    assert stat.S_IMODE(new.stat().st_mode) == 0o600  # sources may carry credentials


def test_a_manifest_already_in_the_state_dir_wins_over_one_in_the_cache_dir(
    no_systemd_dirs: None, tmp_path: Path
) -> None:
    cache, state, model = tmp_path / "cache", tmp_path / "state", tmp_path / "model"
    new = manifest_path_for(state, cache, model)
    new.parent.mkdir(parents=True)
    new.write_text(json.dumps({"version": 1, "adapters": {}}))
    old = manifest_path_for(None, cache, model)
    write_manifest(old)

    assert manifest_path_for(state, cache, model) == new
    assert Manifest(new).load().entries == {}
    assert old.exists(), "an older manifest is left alone, never merged or deleted"
