"""The gate that bounds distinct adapters in flight (the CPU build's second guard)."""

from __future__ import annotations

import asyncio

import pytest

from loragate.adapters.slots import AdapterSlots


async def test_never_more_distinct_adapters_in_flight_than_slots() -> None:
    slots = AdapterSlots(2)
    in_flight: dict[str, int] = {}
    most = 0

    async def request(engine_id: str) -> None:
        nonlocal most
        await slots.acquire(engine_id)
        in_flight[engine_id] = in_flight.get(engine_id, 0) + 1
        most = max(most, len(in_flight))
        await asyncio.sleep(0.01)
        in_flight[engine_id] -= 1
        if not in_flight[engine_id]:
            del in_flight[engine_id]
        slots.release(engine_id)

    await asyncio.gather(*(request(f"a{i % 4}") for i in range(40)))
    assert most == 2
    assert slots.waiting == 0


async def test_requests_for_an_adapter_in_flight_join_it_at_once() -> None:
    slots = AdapterSlots(1)
    await slots.acquire("pong")
    await asyncio.wait_for(slots.acquire("pong"), 0.1)


async def test_a_waiting_adapter_is_not_starved_by_a_busy_one() -> None:
    slots = AdapterSlots(1)
    await slots.acquire("pong")
    fox = asyncio.create_task(slots.acquire("fox"))
    await asyncio.sleep(0)
    late_pong = asyncio.create_task(slots.acquire("pong"))  # queues behind fox
    await asyncio.sleep(0.01)
    assert not fox.done() and not late_pong.done()
    slots.release("pong")
    await asyncio.wait_for(fox, 0.1)
    assert not late_pong.done()
    slots.release("fox")
    await asyncio.wait_for(late_pong, 0.1)


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    slots = AdapterSlots(1)
    await slots.acquire("pong")
    fox = asyncio.create_task(slots.acquire("fox"))
    await asyncio.sleep(0)
    fox.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fox
    assert slots.waiting == 0
    slots.release("pong")
    await asyncio.wait_for(slots.acquire("owl"), 0.1)
