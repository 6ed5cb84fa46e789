"""Converging on the fleet's adapter manifest: on start, then every follow interval.

Each pass fetches the manifest and, for every adapter whose entry differs from what this
gateway serves, goes through the admin API's own path (the manager's ``put``: fetch, convert,
validate, store, versioned swap with no failed request); adapters the manifest no longer names
are removed. A rollback is an entry naming an earlier version again (its files are still in
the store). A version that is refused (it does not validate, the engine refuses it, its digest
is not the pinned one) is not retried until its entry changes; the current version keeps
serving and the refusal is reported. Failures that may pass (the engine restarting) are
retried on the next pass.

One entry never holds back the others: whatever it raises (a refusal, an ``OverflowError``
from its config, a full disk) is recorded as that entry's error and the pass goes on. A
manifest that cannot be read, or names no adapter without saying so, changes nothing (see
``fleet_manifest``), and a pass removes at most ``max_removals`` adapters: one that would
remove more removes none and says why, since a manifest cut short would otherwise empty
every replica at once.

The manifest's revision (sha256 of its bytes) is reported twice: the latest one fetched, and
the one this gateway serves in full (every entry applied), so replicas can be compared.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from loragate.adapters.errors import AdapterError
from loragate.adapters.fleet_manifest import (
    DesiredAdapter,
    FleetManifest,
    FleetManifestError,
    fetch_fleet_manifest,
    parse_fleet_manifest,
)
from loragate.adapters.manifest import ManifestEntry
from loragate.adapters.watch import ServedAdapters
from loragate.logs import redact, redact_urls
from loragate.periodic import PeriodicTask

log = logging.getLogger("loragate.adapters")

Fetcher = Callable[[str], bytes]


class FleetAdapters(ServedAdapters, Protocol):
    """What the reconciler needs of the adapter manager besides its entries and ``put``."""

    def manifest_names(self) -> set[str]:
        """Every adapter the manager holds, its manifest entry readable or not."""
        ...

    def failed_names(self) -> Collection[str]:
        """The adapters not served as their entry says (a boot or a repair that failed)."""
        ...

    async def remove(self, name: str) -> None: ...


class FleetReconciler:
    def __init__(
        self,
        manager: FleetAdapters,
        source: str,
        interval: float,
        fetch: Fetcher = fetch_fleet_manifest,
        max_removals: int = 10,
        base: str | None = None,
    ) -> None:
        self._manager = manager
        self.source = source
        self.base = base  # a catalog's model: its part of a per-base-model manifest
        self.max_removals = max_removals
        self._fetch = fetch
        self._applied: dict[str, DesiredAdapter] = {}
        self._refused: dict[str, DesiredAdapter] = {}
        self.errors: dict[str, str] = {}  # adapter name -> why its entry is not served
        self.manifest_error: str | None = None  # the manifest itself: unreachable, malformed
        self.latest_revision: str | None = None
        self.serving_revision: str | None = None
        self.passes = 0
        self.checked_at: float | None = None
        self._loop = PeriodicTask(
            "adapters-manifest", self.reconcile, interval, first_at_once=True, log=log
        )

    # ----- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    async def aclose(self) -> None:
        await self._loop.aclose()

    # ----- what /health and the admin API report -------------------------------------------

    @property
    def applied_once(self) -> bool:
        """Whether one pass has gone through the whole manifest (ready to serve it)."""
        return self.passes > 0

    @property
    def converged(self) -> bool:
        return (
            self.latest_revision is not None
            and self.serving_revision == self.latest_revision
            and self.manifest_error is None
        )

    def summary(self) -> dict[str, Any]:
        """What /health shows (it needs no key): revisions, convergence and why the manifest
        is not applied, if it is not (its source redacted); no sources or per-adapter errors
        (those are in the admin API's ``report``)."""
        return {
            "serving_revision": self.serving_revision,
            "latest_revision": self.latest_revision,
            "converged": self.converged,
            "error": self.manifest_error,
        }

    def report(self) -> dict[str, Any]:
        return {
            "source": redact(self.source),
            "serving_revision": self.serving_revision,
            "latest_revision": self.latest_revision,
            "converged": self.converged,
            "error": self.manifest_error,
            "adapter_errors": dict(self.errors),
            "checked_at": self.checked_at,
        }

    # ----- one pass ---------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Fetch the manifest and bring this gateway's adapters to it."""
        try:
            data = await asyncio.to_thread(self._fetch, self.source)
            manifest = parse_fleet_manifest(data, self.base)
        except Exception as exc:  # unreadable, whatever the reason: nothing changes
            why = (
                str(exc) if isinstance(exc, FleetManifestError) else f"{type(exc).__name__}: {exc}"
            )
            self.manifest_error = redact_urls(why)
            self.checked_at = time.time()
            log.error(
                "adapters manifest: %s (serving what was applied before)", self.manifest_error
            )
            return
        self.manifest_error = None
        if manifest.revision != self.latest_revision:
            log.info("adapters manifest %s: revision %s", redact(self.source), manifest.revision)
        self.latest_revision = manifest.revision
        complete = await self._apply(manifest)
        if complete:
            self.serving_revision = manifest.revision
        self.checked_at = time.time()
        self.passes += 1

    async def _apply(self, manifest: FleetManifest) -> bool:
        manager = self._manager
        complete = True
        for name, desired in manifest.adapters.items():
            if self._serves(name, desired):
                self._applied[name] = desired
                self.errors.pop(name, None)
                self._refused.pop(name, None)
                continue
            if self._refused.get(name) == desired:
                complete = False  # refused before, unchanged since: not tried again
                continue
            try:
                await manager.put(
                    name,
                    desired.source,
                    desired.revision,
                    desired.follow,
                    digest=desired.digest,
                    preset=desired.preset,
                )
            except Exception as exc:
                complete = False
                self.errors[name], refused = _failure(exc)
                if refused:
                    self._refused[name] = desired
                log.error("adapters manifest: %s not applied: %s", name, self.errors[name])
                continue
            self._applied[name] = desired
            self.errors.pop(name, None)
            self._refused.pop(name, None)
        gone = sorted(manager.manifest_names() - set(manifest.adapters))
        if len(gone) > self.max_removals:
            complete = False
            self.manifest_error = (
                f"the manifest would remove {len(gone)} adapters in one pass ({', '.join(gone)}), "
                f"more than fleet_max_removals ({self.max_removals}): none removed. Remove fewer "
                "at a time, or raise LORAGATE_FLEET_MAX_REMOVALS"
            )
            log.error("adapters manifest: %s", self.manifest_error)
            gone = []
        for name in gone:
            try:
                await manager.remove(name)
            except Exception as exc:
                complete = False
                self.errors[name] = _failure(exc)[0]
                log.error("adapters manifest: %s not removed: %s", name, self.errors[name])
                continue
            self._applied.pop(name, None)
        for name in set(self.errors) - set(manifest.adapters) - set(manager.adapter_entries()):
            del self.errors[name]
        self._refused = {n: d for n, d in self._refused.items() if n in manifest.adapters}
        return complete

    def _serves(self, name: str, desired: DesiredAdapter) -> bool:
        """Whether ``name`` is served as ``desired`` says, without fetching anything."""
        entry = self._manager.adapter_entries().get(name)
        if entry is None or name in self._manager.failed_names():
            return False
        if self._applied.get(name) == desired:
            return True
        # First sight since start: what this gateway kept in its cache may be it already.
        return _entry_matches(entry, desired)


def _failure(exc: Exception) -> tuple[str, bool]:
    """What to report of ``exc``, raised applying one entry, and whether it is a refusal (not
    tried again until the entry changes) rather than a failure that may pass (engine
    restarting, disk full: tried again next pass)."""
    if isinstance(exc, AdapterError):
        return redact_urls(str(exc)), exc.status < 500
    log.error("adapters manifest: unexpected error applying an entry", exc_info=exc)
    return redact_urls(f"{type(exc).__name__}: {exc}"), not isinstance(exc, OSError)


def _entry_matches(entry: ManifestEntry, desired: DesiredAdapter) -> bool:
    if entry.provenance.source != desired.source or entry.follow != desired.follow:
        return False
    if entry.preset != desired.preset:
        return False
    if desired.revision is not None and entry.provenance.revision != desired.revision:
        return False
    return desired.digest is None or entry.active.startswith(desired.digest)
