"""The content-addressed store: one version per content, read-only files, tampering caught."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from loragate.adapters.store import AdapterStore, StoreError, TamperedAdapterError


def adapter_dir(path: Path, weights: bytes, **config: object) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, **config}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    (path / "README.md").write_text("ignored")
    return path


def test_the_same_content_is_one_version_whatever_it_is_called(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    first = store.put_dir(adapter_dir(tmp_path / "a", b"weights"))
    again = store.put_dir(adapter_dir(tmp_path / "b", b"weights"))
    other = store.put_dir(adapter_dir(tmp_path / "c", b"weights", revision="c"))
    assert first.digest == again.digest != other.digest
    assert sorted(p.name for p in first.path.iterdir()) == [
        ".loragate.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert len(store.all()) == 2


def test_stored_files_are_read_only(tmp_path: Path) -> None:
    stored = AdapterStore(tmp_path / "store").put_dir(adapter_dir(tmp_path / "a", b"weights"))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        mode = (stored.path / name).stat().st_mode
        assert not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), oct(mode)


def test_a_modified_file_fails_verification_and_storing_the_content_again_repairs_it(
    tmp_path: Path,
) -> None:
    store = AdapterStore(tmp_path / "store")
    source = adapter_dir(tmp_path / "a", b"weights")
    stored = store.put_dir(source)
    weights = stored.path / "adapter_model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"weightz")
    with pytest.raises(TamperedAdapterError, match="sha256"):
        store.verify(stored)
    repaired = store.put_dir(source)
    assert repaired.digest == stored.digest
    store.verify(repaired)
    assert weights.read_bytes() == b"weights"


def test_a_missing_file_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    source = adapter_dir(tmp_path / "a", b"weights")
    (source / "adapter_model.safetensors").unlink()
    with pytest.raises(StoreError, match=r"missing adapter_model\.safetensors"):
        store.put_dir(source)
    assert store.all() == [] and list(store.tmp.iterdir()) == []


def test_eviction_drops_the_least_recently_used_unprotected_versions(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    old, live, recent = (
        store.put_dir(adapter_dir(tmp_path / name, b"x" * 10, revision=name))
        for name in ("old", "live", "recent")
    )
    store.touch(recent)
    store.max_bytes = live.size + recent.size
    assert store.evict(keep=[live.digest]) == [old.digest]
    assert {s.digest for s in store.all()} == {live.digest, recent.digest}
    assert store.evictions == 1
