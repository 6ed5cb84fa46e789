"""The adapter versions the engine holds: loading one for a swap, unloading one once drained.

The manager decides what serves; this module does the engine side of it. A version loads
under its own engine id (``engine_id``) once the engine serves, its files checked against
their digests first (``verified``); a retired version stays loaded until the
requests that leased it (``RoutingTable.acquire``) have finished, or ``drain_timeout`` has
passed, and is then unloaded, unless a swap back routed to it again meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from pathlib import Path

from loragate.adapters.errors import AdapterError
from loragate.adapters.routing import RoutingTable
from loragate.adapters.store import AdapterStore, StoredAdapter, TamperedAdapterError
from loragate.fetching.progress import report_stage
from loragate.supervisor.client import EngineClient, EngineRefused
from loragate.supervisor.engine import EngineSupervisor, EngineUnavailable

log = logging.getLogger("loragate.adapters")


def engine_id(name: str, digest: str) -> str:
    return f"{name}@{digest[:12]}"


class EngineVersions:
    def __init__(
        self,
        *,
        store: AdapterStore,
        engine: EngineClient,
        supervisor: EngineSupervisor,
        routes: RoutingTable,
        locks: defaultdict[str, asyncio.Lock],
        counters: defaultdict[str, int],
        drain_timeout: float,
        ready_timeout: float,
    ) -> None:
        self._store = store
        self._engine = engine
        self._supervisor = supervisor
        self._routes = routes
        self._locks = locks  # the manager's per-name locks: an unload waits out a swap
        self._counters = counters
        self._drain_timeout = drain_timeout
        self._ready_timeout = ready_timeout
        self.loaded: set[str] = set()  # engine ids loaded by this gateway (or found at boot)
        self.last_load_seconds: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def verified(self, digest: str, *, hash_files: bool = True) -> StoredAdapter:
        """The stored version ``digest``, its files checked against their digests.

        Hashing a large adapter takes a while (about 0.3 s per 200 MB here): in a thread, so
        streams keep flowing meanwhile. ``hash_files=False`` for a version hashed just now
        (the pipeline stored it): only that it is still in the store is checked.
        """
        return await asyncio.to_thread(self._stored, digest, hash_files)

    def _stored(self, digest: str, hash_files: bool) -> StoredAdapter:
        stored = self._store.get(digest)
        if stored is None:
            raise AdapterError(f"version {digest[:12]} is no longer in the adapter store", 409)
        try:
            if hash_files:
                self._store.verify(stored)
            else:
                self._store.check_preset(stored)
        except TamperedAdapterError as exc:
            raise AdapterError(str(exc), status=409, code="adapter_tampered") from None
        return stored

    async def adopt_served(self, base_name: str) -> None:
        """Take what a freshly booted engine serves as loaded (the base model needs no load)."""
        served = await self._engine.served_ids()
        self.loaded = {eid for eid in served if eid != base_name}

    async def load_at_boot(self, eid: str, path: Path) -> None:
        """Load ``path`` as ``eid`` unless loaded; the engine's errors reach the caller."""
        if eid not in self.loaded:
            await self._engine.load_adapter(eid, path)
            self.loaded.add(eid)

    async def load(self, eid: str, path: Path) -> None:
        """Load ``path`` as ``eid`` for a swap, once the engine serves; ``AdapterError`` if not."""
        try:
            await self._supervisor.wait_until_serving(self._ready_timeout)
        except EngineUnavailable as exc:
            raise AdapterError(str(exc), status=503, code="engine_unavailable") from None
        started = time.perf_counter()
        report_stage("load")
        if eid not in self.loaded:
            try:
                await self._engine.load_adapter(eid, path)
            except EngineRefused as exc:
                self._counters["load_failures"] += 1
                raise AdapterError(
                    exc.detail, status=400, code="adapter_refused_by_engine"
                ) from None
            except EngineUnavailable as exc:
                # The engine died under the load: nothing changed here; the version is in the
                # store, so asking again once the engine is back is cheap.
                self._counters["load_failures"] += 1
                raise AdapterError(
                    f"{exc}; the adapter was not swapped: try again once the engine is ready",
                    status=503,
                    code="engine_unavailable",
                ) from None
            self.loaded.add(eid)
            self._counters["loads"] += 1
        self.last_load_seconds = time.perf_counter() - started

    async def unload_unused(self, eid: str) -> None:
        """Unload ``eid`` now: loaded for a swap that did not happen, so never routed and
        leased by no request (the caller holds the name's lock). A failure is logged only:
        the engine keeps an unrouted version, which nothing asks for."""
        try:
            await self._engine.unload_adapter(eid)
        except (EngineRefused, EngineUnavailable, OSError) as exc:
            log.warning("could not unload %s: %s", eid, exc)
            return
        self.loaded.discard(eid)
        self._routes.forget(eid)
        self._counters["unloads"] += 1

    def retire(self, name: str, old_eid: str) -> None:
        """Unload ``old_eid`` (no longer routed for ``name``) once its requests have drained."""
        task = asyncio.create_task(self._unload_when_drained(name, old_eid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _unload_when_drained(self, name: str, old_eid: str) -> None:
        drained = await self._routes.wait_drained(old_eid, self._drain_timeout)
        if not drained:
            log.warning(
                "unloading %s with requests still in flight after %.0f s",
                old_eid,
                self._drain_timeout,
            )
        async with self._locks[name]:
            if old_eid in self._routes.engine_ids() or old_eid not in self.loaded:
                return  # routed again meanwhile (a swap back), or already gone
            try:
                await self._engine.unload_adapter(old_eid)
            except (EngineRefused, EngineUnavailable, OSError) as exc:
                log.warning("could not unload %s: %s", old_eid, exc)
                return
            self.loaded.discard(old_eid)
            self._routes.forget(old_eid)
            self._counters["unloads"] += 1
