"""The adapter manager never blocks the event loop: a 200 MB adapter is verified in a thread."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.intake.pipeline import PreparedVersion
from loragate.adapters.manager import AdapterManager
from loragate.adapters.manifest import Manifest
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore, StoredAdapter
from tests.engine_doubles import QuietEngine, ServingSupervisor

BIG = 200 * 1024 * 1024
TICK = 0.01


def adapter_source(path: Path, size: int, tag: str) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "tag": tag}))
    with (path / "adapter_model.safetensors").open("wb") as handle:
        handle.write(tag.encode())
        handle.truncate(size)  # sparse: no 200 MB written for the source
    return path


@pytest.fixture
async def big_and_small(
    tmp_path: Path,
) -> AsyncIterator[tuple[AdapterStore, StoredAdapter, StoredAdapter]]:
    store = AdapterStore(tmp_path / "store")
    big = store.put_dir(adapter_source(tmp_path / "big", BIG, "big"))
    small = store.put_dir(adapter_source(tmp_path / "small", 1024, "small"))
    yield store, big, small


def make_manager(
    tmp_path: Path, store: AdapterStore, versions: dict[str, StoredAdapter]
) -> tuple[AdapterManager, QuietEngine]:
    """A manager whose sources are names in ``versions`` (already stored)."""

    async def prepare(source: str, revision: str | None) -> PreparedVersion:
        return PreparedVersion(versions[source], Provenance(source, revision))

    engine = QuietEngine()
    manager = AdapterManager(
        store=store,
        manifest=Manifest(tmp_path / "manifest.json"),
        engine=engine,  # type: ignore[arg-type]
        supervisor=ServingSupervisor(),  # type: ignore[arg-type]
        base_name="base",
        base_config={},
        prepare=prepare,
        zero_adapter_root=None,
    )
    return manager, engine


async def longest_stall(operation: Callable[[], Awaitable[Any]]) -> float:
    """The longest the event loop went without running a 10 ms ticker while ``operation`` ran."""
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(TICK)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(3 * TICK)
    started = time.perf_counter()
    await operation()
    ended = time.perf_counter()
    await asyncio.sleep(3 * TICK)
    task.cancel()
    marks = [started, *[t for t in ticks if started < t < ended], ended]
    return max(b - a for a, b in itertools.pairwise(marks))


async def test_a_swap_rollback_and_reapply_verify_a_200_mb_adapter_off_the_loop(
    tmp_path: Path, big_and_small: tuple[AdapterStore, StoredAdapter, StoredAdapter]
) -> None:
    store, big, small = big_and_small
    manager, engine = make_manager(tmp_path, store, {"big": big, "small": small})
    # How long verifying takes on this box now (about 0.3 s on an idle one): on the loop, a
    # stall at least that long; off it, a small fraction of it.
    started = time.perf_counter()
    store.verify(big)
    max_stall = max((time.perf_counter() - started) / 3, 0.05)

    stall = await longest_stall(lambda: manager.put("vast", "big"))
    assert stall < max_stall, f"a swap to a 200 MB adapter stalled the loop {stall:.2f} s"
    await manager.put("vast", "small")

    stall = await longest_stall(lambda: manager.rollback("vast"))
    assert stall < max_stall, f"rolling back to a 200 MB adapter stalled the loop {stall:.2f} s"
    assert manager.manifest.entries["vast"].active == big.digest

    engine.loaded.clear()
    manager.engine_versions.loaded.clear()  # a fresh engine boot: everything is loaded again
    stall = await longest_stall(manager.on_engine_ready)
    assert stall < max_stall, f"re-applying a 200 MB adapter stalled the loop {stall:.2f} s"
    assert [path.name for path in engine.loaded.values()] == [big.digest]
    await manager.aclose()
