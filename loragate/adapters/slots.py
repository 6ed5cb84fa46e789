"""A fair gate that keeps at most ``slots`` distinct adapters in flight in the engine at once.

vLLM's CPU build mixes adapters up when more distinct adapters are in flight than it has
LoRA slots (``--max-loras``): base requests borrow the last slot's weights (slot -1) and
adapter answers can come back garbled (see ENGINE_NOTES.md). The zero adapter keeps base
requests off slot -1; this gate bounds the distinct adapters in flight, so every batch fits
the slots. Requests for an adapter already in flight join it at once unless someone is
waiting; waiters are served first come, first served, so no adapter starves.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdapterSlots:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._active: dict[str, int] = {}
        self._waiters: deque[tuple[str, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, engine_id: str) -> bool:
        return engine_id in self._active or len(self._active) < self.slots

    def try_acquire(self, engine_id: str) -> bool:
        """Take a place at once if one is free and nobody waits (no awaiting, no timer)."""
        if self._waiters or not self._fits(engine_id):
            return False
        self._active[engine_id] = self._active.get(engine_id, 0) + 1
        return True

    async def acquire(self, engine_id: str) -> None:
        if self.try_acquire(engine_id):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (engine_id, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(engine_id)  # admitted just as the caller gave up
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, engine_id: str) -> None:
        left = self._active[engine_id] - 1
        if left:
            self._active[engine_id] = left
        else:
            del self._active[engine_id]
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            engine_id, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if not self._fits(engine_id):
                return
            self._waiters.popleft()
            self._active[engine_id] = self._active.get(engine_id, 0) + 1
            future.set_result(None)
