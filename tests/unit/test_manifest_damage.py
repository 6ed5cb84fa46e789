"""A damaged adapter manifest never stops a boot: it is set aside (kept) and logged."""

from __future__ import annotations

import json
import logging
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
