"""Keep live adapters' store files intact: the engine re-reads them without asking the gateway.

vLLM keeps ``--max-cpu-loras`` adapters in memory and re-reads any other from its path (a
store directory) whenever a request needs it again, and adapters with the same content share
that directory. The gateway verifies a version before each load it makes, but the engine's
own reloads go unchecked; so every ``interval`` this watch looks at each adapter's active
version and, when its files changed on disk since they were last found good, verifies them.
A damaged version is stored again from the adapter's source (the same content lands in the
same place, so the engine's next reload reads good weights), and only if the source still
gives exactly that version (its digest is the pin); when the source cannot give it back, or
now holds other weights, the adapter is marked failed with the reason, for ``/health`` and
the admin API, and keeps the version it had.

Checking is cheap when nothing changed: a ``stat`` per file; files are hashed only after a
change of size, mtime or inode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING

from loragate.adapters.errors import AdapterError
from loragate.adapters.store import ADAPTER_FILES, StoredAdapter, TamperedAdapterError
from loragate.logs import redact_urls

if TYPE_CHECKING:
    from loragate.adapters.manager import AdapterManager

log = logging.getLogger("loragate.adapters")

Stamp = tuple[tuple[int, int, int], ...]


def _stamp(stored: StoredAdapter) -> Stamp | None:
    try:
        stats = [os.stat(stored.path / name) for name in ADAPTER_FILES]
    except OSError:
        return None
    return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats)


class StoreWatch:
    def __init__(self, manager: AdapterManager, interval: float) -> None:
        self._manager = manager
        self.interval = interval
        self._good: dict[str, Stamp] = {}  # digest -> file stamps when last verified good
        self._hopeless: dict[str, Stamp | None] = {}  # digest -> stamps when a restore failed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="store-watch")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching whatever one round did
                log.exception("store watch: a check failed")

    async def check(self) -> dict[str, str]:
        """One round; returns the adapters whose active version was damaged, with the reason."""
        manager = self._manager
        damaged: dict[str, str] = {}
        for name, entry in list(manager.manifest.entries.items()):
            stored = manager.store.get(entry.active)
            stamp = _stamp(stored) if stored is not None else None
            if stored is not None and stamp is not None and self._good.get(stored.digest) == stamp:
                continue
            if self._hopeless.get(entry.active, ()) == stamp:
                continue  # already reported; try again once something changes
            try:
                if stored is None or stamp is None:
                    raise TamperedAdapterError(
                        f"adapter {entry.active[:12]}: its files or metadata are missing from "
                        "the store or damaged"
                    )
                await asyncio.to_thread(manager.store.verify, stored)
            except TamperedAdapterError as exc:
                damaged[name] = str(exc)
                if not await self._restore(name, str(exc)):
                    self._hopeless[entry.active] = stamp
                continue
            self._good[stored.digest] = stamp
        return damaged

    async def _restore(self, name: str, problem: str) -> bool:

        manager = self._manager
        entry = manager.manifest.entries.get(name)
        if entry is None:
            return True
        shown = redact_urls(entry.provenance.source)
        log.error("adapter %s: %s; storing it again from %s", name, problem, shown)
        manager.counters["store_repairs"] += 1
        try:
            origin = entry.provenance
            # Pinned to the damaged version's own digest: a repair restores these weights or
            # nothing. A source that moved on (a new upload, a moved tag) must not go live in
            # its place unasked, whether or not the adapter follows its source.
            await manager.put(
                name, origin.source, origin.revision, follow=entry.follow, digest=entry.active
            )
        except AdapterError as exc:
            if exc.code == "digest_mismatch":
                why = f"the source no longer holds this version ({exc}), so nothing was swapped"
            else:
                why = f"it could not be stored again from {shown} ({exc})"
            manager.failures[name] = f"{problem}; {why}: PUT a good copy or roll back"
            log.error("adapter %s: %s", name, manager.failures[name])
            return False
        log.info("adapter %s: stored again from %s", name, shown)
        return True
