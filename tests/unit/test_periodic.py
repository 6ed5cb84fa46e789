"""The periodic loop every watcher runs on (``loragate.periodic``): a pass that raises is
logged and the next one runs; stopping it is prompt, mid-pass or mid-wait."""

from __future__ import annotations

import asyncio

import pytest

from loragate.periodic import PeriodicTask


async def test_the_loop_survives_a_pass_that_raises_and_stops_promptly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    passes: list[int] = []
    third = asyncio.Event()

    async def step() -> None:
        passes.append(len(passes))
        if len(passes) == 1:
            raise OSError(28, "No space left on device")
        if len(passes) == 3:
            third.set()

    loop = PeriodicTask("test-watch", step, interval=0.01)
    loop.start()
    await asyncio.wait_for(third.wait(), 5)  # the passes after the one that raised still ran
    assert loop.running
    assert "test-watch: a pass failed" in caplog.text and "No space left" in caplog.text
    await asyncio.wait_for(loop.aclose(), 1)
    assert not loop.running
    ran = len(passes)
    await asyncio.sleep(0.05)
    assert len(passes) == ran  # nothing runs after aclose


async def test_the_loop_stops_promptly_mid_pass_and_mid_wait() -> None:
    entered = asyncio.Event()

    async def endless() -> None:
        entered.set()
        await asyncio.Event().wait()

    busy = PeriodicTask("busy", endless, interval=3600, first_at_once=True)
    busy.start()
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(busy.aclose(), 1)  # the pass in flight is cancelled

    idle = PeriodicTask("idle", endless, interval=3600)  # waits an interval before its first pass
    idle.start()
    await asyncio.sleep(0.01)
    assert idle.running
    await asyncio.wait_for(idle.aclose(), 1)
    assert not idle.running
