"""The adapter manager: desired state, versioned hot-swap, and the routing the gateway asks for.

Each adapter version is loaded into the engine under its own engine id (``name@<hash12>``);
the public name routes to the active one. A swap loads the new version first, then flips the
route, then unloads the old version once its in-flight requests have drained, so no request
fails or moves between versions (the engine side of it: ``engine_versions``). Operations on
one name are serialized; a failure before the flip changes nothing, and so does a manifest
that cannot be saved (the version just loaded is unloaded, the route stays). Base-model
requests can be routed through an all-zero adapter (see ``zero_adapter``) so that no request
ever runs without a LoRA slot on the CPU build.

One adapter never takes the others down: each manifest entry (and each ``--lora``) is
applied on its own at boot and after an engine restart, and whatever goes wrong with it (an
unreadable entry, a refusal, an unexpected exception) becomes that adapter's ``failures``
entry, shown in ``GET /admin/adapters`` and ``/health``.

A version's preset (``preset``) is part of it: stored with its weights, loaded under its own
engine id, routed with it (``RoutingTable.preset_of``), swapped and rolled back with it. A
preset given to ``put`` is checked before anything is fetched (a bad one changes nothing) and
kept in the manifest entry, so following the source or repairing the version gives it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from loragate.adapters.engine_versions import EngineVersions, engine_id
from loragate.adapters.errors import AdapterError, disk_error
from loragate.adapters.intake.pipeline import PreparedVersion
from loragate.adapters.manifest import Manifest, ManifestEntry
from loragate.adapters.names import InvalidAdapterName, validate_adapter_name
from loragate.adapters.preset import ParameterRules, Preset, PresetError
from loragate.adapters.provenance import Provenance
from loragate.adapters.routing import RoutingTable
from loragate.adapters.stats import AdapterStats
from loragate.adapters.store import AdapterStore, TamperedAdapterError
from loragate.adapters.watch import AdapterFollower, StoreWatch
from loragate.adapters.zero_adapter import write_zero_adapter
from loragate.engine_states import EngineState
from loragate.fetching.progress import ProgressBoard
from loragate.logs import redact_urls
from loragate.supervisor.client import EngineClient, EngineRefused
from loragate.supervisor.engine import EngineSupervisor, EngineUnavailable

log = logging.getLogger("loragate.adapters")

ZERO_ADAPTER_NAME = "__base__"


# (source, revision[, preset]): the preset is passed only when the change gives one, else the
# source's own (its ``loragate.json``) applies.
Preparer = Callable[..., Awaitable[PreparedVersion]]


def _check_pin(prepared: PreparedVersion, digest: str | None) -> None:
    if digest is not None and not prepared.stored.digest.startswith(digest):
        raise AdapterError(
            f"{redact_urls(prepared.provenance.source)} is version "
            f"{prepared.stored.digest[:12]}, not the pinned {digest}",
            status=409,
            code="digest_mismatch",
        )


class AdapterManager:
    def __init__(
        self,
        *,
        store: AdapterStore,
        manifest: Manifest,
        engine: EngineClient,
        supervisor: EngineSupervisor,
        base_name: str,
        base_config: dict[str, Any],
        prepare: Preparer,
        zero_adapter_root: Path | None,
        drain_timeout: float = 30.0,
        ready_timeout: float = 900.0,
        preset_rules: ParameterRules | None = None,
        base_preset: Preset | None = None,
    ) -> None:
        self.store = store
        self.preset_rules = preset_rules
        self.base_preset = base_preset
        self.manifest = manifest
        self.base_name = base_name
        self._prepare = prepare
        self.routes = RoutingTable()
        self._public: tuple[str, ...] = ()
        self._public_for: tuple[str, ...] | None = None
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.failures: dict[str, str] = {}
        self.counters: defaultdict[str, int] = defaultdict(int)
        self._supervisor = supervisor
        # A catalog's model: while its engine is stopped or stopping (cold), a new version is
        # stored and recorded, and loaded by the engine's next boot, instead of waiting for it.
        self.declare_while_stopped = False
        self.engine_versions = EngineVersions(
            store=store,
            engine=engine,
            supervisor=supervisor,
            routes=self.routes,
            locks=self._locks,
            counters=self.counters,
            drain_timeout=drain_timeout,
            ready_timeout=ready_timeout,
        )
        self.progress = ProgressBoard()  # how far each add has come (admin API, status page)
        self._zero_dir: Path | None = None
        self.base_engine_id = base_name
        if zero_adapter_root is not None:
            digest = hashlib.sha256(json.dumps(base_config, sort_keys=True).encode()).hexdigest()
            self._zero_dir = write_zero_adapter(base_config, zero_adapter_root / digest[:16])
            self.base_engine_id = engine_id(ZERO_ADAPTER_NAME, digest)
        self.routes.route(base_name, self.base_engine_id, base_preset)
        for name, (why, _) in manifest.unreadable.items():
            self.failures[name] = (
                f"its entry in the adapter manifest {manifest.path} cannot be read ({why}); "
                "PUT the adapter again or DELETE it"
            )
        # Given by ``watch_with`` (``wiring`` builds them); until then nothing watches.
        self.follower: AdapterFollower | _Unwatched = _Unwatched()
        self.store_watch: StoreWatch | _Unwatched = _Unwatched()

    def watch_with(self, follower: AdapterFollower, store_watch: StoreWatch) -> None:
        """Have ``follower`` told of each change of what is followed and ``describe`` show its
        errors; both close with the manager. Built in ``wiring`` on this manager: they reach it
        through the protocols of ``watch``, and it only starts and stops them."""
        self.follower, self.store_watch = follower, store_watch

    # ----- what the watchers ask (the protocols of ``watch`` and ``fleet_reconciler``) -------

    def adapter_entries(self) -> Mapping[str, ManifestEntry]:
        return self.manifest.entries

    def manifest_names(self) -> set[str]:
        return set(self.manifest.entries) | set(self.manifest.unreadable)

    def failed_names(self) -> Collection[str]:
        return self.failures.keys()

    def note_store_repair(self) -> None:
        self.counters["store_repairs"] += 1

    def mark_failed(self, name: str, reason: str) -> None:
        self.failures[name] = reason

    # ----- what the gateway asks -----------------------------------------------------------

    def public_models(self) -> list[str]:
        """The base model, then the adapters by name (asked per request: cached per route set)."""
        names = self.routes.public_names()
        if self._public_for is not names:
            self._public = (self.base_name, *sorted(n for n in names if n != self.base_name))
            self._public_for = names
        return list(self._public)

    def stats(self, store_bytes: int | None) -> AdapterStats:
        """The counters now; ``store_bytes`` from ``store_size`` (which reads the disk)."""
        count = self.counters
        return AdapterStats(
            loads=count["loads"],
            swaps=count["swaps"],
            load_failures=count["load_failures"],
            unloads=count["unloads"],
            store_repairs=count["store_repairs"],
            last_load_seconds=self.engine_versions.last_load_seconds,
            served=max(0, len(self.public_models()) - 1),
            store_bytes=store_bytes,
            store_evictions=self.store.evictions,
        )

    def store_size(self) -> int | None:
        """Bytes the store holds (reads each version's metadata: call it off the loop)."""
        try:
            return self.store.total_bytes()
        except OSError as exc:
            log.warning("could not size the adapter store: %s", exc)
            return None

    def acquire(self, public: str) -> str | None:
        """The engine id serving ``public`` now, leased until ``release``; None if unknown."""
        return self.routes.acquire(public)

    def release(self, engine_id_: str) -> None:
        self.routes.release(engine_id_)

    def preset_of(self, engine_id_: str | None) -> Preset | None:
        """The preset of the version a request leased (``acquire``); None: it has none (or
        the request names no model)."""
        return self.routes.preset_of(engine_id_) if engine_id_ is not None else None

    def model_preset(self, public: str) -> dict[str, Any] | None:
        """The preset of the version serving ``public`` now, as JSON (``/v1/models/{id}``)."""
        engine_id_ = self.routes.get(public)
        preset = self.routes.preset_of(engine_id_) if engine_id_ is not None else None
        return preset.to_dict() if preset else None

    @property
    def all_loaded(self) -> bool:
        # The base model itself needs no loading.
        served = self.engine_versions.loaded | {self.base_name}
        return not self.failures and self.routes.engine_ids() <= served

    # ----- what the supervisor asks ----------------------------------------------------------

    def boot_modules(self) -> dict[str, Path]:
        """Engine ids and paths to pass as ``--lora-modules`` at the next boot (verified first)."""
        modules: dict[str, Path] = {}
        if self._zero_dir is not None:
            modules[self.base_engine_id] = self._zero_dir
        for entry in self.manifest.entries.values():
            try:
                stored = self.store.get(entry.active)
                if stored is None:
                    continue
                self.store.verify(stored)
            except (TamperedAdapterError, OSError) as exc:
                # Not passed at boot; on_engine_ready tries it again and reports why not.
                log.error("not loading adapter %s at boot: %s", entry.name, exc)
                continue
            modules[engine_id(entry.name, entry.active)] = stored.path
        return modules

    async def on_engine_ready(self) -> None:
        """Re-apply the desired state to a freshly booted engine (ready hook)."""
        versions = self.engine_versions
        await versions.adopt_served(self.base_name)
        if self._zero_dir is not None:
            await versions.load_at_boot(self.base_engine_id, self._zero_dir)
        for entry in list(self.manifest.entries.values()):
            eid = engine_id(entry.name, entry.active)
            try:
                if eid not in versions.loaded:
                    stored = await versions.verified(entry.active)
                    await versions.load_at_boot(eid, stored.path)
                    preset = stored.preset
                else:  # the engine kept it: its preset as stored (checked when it loaded)
                    preset = self._stored_preset(entry.active)
                self.routes.route(entry.name, eid, preset)
                self.failures.pop(entry.name, None)
            except (AdapterError, EngineRefused, EngineUnavailable) as exc:
                self.failures[entry.name] = redact_urls(str(exc))
                log.error("could not re-apply adapter %s: %s", entry.name, exc)
            except Exception as exc:  # one adapter's bug must not fail the engine's boot
                self.failures[entry.name] = redact_urls(f"{type(exc).__name__}: {exc}")
                log.exception("could not re-apply adapter %s", entry.name)

    # ----- admin operations -------------------------------------------------------------------

    async def declare_all(self, adapters: list[tuple[str, str]]) -> None:
        """``declare`` each (name, source) on its own: one that fails (logged, and kept in
        ``failures``, so /health says why) does not stop the others; an entry from an
        earlier run keeps serving meanwhile."""
        for name, source in adapters:
            try:
                await self.declare(name, source)
            except Exception as exc:
                why = str(exc) if isinstance(exc, AdapterError) else f"{type(exc).__name__}: {exc}"
                self.failures[name] = redact_urls(why)
                log.error("boot adapter %s not prepared: %s", name, self.failures[name])

    async def declare(self, name: str, source: str, revision: str | None = None) -> None:
        """Make ``source`` the desired version of ``name`` before the engine boots (boot adapters)."""
        self._check_name(name)
        prepared = await self._prepare(source, revision)
        entry = self.manifest.entries.get(name)
        if entry is not None and entry.active == prepared.stored.digest:
            return
        self.manifest.entries[name] = ManifestEntry(
            name=name,
            active=prepared.stored.digest,
            provenance=prepared.provenance,
            previous=entry.active if entry else None,
        )
        self._save(name, entry)
        self.failures.pop(name, None)

    async def put(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        *,
        digest: str | None = None,
        preset: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Add or update ``name`` from ``source``; returns once the new version serves.

        ``digest``: a prefix of the sha256 the version must have (a pin), checked before swap.
        ``preset``: the version's preset (``{}``: none); None: the source's ``loragate.json``'s.
        """
        self._check_name(name)
        checked = self._checked_preset(preset)
        with self.progress.track(name, redact_urls(source), redact=redact_urls):
            async with self._locks[name]:
                try:
                    if checked is None:
                        prepared = await self._prepare(source, revision)
                    else:
                        prepared = await self._prepare(source, revision, checked)
                    _check_pin(prepared, digest)
                except AdapterError:
                    self.counters["load_failures"] += 1
                    raise
                await self._activate(name, prepared, follow=follow, preset=preset)
        self.follower.sync()
        return self.describe(name)

    async def rollback(self, name: str) -> dict[str, Any]:
        """Serve the previous version of ``name`` again, with the same guarantees as ``put``."""
        self._check_name(name)
        async with self._locks[name]:
            entry = self.manifest.entries.get(name)
            if entry is None:
                raise AdapterError(
                    f"no adapter named {name!r}", status=404, code="adapter_not_found"
                )
            if entry.previous is None:
                raise AdapterError(f"adapter {name!r} has no previous version to roll back to", 409)
            stored = await self.engine_versions.verified(entry.previous)
            # Where the version came from, as stored with it (the manifest only keeps the
            # active version's); hashed just now, so it loads without hashing again.
            provenance = stored.provenance or Provenance(entry.provenance.source)
            prepared = PreparedVersion(stored, provenance, verified=True)
            preset = stored.preset
            await self._activate(
                name, prepared, follow=entry.follow, preset=preset.to_dict() if preset else None
            )
            return self.describe(name)

    async def remove(self, name: str) -> None:
        """Stop routing to ``name`` now; unload it once in-flight requests finish. Cache kept."""
        self._check_name(name)
        async with self._locks[name]:
            entry = self.manifest.entries.get(name)
            unreadable = self.manifest.unreadable.pop(name, None)
            if entry is None and unreadable is None:
                raise AdapterError(
                    f"no adapter named {name!r}", status=404, code="adapter_not_found"
                )
            self.manifest.entries.pop(name, None)
            try:
                self._save(name, entry)
            except AdapterError:
                if unreadable is not None:
                    self.manifest.unreadable[name] = unreadable
                raise
            old = self.routes.drop(name)
            self.failures.pop(name, None)
            if old is not None:
                self.engine_versions.retire(name, old)
        self.follower.sync()

    def describe(self, name: str) -> dict[str, Any]:
        if name not in self.manifest.entries and name in self.manifest.unreadable:
            return _unreadable_entry(name, self.failures.get(name))
        entry = self.manifest.entries[name]
        stored = self.store.get(entry.active)
        preset = self._stored_preset(entry.active)
        eid = engine_id(name, entry.active)
        if name in self.failures:
            state = "failed"
        elif self.routes.get(name) == eid and eid in self.engine_versions.loaded:
            state = "ready"
        else:
            state = "loading"
        return {
            "name": name,
            "version": entry.active,
            "previous_version": entry.previous,
            "source": redact_urls(entry.provenance.source),
            "revision": entry.provenance.revision,
            "follow": entry.follow,
            "rank": stored.meta.get("rank") if stored else None,
            "size_bytes": stored.size if stored else None,
            "preset": preset.to_dict() if preset else None,
            "state": state,
            "error": self.failures.get(name),
            "follow_error": self.follower.error(name),
            "loaded_at": entry.loaded_at,
        }

    def list(self) -> list[dict[str, Any]]:
        return [self.describe(name) for name in sorted(self.manifest_names())]

    async def aclose(self) -> None:
        await self.follower.aclose()
        await self.store_watch.aclose()
        await self.engine_versions.aclose()

    # ----- internals ----------------------------------------------------------------------------

    def _check_name(self, name: str) -> None:
        try:
            validate_adapter_name(name)
        except InvalidAdapterName as exc:
            raise AdapterError(str(exc), code="invalid_adapter_name") from None
        if name == self.base_name:
            raise AdapterError(f"{name!r} is the base model's name; choose another adapter name")

    def _save(self, name: str, previous_entry: ManifestEntry | None) -> None:
        """Save the manifest after a change to ``name``; when that fails (a full disk, a
        read-only directory) ``name`` is put back as ``previous_entry`` (None: absent) and an
        ``AdapterError`` says why: memory never runs ahead of the file."""
        try:
            self.manifest.save()
        except OSError as exc:
            if previous_entry is None:
                self.manifest.entries.pop(name, None)
            else:
                self.manifest.entries[name] = previous_entry
            log.error("could not save the adapter manifest %s: %s", self.manifest.path, exc)
            raise disk_error(exc, f"saving the adapter manifest for {name!r}") from None

    def _stored_preset(self, digest: str) -> Preset | None:
        kept = self.store.get(digest)
        try:
            return kept.preset if kept is not None else None
        except PresetError:
            return None

    def _checked_preset(self, preset: dict[str, Any] | None) -> Preset | None:
        """``preset`` checked against the parameter rules, before anything is fetched."""
        if preset is None:
            return None
        try:
            return Preset.from_dict(preset, self.preset_rules)
        except PresetError as exc:
            raise AdapterError(str(exc), code="invalid_preset") from None

    async def _activate(
        self,
        name: str,
        prepared: PreparedVersion,
        follow: bool,
        preset: dict[str, Any] | None = None,
    ) -> None:
        """Load ``prepared`` under its own engine id, flip the route, retire the old version;
        for a cold catalog model, only record it (its next boot loads it)."""
        digest = prepared.stored.digest
        eid = engine_id(name, digest)
        stored = await self.engine_versions.verified(digest, hash_files=not prepared.verified)
        newly_loaded = eid not in self.engine_versions.loaded
        cold = await self._load_unless_cold(eid, stored.path)
        previous_entry = self.manifest.entries.get(name)
        old_eid = self.routes.get(name) if name in self.routes.public_names() else None
        if previous_entry is not None and previous_entry.active != digest:
            previous_digest: str | None = previous_entry.active
        else:
            previous_digest = previous_entry.previous if previous_entry else None
        self.manifest.entries[name] = ManifestEntry(
            name=name,
            active=digest,
            provenance=prepared.provenance,
            previous=previous_digest,
            follow=follow,
            loaded_at=time.time(),
            preset=preset,
        )
        try:
            self._save(name, previous_entry)
        except AdapterError:
            # What is on disk still names the old version: so does the route, and the version
            # loaded just now for this swap leaves the engine again.
            if newly_loaded and not cold and eid not in self.routes.engine_ids():
                await self.engine_versions.unload_unused(eid)
            raise
        if cold:
            self.failures.pop(name, None)
            return
        self.routes.route(name, eid, stored.preset)
        self.failures.pop(name, None)
        if old_eid is not None and old_eid != eid:
            self.counters["swaps"] += 1
            self.engine_versions.retire(name, old_eid)
        # Store bookkeeping reads and writes files (eviction: every version's metadata).
        await asyncio.to_thread(self.store.touch, stored)
        await asyncio.to_thread(self.store.evict, self.manifest.versions_in_use())

    async def _load_unless_cold(self, eid: str, path: Path) -> bool:
        """Load ``eid`` for a swap; True, loading nothing, when a catalog model's engine is
        stopped or stopping (cold: its next boot loads what the manifest names).

        Never into an asleep engine (a catalog model's, by vLLM's sleep mode): the LoRA slots
        live in the weights pool that sleep unmapped (``EngineSupervisor.asleep`` cites vLLM),
        so a load would crash the engine or be overwritten by the wake. The load waits for the
        wake (a request for the model wakes it), or for the engine to stop (then it is cold),
        and a sleep waits for a load under way. A change from ``follow``, the store watch or the
        adapters manifest waits so; the admin API wakes the model first, as it boots a cold
        one."""
        supervisor = self._supervisor
        cold = (EngineState.STOPPED, EngineState.STOPPING)
        while not (self.declare_while_stopped and supervisor.state in cold):
            async with supervisor.kept_awake() as awake:
                if awake:
                    await self.engine_versions.load(eid, path)
                    return False
            log.info("adapter %s waits for its engine's wake to be loaded", eid)
            await supervisor.until_awake()
        return True


class _Unwatched:
    """The watchers of a manager that none were given (one a test builds): nothing is
    followed or checked, and no follow error is shown."""

    def sync(self) -> None:
        pass

    def start(self) -> None:
        pass

    def error(self, name: str) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


def _unreadable_entry(name: str, error: str | None) -> dict[str, Any]:
    """What ``describe`` says of a manifest entry that could not be read: failed, and why."""
    return {
        "name": name,
        "version": None,
        "previous_version": None,
        "source": None,
        "revision": None,
        "follow": False,
        "rank": None,
        "size_bytes": None,
        "preset": None,
        "state": "failed",
        "error": error,
        "follow_error": None,
        "loaded_at": None,
    }
