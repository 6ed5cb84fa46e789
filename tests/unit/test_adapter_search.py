"""Where a catalog looks for an adapter name no model has registered
(``loragate.serving.adapter_search``): every ``adapter_dir`` folder before any resolver, in the
models' order; one search per name however many requests wait on it; a name found nowhere is
not looked for again for a while."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loragate.serving.adapter_search import AdapterNotFound, AdapterSearch
from loragate.settings.catalog import CatalogModel


def models(tmp_path: Path) -> dict[str, CatalogModel]:
    (tmp_path / "beta-adapters" / "owl").mkdir(parents=True)
    return {
        "alpha": CatalogModel(model="/m/a", resolvers=["hf://my-org/"]),
        "beta": CatalogModel(
            model="/m/b",
            adapter_dir=tmp_path / "beta-adapters",
            resolvers=["https://host/adapters/{name}.tar.gz"],
        ),
    }


async def nowhere(model_id: str, name: str, source: str) -> str | None:
    return "not there"


def test_folders_come_before_resolvers_and_a_resolver_gets_the_name(tmp_path: Path) -> None:
    search = AdapterSearch(models(tmp_path), nowhere)
    assert search.places_for("owl") == [
        ("beta", str(tmp_path / "beta-adapters" / "owl")),
        ("alpha", "hf://my-org/owl"),
        ("beta", "https://host/adapters/owl.tar.gz"),
    ]
    assert search.may_find("owl") and not search.may_find("../owl")


async def test_concurrent_requests_share_one_search_and_the_first_place_that_has_it_wins(
    tmp_path: Path,
) -> None:
    asked: list[tuple[str, str]] = []

    async def only_the_hub(model_id: str, name: str, source: str) -> str | None:
        asked.append((model_id, source))
        await asyncio.sleep(0.01)
        return None if source.startswith("hf://") else "not there"

    search = AdapterSearch(models(tmp_path), only_the_hub)
    assert await asyncio.gather(*(search.find("owl") for _ in range(5))) == ["alpha"] * 5
    assert [model_id for model_id, _ in asked] == ["beta", "alpha"]  # once, then found
    assert search.searches() == []


async def test_a_name_found_nowhere_says_where_it_was_looked_for_and_is_not_asked_again(
    tmp_path: Path,
) -> None:
    search = AdapterSearch(models(tmp_path), nowhere)
    with pytest.raises(AdapterNotFound) as missing:
        await search.find("lynx")
    assert missing.value.tried == [
        "hf://my-org/lynx: not there",
        "https://host/adapters/lynx.tar.gz: not there",
    ]
    assert not search.may_find("lynx")
