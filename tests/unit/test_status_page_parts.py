"""The parts behind the status page: add progress through a real manager, followed log tails,
and the per-second traffic series."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loragate.adapters.intake.pipeline import PreparedVersion
from loragate.adapters.manager import AdapterError, AdapterManager
from loragate.adapters.manifest import Manifest
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore
from loragate.fetching.progress import WaitProgress, report_bytes, report_stage
from loragate.gateway.observe.log_tail import engine_lines, gateway_lines, merged
from loragate.gateway.observe.traffic import RecentTraffic
from tests.unit.test_manager_event_loop import QuietEngine, ServingSupervisor, adapter_source


def manager_with(tmp_path: Path, prepare: object) -> AdapterManager:
    return AdapterManager(
        store=AdapterStore(tmp_path / "store"),
        manifest=Manifest(tmp_path / "manifest.json"),
        engine=QuietEngine(),  # type: ignore[arg-type]
        supervisor=ServingSupervisor(),  # type: ignore[arg-type]
        base_name="base",
        base_config={},
        prepare=prepare,  # type: ignore[arg-type]
        zero_adapter_root=None,
    )


async def test_an_add_reports_each_stage_and_its_bytes_from_the_pipelines_thread(
    tmp_path: Path,
) -> None:
    seen: list[dict[str, object]] = []
    manager: AdapterManager

    def work(source: str) -> PreparedVersion:  # runs in a worker thread, like the pipeline
        report_bytes(300, 1200)
        seen.append(manager.progress.get("sleepy").as_dict())  # type: ignore[union-attr]
        report_stage("conversion")
        report_stage("validation")
        seen.append(manager.progress.get("sleepy").as_dict())  # type: ignore[union-attr]
        stored = manager.store.put_dir(adapter_source(tmp_path / "src", 1024, "sleepy"))
        return PreparedVersion(stored, Provenance(source))

    async def prepare(source: str, revision: str | None) -> PreparedVersion:
        return await asyncio.to_thread(work, source)

    manager = manager_with(tmp_path, prepare)
    described = await manager.put("sleepy", "https://user:secret@example.com/a.tar.gz")
    assert described["state"] == "ready"
    assert (seen[0]["stage"], seen[0]["bytes_done"], seen[0]["percent"]) == ("download", 300, 25.0)
    assert seen[1]["stage"] == "validation"
    record = manager.progress.get("sleepy")
    assert record is not None and record.stage == "done" and record.finished
    assert "secret" not in record.source  # shown to anyone with the admin key: redacted


async def test_a_failed_add_keeps_its_reason_on_the_board(tmp_path: Path) -> None:
    async def prepare(source: str, revision: str | None) -> PreparedVersion:
        report_stage("validation")
        raise AdapterError("adapter from <img src=x onerror=alert(1)> rejected: rank 999")

    manager = manager_with(tmp_path, prepare)
    with pytest.raises(AdapterError):
        await manager.put("broken", "/nowhere")
    record = manager.progress.get("broken")
    assert record is not None and record.stage == "failed"
    assert record.error is not None and "rank 999" in record.error
    assert "broken" not in manager.manifest.entries  # nothing changed


def test_progress_percent_is_known_only_with_a_size() -> None:
    record = WaitProgress(name="a", source="s")
    assert record.percent is None
    record.bytes_done, record.bytes_total = 50, 200
    assert record.percent == 25.0
    record.enter("load")
    assert record.percent == 100.0


async def test_engine_log_follow_yields_new_lines_and_survives_rotation(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("old 1\nold 2\n")
    lines = engine_lines(path, 1, follow=True)
    assert await anext(lines) == "old 2"
    with path.open("a") as handle:
        handle.write("new 1\npart")
    assert await asyncio.wait_for(anext(lines), 5) == "new 1"
    with path.open("a") as handle:
        handle.write("ial\n")
    assert await asyncio.wait_for(anext(lines), 5) == "partial"
    path.write_text("rotated\n")  # shorter than what was read: a new file
    assert await asyncio.wait_for(anext(lines), 5) == "rotated"
    await lines.aclose()


async def test_gateway_log_follow_yields_lines_logged_after_it_started() -> None:
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        lines = gateway_lines(0, follow=True)
        waiting = asyncio.ensure_future(anext(lines))
        await asyncio.sleep(0)
        logging.getLogger("loragate.test").info("fresh line")
        assert (await asyncio.wait_for(waiting, 5)).endswith("loragate.test: fresh line")
        await lines.aclose()
    finally:
        root.setLevel(old_level)


async def test_merged_tails_send_heartbeats_while_quiet_and_end_in_time() -> None:
    async def quiet() -> AsyncIterator[str]:
        yield "one"
        await asyncio.sleep(60)

    items = [item async for item in merged({"engine": quiet()}, heartbeat=0.05, max_seconds=0.3)]
    assert items[0] == ("engine", "one")
    assert None in items[1:]


def test_traffic_series_folds_seconds_into_points() -> None:
    now = [1000.0]
    traffic = RecentTraffic(clock=lambda: now[0])
    traffic.add(200, 0.5, 0.1)
    traffic.add(200, 1.5, None)
    now[0] = 1003.0
    traffic.add(500, 0.2, None)
    points = traffic.series(window=10, step=5)
    assert [p["t"] for p in points] == [998, 1003]  # each point ends at its last second
    assert points[0]["rps"] == 0 and points[0]["latency_avg"] is None
    latest = points[1]
    assert latest["rps"] == pytest.approx(3 / 5)
    assert latest["errors"] == 1
    assert latest["latency_avg"] == pytest.approx((0.5 + 1.5 + 0.2) / 3, abs=1e-4)
    assert latest["latency_max"] == 1.5
    assert latest["ttft_avg"] == 0.1


def test_traffic_forgets_what_is_older_than_its_window() -> None:
    now = [0.0]
    traffic = RecentTraffic(clock=lambda: now[0])
    for second in range(700):
        now[0] = float(second)
        traffic.add(200, 0.01, None)
    assert len(traffic._seconds) <= 601
    assert sum(p["rps"] for p in traffic.series(window=600, step=60)) * 60 == pytest.approx(600)
