"""The fleet's adapter manifest: what it may say, and where it is fetched from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from loragate.adapters.fleet_manifest import (
    MAX_MANIFEST_BYTES,
    DesiredAdapter,
    FleetManifestError,
    fetch_fleet_manifest,
    parse_fleet_manifest,
)
from loragate.settings import Settings
from tests.readme_blocks import blocks_of

JSON = json.dumps(
    {
        "adapters": {
            "support": {"source": "hf://acme/support@v3", "follow": True},
            "legal": {"source": "/srv/legal", "revision": "r2", "digest": "0123456789ab"},
        }
    }
).encode()

YAML = b"""
adapters:
  support:
    source: hf://acme/support@v3
    follow: true
  legal:
    source: /srv/legal
    revision: r2
    digest: 0123456789ab
"""


@pytest.mark.parametrize("data", [JSON, YAML], ids=["json", "yaml"])
def test_json_and_yaml_say_the_same(data: bytes) -> None:
    manifest = parse_fleet_manifest(data)
    assert manifest.revision == hashlib.sha256(data).hexdigest()
    assert manifest.adapters == {
        "support": DesiredAdapter("hf://acme/support@v3", None, True, None),
        "legal": DesiredAdapter("/srv/legal", "r2", False, "0123456789ab"),
    }


def test_a_name_may_map_to_its_source_alone_and_the_list_may_be_empty_on_purpose() -> None:
    assert parse_fleet_manifest(b"adapters:\n  fox: /srv/fox\n").adapters == {
        "fox": DesiredAdapter("/srv/fox")
    }
    assert parse_fleet_manifest(b'{"adapters": {}, "allow_empty": true}').adapters == {}
    assert parse_fleet_manifest(b"allow_empty: true\nadapters: {}\n").adapters == {}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"adapters:\n", "truncated"),  # a file cut short after its first line
        (b"adapters: null\n", "truncated"),
        (b'{"adapters": null, "allow_empty": true}', "truncated"),
        (b'{"adapters": {}}', "names no adapters.*allow_empty"),
        (b"adapters: {}\nallow_empty: false\n", "names no adapters"),
        (b"", "it is empty"),
        (b"   \n# nothing but a comment\n", "it is empty"),
        (b"null", "it is empty"),
        (b"- fox\n- owl\n", "must be an object"),
        (b"just some words", "must be an object"),
        (b'{"adapters": {}, "allow_empty": "yes"}', "allow_empty.*true or false"),
    ],
    ids=[
        "truncated-yaml",
        "yaml-null",
        "null-even-if-allowed",
        "empty-without-allow",
        "empty-allow-false",
        "empty-file",
        "only-a-comment",
        "json-null",
        "yaml-list",
        "yaml-scalar",
        "allow-empty-not-bool",
    ],
)
def test_a_manifest_that_would_serve_nothing_by_accident_is_an_error(
    data: bytes, says: str
) -> None:
    with pytest.raises(FleetManifestError, match=says):
        parse_fleet_manifest(data)


@pytest.mark.parametrize(
    "data",
    [
        b'{"adapters": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
        b"adapters: " + b"[" * 200_000 + b"]" * 200_000,
        b"adapters:\n" + b"".join(b"  " * i + b"a:\n" for i in range(1, 700)),
    ],
    ids=["json", "yaml-flow", "yaml-block"],
)
def test_a_deeply_nested_manifest_is_a_clean_parse_error(data: bytes) -> None:
    assert len(data) < MAX_MANIFEST_BYTES  # within what a fetch lets through
    with pytest.raises(FleetManifestError, match="nested too deeply"):
        parse_fleet_manifest(data)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"[1, 2]", "must be an object with the key"),
        (b'{"adapter": {}}', "must be an object with the key"),
        (b'{"adapters": {"fox": "/x"}, "other": 1}', "must be an object with the key"),
        (b'{"adapters": ["fox"]}', "map adapter names"),
        (b'{"adapters": {"fox": {"sorce": "/x"}}}', "unknown field.*sorce"),
        (b'{"adapters": {"fox": {"revision": "v1"}}}', "needs a source"),
        (b'{"adapters": {"fox": {"source": "/x", "follow": "yes"}}}', "true or false"),
        (b'{"adapters": {"fox": {"source": "/x", "revision": 3}}}', "revision must be a string"),
        (b'{"adapters": {"fox": {"source": "/x", "digest": "XYZ"}}}', "digest must be"),
        (b'{"adapters": {"../etc": {"source": "/x"}}}', "adapters manifest"),
        (b"adapters: [unclosed", "neither JSON nor YAML"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_every_mistake_is_named(data: bytes, says: str) -> None:
    with pytest.raises(FleetManifestError, match=says):
        parse_fleet_manifest(data)


def test_a_local_file_is_read_and_a_missing_one_named(tmp_path: Path) -> None:
    path = tmp_path / "adapters.yaml"
    path.write_bytes(YAML)
    assert fetch_fleet_manifest(str(path)) == YAML
    assert fetch_fleet_manifest(f"file://{path}") == YAML
    with pytest.raises(FleetManifestError, match="cannot read the adapters manifest"):
        fetch_fleet_manifest(str(tmp_path / "missing.yaml"))
    path.write_bytes(b"#" * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(FleetManifestError, match="over 1024 KiB"):
        fetch_fleet_manifest(str(path))


@respx.mock
def test_an_url_is_fetched_and_its_failures_named_without_credentials() -> None:
    respx.get("https://config.example/adapters.json").mock(
        return_value=httpx.Response(200, content=JSON)
    )
    assert fetch_fleet_manifest("https://config.example/adapters.json") == JSON
    respx.get("https://config.example/gone.json").mock(return_value=httpx.Response(404))
    with pytest.raises(FleetManifestError, match="answered HTTP 404"):
        fetch_fleet_manifest("https://config.example/gone.json")
    respx.get("https://config.example/down.json").mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(FleetManifestError, match="cannot fetch") as failed:
        fetch_fleet_manifest("https://user:s3cret@config.example/down.json")
    assert "s3cret" not in str(failed.value)
    respx.get("https://config.example/huge.json").mock(
        return_value=httpx.Response(200, content=b" " * (MAX_MANIFEST_BYTES + 10))
    )
    with pytest.raises(FleetManifestError, match="over"):
        fetch_fleet_manifest("https://config.example/huge.json")


def test_an_hf_file_is_downloaded_at_its_revision(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub

    downloaded = tmp_path / "adapters.yaml"
    downloaded.write_bytes(YAML)
    calls: list[tuple[str, str, Any]] = []

    def hf_hub_download(repo_id: str, filename: str, **kwargs: Any) -> str:
        calls.append((repo_id, filename, kwargs.get("revision")))
        return str(downloaded)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    assert fetch_fleet_manifest("hf://acme/fleet@prod/deploy/adapters.yaml") == YAML
    assert fetch_fleet_manifest("hf://acme/fleet/adapters.yaml") == YAML
    assert calls == [
        ("acme/fleet", "deploy/adapters.yaml", "prod"),
        ("acme/fleet", "adapters.yaml", None),
    ]
    with pytest.raises(FleetManifestError, match="hf://ORG/REPO"):
        fetch_fleet_manifest("hf://acme")


@pytest.mark.parametrize("block", blocks_of("manifest"), ids=lambda block: block.id)
def test_the_readmes_manifest_parses(block) -> None:  # type: ignore[no-untyped-def]
    manifest = parse_fleet_manifest(block.code.encode())
    assert manifest.adapters and all(d.source for d in manifest.adapters.values())


def test_a_manifest_owns_every_adapter_of_its_gateway(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="list every adapter in it"):
        Settings(cache_dir=tmp_path, adapters_manifest="a.yaml", lora=["fox=/srv/fox"])
    with pytest.raises(ValueError, match="upstream server's"):
        Settings(
            cache_dir=tmp_path, adapters_manifest="a.yaml", upstream_url="http://127.0.0.1:9/v1"
        )
    assert Settings(cache_dir=tmp_path, adapters_manifest="a.yaml").adapters_manifest == "a.yaml"


def test_a_manifest_in_an_unknown_users_home_is_a_clear_error() -> None:
    with pytest.raises(FleetManifestError, match="cannot read the adapters manifest"):
        fetch_fleet_manifest("~no-such-user-4e1f/adapters.yaml")
