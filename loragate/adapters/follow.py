"""Follow mode: watch an adapter's source and swap each new version in live.

One task per followed adapter polls a cheap change marker (a Hugging Face commit, an ETag,
a local directory's file list and mtimes, the newest Tinker checkpoint) every ``interval``.
A change goes through the same path as an admin PUT: fetch, convert, validate, store, swap.
A version that fails is skipped with its reason (and not retried until the source changes
again) while the current version keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from loragate.adapters.errors import AdapterError
from loragate.logs import redact_urls

if TYPE_CHECKING:
    from loragate.adapters.manager import AdapterManager

log = logging.getLogger("loragate.adapters")

Fingerprinter = Callable[[str, str | None], str | None]


def default_fingerprint(source: str, revision: str | None) -> str | None:
    from loragate.adapters.intake.sources import source_fingerprint

    return source_fingerprint(source, revision)


class AdapterFollower:
    def __init__(
        self,
        manager: AdapterManager,
        interval: float,
        fingerprint: Fingerprinter = default_fingerprint,
    ) -> None:
        self._manager = manager
        self.interval = interval
        self._fingerprint = fingerprint
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.skipped: dict[str, tuple[str, str]] = {}  # name -> (fingerprint, reason)

    def sync(self) -> None:
        """Start watching every adapter marked follow, stop watching the others."""
        wanted = {name for name, e in self._manager.manifest.entries.items() if e.follow}
        for name in list(self._tasks):
            if name not in wanted:
                self._tasks.pop(name).cancel()
        for name in wanted - set(self._tasks):
            self._tasks[name] = asyncio.create_task(self._watch(name), name=f"follow-{name}")

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def error(self, name: str) -> str | None:
        skipped = self.skipped.get(name)
        return skipped[1] if skipped else None

    async def _watch(self, name: str) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check(name)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching whatever one poll did
                log.exception("follow: checking %s failed", name)

    async def check(self, name: str) -> bool:
        """Poll ``name``'s source once; True if a new version was swapped in."""

        entry = self._manager.manifest.entries.get(name)
        if entry is None or not entry.follow:
            return False
        origin = entry.provenance
        marker = await asyncio.to_thread(self._fingerprint, origin.source, origin.revision)
        if marker is None or marker == origin.fingerprint:
            return False
        if name in self.skipped and self.skipped[name][0] == marker:
            return False  # this version already failed; wait for the next one
        log.info("follow: %s changed at %s; updating", name, redact_urls(origin.source))
        try:
            await self._manager.put(name, origin.source, origin.revision, follow=True)
        except AdapterError as exc:
            self.skipped[name] = (marker, str(exc))
            log.warning(
                "follow: skipped a new version of %s: %s (still serving the current one)", name, exc
            )
            return False
        self.skipped.pop(name, None)
        return True
