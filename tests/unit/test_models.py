from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loragate.base_model.resolve import BaseModelError, read_base_config, resolve_base_model

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The user's Hugging Face hub cache (``HF_HUB_CACHE``), here a temporary directory."""
    from huggingface_hub import constants

    path = tmp_path / "hf-hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
    return path


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, hub_cache: Path) -> list[dict[str, Any]]:
    """snapshot_download over a fake cache: local_files_only finds only what was downloaded."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls: list[dict[str, Any]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        root = Path(kwargs["cache_dir"] or hub_cache)
        snapshot = root / f"models--{repo_id.replace('/', '--')}" / "snapshots" / SHA
        if kwargs.get("local_files_only"):
            if not snapshot.is_dir():
                raise LocalEntryNotFoundError("not in the cache")
            return str(snapshot)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_local_model_directory_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    assert (
        resolve_base_model(str(tmp_path / "model"), tmp_path / "cache")
        == (tmp_path / "model").resolve()
    )
    assert not (tmp_path / "cache").exists()


def test_missing_model_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match="does not exist"):
        resolve_base_model(str(tmp_path / "nope"), tmp_path / "cache")


def test_hf_model_is_downloaded_once_into_the_hub_cache_then_used_offline(
    fake_hub: list[dict[str, Any]], hub_cache: Path, tmp_path: Path
) -> None:
    first = resolve_base_model("acme/tiny", tmp_path / "cache", progress=True)
    assert first.name == SHA and first.is_relative_to(hub_cache)
    downloads = [c for c in fake_hub if not c.get("local_files_only")]
    assert len(downloads) == 1 and downloads[0]["cache_dir"] is None  # huggingface_hub's own
    # A silent bar whose bytes feed the progress record (/health, gateway pull, STATUS=).
    assert downloads[0]["tqdm_class"](total=1).disable
    assert not (tmp_path / "cache").exists()  # no second copy in loragate's cache

    fake_hub.clear()
    assert resolve_base_model("acme/tiny", tmp_path / "cache") == first
    assert [c["local_files_only"] for c in fake_hub] == [True]


def test_a_model_downloaded_by_an_earlier_loragate_is_still_served_from_there(
    fake_hub: list[dict[str, Any]], hub_cache: Path, tmp_path: Path
) -> None:
    legacy = tmp_path / "cache" / "models"
    old = legacy / "models--acme--tiny" / "snapshots" / SHA
    old.mkdir(parents=True)
    assert resolve_base_model("acme/tiny", tmp_path / "cache") == old
    assert [(c["cache_dir"], c["local_files_only"]) for c in fake_hub] == [(legacy, True)]
    assert not hub_cache.exists()


def test_quiet_download_passes_a_disabled_progress_bar(
    fake_hub: list[dict[str, Any]], tmp_path: Path
) -> None:
    resolve_base_model("acme/tiny", tmp_path / "cache", progress=False)
    bar = fake_hub[-1]["tqdm_class"](total=1)
    assert bar.disable


def test_offline_without_a_cached_copy_says_to_pull_first(
    fake_hub: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BaseModelError, match="gateway pull acme/tiny"):
        resolve_base_model("acme/tiny", tmp_path / "cache")
    assert all(c.get("local_files_only") for c in fake_hub)


def test_hub_failure_is_reported_with_the_model_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(
        BaseModelError, match=r"cannot download base model acme/tiny.*network unreachable"
    ):
        resolve_base_model("acme/tiny", tmp_path / "cache")


def test_read_base_config_returns_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128}))
    assert read_base_config(tmp_path) == {"hidden_size": 128}


def test_read_base_config_refuses_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match=r"no config\.json"):
        read_base_config(tmp_path)


def test_read_base_config_refuses_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(BaseModelError, match="not valid JSON"):
        read_base_config(tmp_path)


def test_a_model_in_an_unknown_users_home_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match="home directory of an unknown user"):
        resolve_base_model("~no-such-user-4e1f/model", tmp_path / "cache")
