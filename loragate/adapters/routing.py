"""Which engine id serves each public model name right now, and how many requests each holds.

A request leases the engine id its public name maps to when it starts and keeps it until it
ends, so a swap never moves a request between versions. A retired version is unloaded from
the engine once its last lease is returned.

Each engine id's preset (``preset_of``) is kept here too, beside the route that made it
current: it belongs to the version, so a request gets the preset of the version it leased,
whatever swap or rollback happens while it runs, and it is forgotten only when the version
leaves the engine (``forget``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from loragate.adapters.preset import Preset


class RoutingTable:
    def __init__(self) -> None:
        self._routes: dict[str, str] = {}
        self._names: tuple[str, ...] | None = None  # public_names(), until a route changes
        self._inflight: defaultdict[str, int] = defaultdict(int)
        self._drained: dict[str, asyncio.Event] = {}
        self._presets: dict[str, Preset] = {}

    def route(self, public: str, engine_id: str, preset: Preset | None = None) -> None:
        if public not in self._routes:
            self._names = None
        if preset:
            self._presets[engine_id] = preset
        self._routes[public] = engine_id

    def preset_of(self, engine_id: str) -> Preset | None:
        """The preset of the version ``engine_id`` (None: it has none)."""
        return self._presets.get(engine_id)

    def forget(self, engine_id: str) -> None:
        """``engine_id`` left the engine: its preset goes too (unless routed again)."""
        if engine_id not in self._routes.values():
            self._presets.pop(engine_id, None)

    def drop(self, public: str) -> str | None:
        self._names = None
        return self._routes.pop(public, None)

    def get(self, public: str) -> str | None:
        return self._routes.get(public)

    def public_names(self) -> tuple[str, ...]:
        """The public names routed, in the order they were added (cached: asked per request)."""
        if self._names is None:
            self._names = tuple(self._routes)
        return self._names

    def engine_ids(self) -> set[str]:
        return set(self._routes.values())

    def acquire(self, public: str) -> str | None:
        engine_id = self._routes.get(public)
        if engine_id is not None:
            self._inflight[engine_id] += 1
        return engine_id

    def release(self, engine_id: str) -> None:
        left = self._inflight[engine_id] - 1
        if left > 0:
            self._inflight[engine_id] = left
            return
        del self._inflight[engine_id]
        event = self._drained.get(engine_id)
        if event is not None:
            event.set()

    def inflight(self, engine_id: str) -> int:
        return self._inflight.get(engine_id, 0)

    async def wait_drained(self, engine_id: str, timeout: float) -> bool:
        """Wait until no request holds ``engine_id``; False if ``timeout`` passed first."""
        if self._inflight.get(engine_id, 0) == 0:
            return True
        event = self._drained.setdefault(engine_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._drained.pop(engine_id, None)
