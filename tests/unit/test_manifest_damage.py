"""A damaged adapter manifest never stops a boot: it is set aside (kept) and logged; a damaged
entry is skipped (kept in the file) and the others load."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from loragate.adapters.manifest import Manifest, ManifestEntry

GOOD = {"name": "fox", "active": "a" * 64, "source": "/adapters/fox"}


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b'{"adapters": [1, 2]}', b"[]", b'{"adapters": {"fox": ', b"\xff\xfe garbage"],
    ids=["empty", "truncated", "adapters-not-object", "array", "cut-mid-entry", "binary"],
)
def test_a_garbled_manifest_is_set_aside_and_the_gateway_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="loragate.adapters"):
        manifest = Manifest(path).load()
    assert manifest.entries == {}
    aside = list(tmp_path.glob("manifest.json.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content  # nothing the user had is lost
    assert not path.exists()
    assert "is damaged" in caplog.text and aside[0].name in caplog.text
    # The next save writes a good manifest in its place.
    manifest.entries["fox"] = ManifestEntry.from_record(GOOD)
    manifest.save()
    assert Manifest(path).load().entries["fox"].active == GOOD["active"]


def test_a_damaged_entry_is_skipped_and_the_others_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "manifest.json"
    bad = {"name": "owl", "source": "/adapters/owl", "colour": "brown"}  # no 'active', unknown key
    path.write_text(json.dumps({"version": 1, "adapters": {"fox": GOOD, "owl": bad}}))
    with caplog.at_level(logging.ERROR, logger="loragate.adapters"):
        manifest = Manifest(path).load()
    assert list(manifest.entries) == ["fox"]
    assert "skipping entry 'owl'" in caplog.text
    assert path.exists()  # the file itself is fine: it is not set aside


def _write(path: Path, adapters: dict[str, object]) -> None:
    path.write_text(json.dumps({"version": 1, "adapters": adapters}))


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({**GOOD, "name": "owl", "active": 12345}, "'active' must be a version's sha256"),
        ({**GOOD, "name": "owl", "active": "not-a-digest"}, "'active' must be"),
        ({**GOOD, "name": "owl", "previous": 7}, "'previous' must be"),
        ({**GOOD, "name": "owl", "follow": "yes"}, "'follow' must be true or false"),
        ({**GOOD, "name": "owl", "loaded_at": "x"}, "'loaded_at' must be a time"),
        ({**GOOD, "name": "owl", "source": ["/adapters/owl"]}, "'source' must be"),
        ({**GOOD, "name": "owl", "revision": {"sha": 1}}, "'revision' must be"),
        ({**GOOD, "name": "owl", "extra": []}, "'extra' must be an object"),
        ({**GOOD, "name": "fox"}, "filed under 'owl' but names 'fox'"),
        ({**GOOD, "name": "../owl"}, "invalid adapter name"),
        ("owl", "not an object"),
    ],
    ids=[
        "active-int",
        "active-not-hex",
        "previous-int",
        "follow-str",
        "loaded-at-str",
        "source-list",
        "revision-object",
        "extra-list",
        "name-mismatch",
        "name-unsafe",
        "not-an-object",
    ],
)
def test_a_wrongly_typed_entry_is_skipped_kept_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: object, says: str
) -> None:
    path = tmp_path / "manifest.json"
    _write(path, {"fox": GOOD, "owl": bad})
    with caplog.at_level(logging.ERROR, logger="loragate.adapters"):
        manifest = Manifest(path).load()
    assert list(manifest.entries) == ["fox"]
    why, _ = manifest.unreadable["owl"]
    assert says in why
    assert str(path) in caplog.text and "'owl'" in caplog.text and says in caplog.text
    # Saving keeps the bad entry as found (a hand repair stays possible), and the good one.
    manifest.save()
    assert json.loads(path.read_text())["adapters"]["owl"] == bad
    assert list(Manifest(path).load().entries) == ["fox"]


def test_a_deeply_nested_manifest_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(b'{"adapters": {"fox": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}")
    assert Manifest(path).load().entries == {}
    assert len(list(tmp_path.glob("manifest.json.damaged-*"))) == 1


def test_a_save_syncs_the_directory_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "manifests" / "base.json"
    manifest = Manifest(path)
    manifest.entries["fox"] = ManifestEntry.from_record(GOOD)
    path.parent.mkdir()
    directory = path.parent.stat()
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(
            "fsync-dir"
            if (st.st_dev, st.st_ino) == (directory.st_dev, directory.st_ino)
            else "fsync"
        )
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    manifest.save()
    assert events == ["fsync", "replace", "fsync-dir"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # sources may carry credentials
    assert [p.name for p in path.parent.iterdir()] == ["base.json"]  # no temp file left
