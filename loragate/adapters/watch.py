"""Keep what is served in step with its sources and its files, in the background.

Two watchers, one idea: an adapter's served version is re-fetched through the manager's own
path (``put``: fetch, convert, validate, store, versioned swap) whenever something outside the
gateway moves it: its **source** (follow mode, ``AdapterFollower``) or its **files** in the
store (``StoreWatch``). They share the periodic loop (``loragate.periodic``, also the fleet
reconciler's) and the narrow protocol through which they reach the manager: they read the
manifest's entries and call the manager's methods, never write its attributes, and never
import it (``wiring`` hands the manager to them). They live in one module because each is a
small policy over the same two calls; the fleet reconciler, which converges on a manifest of
its own, keeps its module.

Follow mode: one task per followed adapter polls a cheap change marker (a Hugging Face commit,
an ETag, a local directory's file list and mtimes, the newest Tinker checkpoint) every
``interval``. A change goes through ``put``; a version that fails is skipped with its reason
(and not retried until the source changes again) while the current version keeps serving.

The store watch: vLLM keeps ``--max-cpu-loras`` adapters in memory and re-reads any other from
its path (a store directory) whenever a request needs it again, and adapters with the same
content share that directory. The gateway verifies a version before each load it makes, but
the engine's own reloads go unchecked; so every ``interval`` the watch looks at each adapter's
active version and, when its files changed on disk since they were last found good, verifies
them. A damaged version is stored again from the adapter's source (the same content lands in
the same place, so the engine's next reload reads good weights), and only if the source still
gives exactly that version (its digest is the pin); when the source cannot give it back, or
now holds other weights, the adapter is marked failed with the reason, for ``/health`` and the
admin API, and keeps the version it had. Checking is cheap when nothing changed: a ``stat``
per file; files are hashed only after a change of size, mtime or inode.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from loragate.adapters.errors import AdapterError
from loragate.adapters.manifest import ManifestEntry
from loragate.adapters.store import ADAPTER_FILES, AdapterStore, StoredAdapter, TamperedAdapterError
from loragate.logs import redact_urls
from loragate.periodic import PeriodicTask

log = logging.getLogger("loragate.adapters")


# ----- what the watchers ask of the manager (AdapterManager implements it) -------------------


class ServedAdapters(Protocol):
    """What the follower needs of the adapter manager: its entries, and its one way in."""

    def adapter_entries(self) -> Mapping[str, ManifestEntry]:
        """Each adapter's manifest entry (active version, where it came from, follow), live:
        copy it before awaiting anything."""
        ...

    async def put(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        *,
        digest: str | None = None,
        preset: dict[str, Any] | None = None,
    ) -> dict[str, Any]: ...


class RepairedAdapters(ServedAdapters, Protocol):
    """What the store watch needs besides: to count a repair, and to report one that failed."""

    def note_store_repair(self) -> None: ...

    def mark_failed(self, name: str, reason: str) -> None:
        """``name`` is not served as it should be, for ``reason`` (shown by /health and the
        admin API) until its next successful swap."""
        ...


# ----- follow mode ------------------------------------------------------------------------------

Fingerprinter = Callable[[str, str | None], str | None]


def default_fingerprint(source: str, revision: str | None) -> str | None:
    from loragate.adapters.intake.sources import source_fingerprint

    return source_fingerprint(source, revision)


class AdapterFollower:
    def __init__(
        self,
        adapters: ServedAdapters,
        interval: float,
        fingerprint: Fingerprinter = default_fingerprint,
    ) -> None:
        self._adapters = adapters
        self.interval = interval
        self._fingerprint = fingerprint
        self._polls: dict[str, PeriodicTask] = {}
        self.skipped: dict[str, tuple[str, str]] = {}  # name -> (fingerprint, reason)

    def sync(self) -> None:
        """Start watching every adapter marked follow, stop watching the others."""
        entries = self._adapters.adapter_entries()
        wanted = {name for name, entry in entries.items() if entry.follow}
        for name in list(self._polls):
            if name not in wanted:
                self._polls.pop(name).stop()
        for name in wanted - set(self._polls):
            poll = PeriodicTask(
                f"follow-{name}", functools.partial(self.check, name), self.interval, log=log
            )
            self._polls[name] = poll
            poll.start()

    async def aclose(self) -> None:
        polls = list(self._polls.values())
        self._polls.clear()
        await asyncio.gather(*(poll.aclose() for poll in polls))

    def error(self, name: str) -> str | None:
        skipped = self.skipped.get(name)
        return skipped[1] if skipped else None

    async def check(self, name: str) -> bool:
        """Poll ``name``'s source once; True if a new version was swapped in."""
        entry = self._adapters.adapter_entries().get(name)
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
            await self._adapters.put(
                name, origin.source, origin.revision, follow=True, preset=entry.preset
            )
        except AdapterError as exc:
            self.skipped[name] = (marker, str(exc))
            log.warning(
                "follow: skipped a new version of %s: %s (still serving the current one)", name, exc
            )
            return False
        self.skipped.pop(name, None)
        return True


# ----- the store watch ----------------------------------------------------------------------

Stamp = tuple[tuple[int, int, int], ...]


def _stamp(stored: StoredAdapter) -> Stamp | None:
    try:
        stats = [os.stat(stored.path / name) for name in ADAPTER_FILES]
    except OSError:
        return None
    return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats)


class StoreWatch:
    def __init__(self, adapters: RepairedAdapters, store: AdapterStore, interval: float) -> None:
        self._adapters = adapters
        self._store = store
        self._good: dict[str, Stamp] = {}  # digest -> file stamps when last verified good
        self._hopeless: dict[str, Stamp | None] = {}  # digest -> stamps when a restore failed
        self._loop = PeriodicTask("store-watch", self.check, interval, log=log)

    def start(self) -> None:
        self._loop.start()

    async def aclose(self) -> None:
        await self._loop.aclose()

    async def check(self) -> dict[str, str]:
        """One round; returns the adapters whose active version was damaged, with the reason."""
        store = self._store
        damaged: dict[str, str] = {}
        for name, entry in list(self._adapters.adapter_entries().items()):
            stored = store.get(entry.active)
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
                await asyncio.to_thread(store.verify, stored)
            except TamperedAdapterError as exc:
                damaged[name] = str(exc)
                if not await self._restore(name, str(exc)):
                    self._hopeless[entry.active] = stamp
                continue
            self._good[stored.digest] = stamp
        return damaged

    async def _restore(self, name: str, problem: str) -> bool:
        adapters = self._adapters
        entry = adapters.adapter_entries().get(name)
        if entry is None:
            return True
        shown = redact_urls(entry.provenance.source)
        log.error("adapter %s: %s; storing it again from %s", name, problem, shown)
        adapters.note_store_repair()
        try:
            origin = entry.provenance
            # Pinned to the damaged version's own digest: a repair restores these weights or
            # nothing. A source that moved on (a new upload, a moved tag) must not go live in
            # its place unasked, whether or not the adapter follows its source.
            await adapters.put(
                name,
                origin.source,
                origin.revision,
                follow=entry.follow,
                digest=entry.active,
                preset=entry.preset,
            )
        except AdapterError as exc:
            if exc.code == "digest_mismatch":
                why = f"the source no longer holds this version ({exc}), so nothing was swapped"
            else:
                why = f"it could not be stored again from {shown} ({exc})"
            reason = f"{problem}; {why}: PUT a good copy or roll back"
            adapters.mark_failed(name, reason)
            log.error("adapter %s: %s", name, reason)
            return False
        log.info("adapter %s: stored again from %s", name, shown)
        return True
