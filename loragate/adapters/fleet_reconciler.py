"""Converging on the fleet's adapter manifest: on start, then every follow interval.

Each pass fetches the manifest and, for every adapter whose entry differs from what this
gateway serves, goes through the admin API's own path (``AdapterManager.put``: fetch, convert,
validate, store, versioned swap with no failed request); adapters the manifest no longer names
are removed. A rollback is an entry naming an earlier version again (its files are still in
the store). A version that is refused (it does not validate, the engine refuses it, its digest
is not the pinned one) is not retried until its entry changes; the current version keeps
serving and the refusal is reported. Failures that may pass (the engine restarting) are
retried on the next pass.

The manifest's revision (sha256 of its bytes) is reported twice: the latest one fetched, and
the one this gateway serves in full (every entry applied), so replicas can be compared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loragate.adapters.downloads import redact, redact_urls
from loragate.adapters.errors import AdapterError
from loragate.adapters.fleet_manifest import (
    DesiredAdapter,
    FleetManifest,
    FleetManifestError,
    fetch_fleet_manifest,
    parse_fleet_manifest,
)
from loragate.adapters.manifest import ManifestEntry

if TYPE_CHECKING:
    from loragate.adapters.manager import AdapterManager

log = logging.getLogger("loragate.adapters")

Fetcher = Callable[[str], bytes]


class FleetReconciler:
    def __init__(
        self,
        manager: AdapterManager,
        source: str,
        interval: float,
        fetch: Fetcher = fetch_fleet_manifest,
    ) -> None:
        self._manager = manager
        self.source = source
        self.interval = interval
        self._fetch = fetch
        self._applied: dict[str, DesiredAdapter] = {}
        self._refused: dict[str, DesiredAdapter] = {}
        self.errors: dict[str, str] = {}  # adapter name -> why its entry is not served
        self.manifest_error: str | None = None  # the manifest itself: unreachable, malformed
        self.latest_revision: str | None = None
        self.serving_revision: str | None = None
        self.passes = 0
        self.checked_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    # ----- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="adapters-manifest")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep converging whatever one pass did
                log.exception("adapters manifest: a pass failed")
            await asyncio.sleep(self.interval)

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
        """What /health shows (it needs no key): revisions and convergence, no sources or
        errors (those are in the admin API's ``report``)."""
        return {
            "serving_revision": self.serving_revision,
            "latest_revision": self.latest_revision,
            "converged": self.converged,
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
            manifest = parse_fleet_manifest(data)
        except FleetManifestError as exc:
            self.manifest_error = redact_urls(str(exc))
            self.checked_at = time.time()
            log.error("adapters manifest: %s (serving what was applied before)", exc)
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
                    name, desired.source, desired.revision, desired.follow, digest=desired.digest
                )
            except AdapterError as exc:
                complete = False
                self.errors[name] = redact_urls(str(exc))
                if exc.status < 500:
                    self._refused[name] = desired
                log.error("adapters manifest: %s not applied: %s", name, self.errors[name])
                continue
            self._applied[name] = desired
            self.errors.pop(name, None)
            self._refused.pop(name, None)
        for name in sorted(set(manager.manifest.entries) - set(manifest.adapters)):
            try:
                await manager.remove(name)
            except AdapterError as exc:
                complete = False
                self.errors[name] = redact_urls(str(exc))
                continue
            self._applied.pop(name, None)
        for name in set(self.errors) - set(manifest.adapters) - set(manager.manifest.entries):
            del self.errors[name]
        self._refused = {n: d for n, d in self._refused.items() if n in manifest.adapters}
        return complete

    def _serves(self, name: str, desired: DesiredAdapter) -> bool:
        """Whether ``name`` is served as ``desired`` says, without fetching anything."""
        entry = self._manager.manifest.entries.get(name)
        if entry is None or name in self._manager.failures:
            return False
        if self._applied.get(name) == desired:
            return True
        # First sight since start: what this gateway kept in its cache may be it already.
        return _entry_matches(entry, desired)


def _entry_matches(entry: ManifestEntry, desired: DesiredAdapter) -> bool:
    if entry.provenance.source != desired.source or entry.follow != desired.follow:
        return False
    if desired.revision is not None and entry.provenance.revision != desired.revision:
        return False
    return desired.digest is None or entry.active.startswith(desired.digest)
