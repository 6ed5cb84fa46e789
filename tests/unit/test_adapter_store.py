"""The content-addressed store: one version per content, read-only files, tampering caught."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from loragate.adapters.store import (
    AdapterStore,
    StoredAdapter,
    StoreError,
    TamperedAdapterError,
)


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


# ----- damaged metadata ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b'{"files": {',
        b"\xff\xfe garbage",
        b"[]",
        b'{"size": 3}',
        b'{"files": {"adapter_config.json": 5}, "size": 3}',
        b'{"files": {}, "size": "3"}',
        b'{"files": {}, "size": true}',
        b'{"files": {}, "size": -1}',
        b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=[
        "empty",
        "truncated",
        "not-utf8",
        "not-an-object",
        "no-digests",
        "digest-not-a-string",
        "size-a-string",
        "size-a-bool",
        "size-negative",
        "nested-too-deeply",
    ],
)
def test_a_damaged_metadata_file_is_a_damaged_version_not_a_crash(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = AdapterStore(tmp_path / "store")
    source = adapter_dir(tmp_path / "a", b"weights")
    broken = store.put_dir(source)
    good = store.put_dir(adapter_dir(tmp_path / "b", b"other weights"))
    (broken.path / ".loragate.json").write_bytes(damage)

    # What /metrics, the watcher, eviction and boot ask: none of them raises.
    assert store.get(broken.digest) is None
    assert "is damaged" in caplog.text and broken.digest[:12] in caplog.text
    assert [s.digest for s in store.all()] == [good.digest]
    assert store.total_bytes() == good.size
    assert store.damaged() == [broken.digest]

    # Storing the same content again (what boot and the store watch do) repairs it in place.
    repaired = store.put_dir(source, {"source": "again"})
    assert repaired.digest == broken.digest and repaired.meta["source"] == "again"
    store.verify(repaired)
    assert store.damaged() == [] and list(store.tmp.iterdir()) == []


def test_eviction_drops_damaged_versions_nothing_needs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = AdapterStore(tmp_path / "store")  # no size cap: damaged versions go all the same
    needed = store.put_dir(adapter_dir(tmp_path / "a", b"needed"))
    unneeded = store.put_dir(adapter_dir(tmp_path / "b", b"unneeded"))
    for stored in (needed, unneeded):
        (stored.path / ".loragate.json").write_text("")
    assert store.evict(keep=[needed.digest]) == []
    assert not unneeded.path.exists() and needed.path.exists()
    assert "dropping damaged version " + unneeded.digest[:12] in caplog.text


def test_metadata_is_written_atomically_and_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path / "store")
    stored = store.put_dir(adapter_dir(tmp_path / "a", b"weights"))
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.touch(stored)
    # The new content was synced under a temporary name, then renamed over the old file.
    assert any(".loragate.json." in path for path in synced), synced
    assert str(stored.path) in synced  # and the rename itself
    assert [p.name for p in stored.path.iterdir() if p.name.endswith(".tmp")] == []
    assert store.get(stored.digest) is not None
    # A version removed meanwhile (evicted) is not an error for whoever used it.
    store.remove(stored.digest)
    store.touch(stored)


# ----- wrongly typed metadata values ---------------------------------------------------------


def _rewrite_meta(stored: StoredAdapter, **values: object) -> None:
    meta_path = stored.path / ".loragate.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), **values}))


@pytest.mark.parametrize("last_used", ["x", None, [1], True, "1e999"], ids=repr)
def test_a_wrongly_typed_last_used_is_taken_as_never_used(
    tmp_path: Path, last_used: object
) -> None:
    store = AdapterStore(tmp_path / "store")
    odd, used, live = (
        store.put_dir(adapter_dir(tmp_path / name, b"x" * 10, revision=name))
        for name in ("odd", "used", "live")
    )
    _rewrite_meta(odd, last_used=last_used)
    store.touch(used)
    store.max_bytes = used.size + live.size
    assert store.evict(keep=[live.digest]) == [odd.digest]  # no crash; it goes first
    assert {s.digest for s in store.all()} == {used.digest, live.digest}


def test_a_wrongly_typed_provenance_is_read_as_none(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    stored = store.put_dir(adapter_dir(tmp_path / "a", b"weights"), {"source": "/srv/a"})
    assert stored.provenance is not None and stored.provenance.source == "/srv/a"
    for values in ({"source": 12345}, {"source": "/srv/a", "revision": ["main"]}):
        _rewrite_meta(stored, **values)
        again = store.get(stored.digest)
        assert again is not None and again.provenance is None
