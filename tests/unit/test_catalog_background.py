"""A catalog's background work fails alone: a ttl unload that raises is logged and the next
ttl pass still runs, and stopping the gateway stops every engine even after a background pass
failed and when one engine's stop raises.

Real catalogs supervising stand-in engine processes (``tools.bench.fake_engine``), as in
test_catalog.py; only the failure is injected, since no real engine's stop can be made to raise
on cue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from loragate.demo.layout import demo_base_dir
from loragate.engine_states import EngineState
from loragate.serving.catalog import Catalog
from tests.unit.test_catalog import catalog_settings


async def until(predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_ttl_unload_that_raises_is_logged_and_the_next_pass_unloads_it(
    tmp_path: Path,
    demo_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    models = {"alpha": {"model": str(demo_base_dir(demo_dir)), "ttl": 0.5}}
    settings = catalog_settings(tmp_path, demo_dir, models=models)
    catalog = Catalog(settings, ttl_check_seconds=0.2)
    alpha = catalog.entries["alpha"]
    real_unload, refused = alpha.unload, []

    async def unload_refused_once(reason: str) -> None:
        if not refused:
            refused.append(reason)
            raise RuntimeError("the engine would not stop")
        await real_unload(reason)

    monkeypatch.setattr(alpha, "unload", unload_refused_once)
    await catalog.start()
    try:
        await catalog.load_by_hand("alpha")
        await until(lambda: alpha.residency == "resident")
        await until(lambda: alpha.residency == "cold")  # a later pass unloaded it
        assert refused == ["unloaded: idle for 0.5 s (ttl)"]
        assert "alpha: its ttl unload failed" in caplog.text
        assert "the engine would not stop" in caplog.text  # with its traceback
        assert alpha.unloads == 2 and alpha.last_unload_reason == "idle for 0.5 s (ttl)"
    finally:
        await catalog.stop()


async def test_stop_stops_every_engine_after_a_failed_ttl_pass_and_a_stop_that_raises(
    tmp_path: Path,
    demo_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ttl pass for alpha fails again and again (a hand-written loop ended at the first,
    and stopping the catalog raised it again before any engine stopped); a background task (a
    preload) ended with an exception nobody read; alpha's own stop raises too. Stopping still
    returns, and beta's engine is stopped."""
    base = str(demo_base_dir(demo_dir))
    models = {"alpha": {"model": base, "ttl": 0.2}, "beta": {"model": base}}
    settings = catalog_settings(tmp_path, demo_dir, models=models)
    catalog = Catalog(settings, ttl_check_seconds=0.1)
    alpha, beta = catalog.entries["alpha"], catalog.entries["beta"]
    real_stop = alpha.stop

    async def refuse(*args: object) -> None:
        raise RuntimeError("the engine would not stop")

    monkeypatch.setattr(alpha, "unload", refuse)
    await catalog.start()
    try:
        await catalog.load_by_hand("alpha")
        await catalog.load_by_hand("beta")
        await until(lambda: beta.residency == "resident")
        await until(lambda: caplog.text.count("alpha: its ttl unload failed") >= 2)
        failed = asyncio.create_task(refuse(), name="preload-that-failed")
        await asyncio.wait([failed])
        catalog._preloads.add(failed)  # as a preload whose failure nothing caught would be
        monkeypatch.setattr(alpha, "stop", refuse)
        await asyncio.wait_for(catalog.stop(), 60)  # returns: nothing raised
        assert beta.state == EngineState.STOPPED
        assert "alpha: stopping its engine failed" in caplog.text
    finally:
        await real_stop()  # what the refused stop left running
    assert alpha.state == EngineState.STOPPED
