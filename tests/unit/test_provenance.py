"""An adapter's provenance is one value from the fetch to the manifest and back, and the files
the pipeline has just stored are hashed once, not again before they load."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import loragate.adapters.store as store_module
from loragate.adapters.errors import AdapterError
from loragate.adapters.intake.pipeline import AdapterPipeline, PreparedVersion
from loragate.adapters.manager import AdapterManager
from loragate.adapters.manifest import Manifest, ManifestEntry
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import ADAPTER_FILES, AdapterStore
from tests.adapter_fixtures import llama_lora_shapes, peft_config, write_shaped_adapter
from tests.engine_doubles import QuietEngine, ServingSupervisor

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 1,
    "vocab_size": 64,
    "tie_word_embeddings": False,
}
SHA = "1" * 40


def make_manager(tmp_path: Path, store: AdapterStore, prepare: Any) -> AdapterManager:
    return AdapterManager(
        store=store,
        manifest=Manifest(tmp_path / "manifest.json"),
        engine=QuietEngine(),  # type: ignore[arg-type]
        supervisor=ServingSupervisor(),  # type: ignore[arg-type]
        base_name="base",
        base_config=TINY_LLAMA,
        prepare=prepare,
        zero_adapter_root=None,
    )


def tiny_adapter(path: Path, rank: int = 8) -> Path:
    return write_shaped_adapter(
        path, llama_lora_shapes(TINY_LLAMA, rank=rank, modules=("q_proj",)), peft_config(r=rank)
    )


# ----- today's files load ---------------------------------------------------------------------


def test_a_manifest_in_todays_format_loads_and_is_written_back_in_it(tmp_path: Path) -> None:
    # Exactly what loragate wrote before provenance became one type (dataclasses.asdict).
    record = {
        "name": "fox",
        "active": "a" * 64,
        "source": "hf://org/fox@main",
        "previous": "b" * 64,
        "revision": SHA,
        "follow": True,
        "fingerprint": SHA,
        "loaded_at": 1700000000.5,
        "extra": {},
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"version": 1, "adapters": {"fox": record}}, indent=2))

    entry = Manifest(path).load().entries["fox"]
    assert entry.provenance == Provenance("hf://org/fox@main", revision=SHA, fingerprint=SHA)
    assert (entry.active, entry.previous, entry.follow) == ("a" * 64, "b" * 64, True)
    assert entry.loaded_at == 1700000000.5

    # Saved again, it is the same record: a loragate from before this change reads it too.
    manifest = Manifest(path).load()
    manifest.save()
    assert json.loads(path.read_text())["adapters"]["fox"] == record


def test_a_manifest_entry_of_today_without_optional_keys_loads(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    minimal = {"name": "owl", "active": "c" * 64, "source": "/adapters/owl"}
    path.write_text(json.dumps({"version": 1, "adapters": {"owl": minimal}}))
    entry = Manifest(path).load().entries["owl"]
    assert entry == ManifestEntry(
        name="owl", active="c" * 64, provenance=Provenance("/adapters/owl")
    )


def test_version_metadata_in_todays_format_gives_its_provenance(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    # The metadata the pipeline wrote before this change, key for key.
    meta = {
        "source": "https://bucket.example/fox.tar.gz",
        "revision": '"etag-1"',
        "fingerprint": '"etag-1"',
        "format": "peft",
        "rank": 8,
        "target_modules": ["q_proj"],
    }
    digest = store.put_dir(tiny_adapter(tmp_path / "fox"), meta).digest
    stored = AdapterStore(tmp_path / "store").get(digest)  # as after a restart
    assert stored is not None
    assert stored.provenance == Provenance(
        "https://bucket.example/fox.tar.gz", revision='"etag-1"', fingerprint='"etag-1"'
    )
    on_disk = json.loads((stored.path / ".loragate.json").read_text())
    assert {k: on_disk[k] for k in meta} == meta


# ----- one value on its way through -----------------------------------------------------------


async def test_a_rollback_restores_the_earlier_versions_provenance_from_the_store(
    tmp_path: Path,
) -> None:
    store = AdapterStore(tmp_path / "store")
    pipeline = AdapterPipeline(store, tmp_path / "base", TINY_LLAMA, max_lora_rank=16)
    first, second = tiny_adapter(tmp_path / "v1", rank=4), tiny_adapter(tmp_path / "v2", rank=8)
    prepared: list[PreparedVersion] = []

    async def prepare(source: str, revision: str | None) -> PreparedVersion:
        prepared.append(await pipeline(source, revision))
        return prepared[-1]

    manager = make_manager(tmp_path, store, prepare)
    await manager.put("fox", str(first))
    await manager.put("fox", str(second))
    assert manager.manifest.entries["fox"].provenance is prepared[1].provenance  # the same value

    await manager.rollback("fox")
    entry = manager.manifest.entries["fox"]
    assert entry.active == prepared[0].stored.digest
    assert entry.provenance == prepared[0].provenance
    assert entry.provenance.source == str(first) and entry.provenance.fingerprint is not None
    await manager.aclose()


# ----- hashed once ----------------------------------------------------------------------------


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Counter[Path]:
    """Every file the store hashes, by path, counted."""
    counts: Counter[Path] = Counter()
    real = store_module.file_digest

    def counting(path: Path) -> str:
        counts[path] += 1
        return real(path)

    monkeypatch.setattr(store_module, "file_digest", counting)
    return counts


def hashed_in(counts: Counter[Path], root: Path) -> Counter[str]:
    """How often each adapter file inside ``root`` was hashed (by file name)."""
    found: Counter[str] = Counter()
    for path, count in counts.items():
        if path.is_relative_to(root):
            found[path.name] += count
    return found


async def test_a_freshly_stored_version_is_hashed_once_before_it_loads(
    tmp_path: Path, hashed: Counter[Path]
) -> None:
    store = AdapterStore(tmp_path / "store")
    pipeline = AdapterPipeline(store, tmp_path / "base", TINY_LLAMA, max_lora_rank=16)
    manager = make_manager(tmp_path, store, pipeline)
    source = tiny_adapter(tmp_path / "fox")

    await manager.put("fox", str(source))

    # Each stored file once (the copy, as it was written), and never again on the way in.
    assert hashed_in(hashed, store.root) == Counter(ADAPTER_FILES)
    assert manager.describe("fox")["state"] == "ready"
    await manager.aclose()


async def test_a_version_read_back_from_the_store_is_still_verified(
    tmp_path: Path, hashed: Counter[Path]
) -> None:
    store = AdapterStore(tmp_path / "store")
    pipeline = AdapterPipeline(store, tmp_path / "base", TINY_LLAMA, max_lora_rank=16)
    manager = make_manager(tmp_path, store, pipeline)
    await manager.put("fox", str(tiny_adapter(tmp_path / "v1", rank=4)))
    await manager.put("fox", str(tiny_adapter(tmp_path / "v2", rank=8)))
    previous = manager.manifest.entries["fox"].previous
    assert previous is not None

    hashed.clear()
    await manager.rollback("fox")  # from disk: its files are checked once before the load
    assert hashed_in(hashed, store.versions / previous) == Counter(ADAPTER_FILES)

    swapped_out = manager.manifest.entries["fox"].previous
    assert swapped_out is not None
    weights = store.versions / swapped_out / "adapter_model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"tampered")
    with pytest.raises(AdapterError, match="does not match its recorded sha256"):
        await manager.rollback("fox")
    await manager.aclose()
