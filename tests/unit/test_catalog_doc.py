"""The catalog's user documentation stays true: docs/catalog.md has a row for every key a
config file's catalog takes, and the README's two-model config (the shape scripts outside
the suite rely on, issue 26) loads as the catalog it describes."""

from __future__ import annotations

import re
from pathlib import Path

from loragate.settings import load_settings
from loragate.settings.catalog import CatalogFields, CatalogModel
from tests.readme_blocks import DOCS, blocks_of

PAGE = DOCS / "catalog.md"


def _documented_keys() -> set[str]:
    """The keys of the page's "Every key" table (its first column, in backquotes)."""
    section = PAGE.read_text(encoding="utf-8").split("\n## Every key\n", 1)[1].split("\n## ")[0]
    return set(re.findall(r"^\| `([a-z_.ID]+)` \|", section, re.M))


def test_every_catalog_key_has_its_row_in_docs_catalog_md() -> None:
    keys = {f"models.ID.{name}" for name in CatalogModel.model_fields}
    keys |= {name for name in CatalogFields.model_fields if name != "models"}
    assert keys <= _documented_keys(), sorted(keys - _documented_keys())
    assert _documented_keys() <= keys, "a row for a key that no longer exists"


def test_the_readmes_two_model_config_is_the_contracts_catalog(tmp_path: Path) -> None:
    (block,) = [b for b in blocks_of("config") if b.page == "README.md" and "models:" in b.code]
    path = tmp_path / "gateway.yaml"
    path.write_text(block.code)
    settings = load_settings(path)
    assert settings.max_lora_rank == 16 and settings.max_loaded_models == 1
    assert settings.memory_budget == 12 * 1024**3
    alpha, beta = settings.models["alpha"], settings.models["beta"]
    assert list(settings.models) == ["alpha", "beta"]
    assert (alpha.model, alpha.lora) == ("/models/base-a", ["support=/adapters/support"])
    assert alpha.adapter_dir == Path("/adapters/a")
    assert (alpha.ttl, alpha.keep, alpha.preload) == (600, False, True)
    assert alpha.engine_args == ["--max-model-len", "2048"]
    assert (beta.model, beta.lora) == ("/models/base-b", ["sales=/adapters/sales"])
    assert (beta.ttl, beta.keep, beta.preload, beta.adapter_dir) == (None, False, False, None)
