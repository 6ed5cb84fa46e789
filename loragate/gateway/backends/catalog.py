"""A catalog of base models behind one gateway: each its own supervised engine and adapters,
booted when a request first needs it, within ``max_loaded_models`` and ``memory_budget``.

Every model of ``Settings.models`` is a ``SupervisedEngineBackend`` of its own (its cache and
state under ``CACHE_DIR/models/ID``: store, manifest, engine socket and log), prepared at start
(model resolved, adapters declared) and booted on demand, or at start with ``preload``. A
request for a cold model makes room first: the least recently used resident engines that
are idle are unloaded (never one with requests in flight or waiting: those drain first,
within the queue deadline; never one marked ``keep``), then the model boots while its requests wait in
its engine's queue as during a restart (bounded, with the queue deadline and ``Retry-After``).
An engine idle for its ``ttl`` is unloaded. An adapter name no model has registered is looked
for in the models' ``adapter_dir`` and, when one holds it, added to that model through the same
pipeline and store as the admin API; nothing else is fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.responses import Response

from loragate.adapters.names import InvalidAdapterName, validate_adapter_name
from loragate.gateway.backends.base import EngineCall
from loragate.gateway.backends.engine_metrics import merge_catalog_metrics
from loragate.gateway.backends.supervised import SupervisedEngineBackend
from loragate.gateway.errors import OpenAIError, model_not_found
from loragate.logs import redact_urls
from loragate.settings import Settings
from loragate.settings.catalog import CatalogModel
from loragate.supervisor.command import engine_base_env
from loragate.supervisor.spare import spare_engines
from loragate.supervisor.states import EngineSnapshot, EngineState

log = logging.getLogger("loragate.gateway")

RESIDENT, LOADING, ASLEEP, COLD, FAILED = "resident", "loading", "asleep", "cold", "failed"
_TTL_CHECK_SECONDS = 5.0
# How long a name no resolver had stays a plain 404, without asking the resolvers again.
_MISSING_FOR_SECONDS = 60.0
# States of an engine that is up or coming up: a request for it goes straight to it.
_RUNNING = frozenset(
    {EngineState.STARTING, EngineState.RESTARTING, EngineState.READY, EngineState.UNHEALTHY}
)


def _is_adapter_name(name: str) -> bool:
    try:
        validate_adapter_name(name)
    except InvalidAdapterName:
        return False
    return True


def model_settings(settings: Settings, model_id: str, entry: CatalogModel) -> Settings:
    """The settings one catalog model runs with: the gateway's, with the entry's model,
    adapters and engine flags, under a cache and state directory of its own."""
    cache_dir = settings.cache_dir.expanduser().resolve() / "models" / model_id
    state_dir = (settings.state_dir or settings.cache_dir).expanduser().resolve()
    return settings.model_copy(
        update={
            "models": {},
            "model": entry.model,
            "model_name": model_id,
            "lora": list(entry.lora),
            "engine_args": [*settings.engine_args, *entry.engine_args],
            "cache_dir": cache_dir,
            "state_dir": state_dir / "models" / model_id,
        }
    )


@dataclass
class CatalogEntry:
    id: str
    spec: CatalogModel
    backend: SupervisedEngineBackend
    loads: int = 0
    unloads: int = 0
    # Requests past the room check and not yet handed to the engine (waiting for its boot):
    # an engine is idle, and may be unloaded, only with none of these and none in flight.
    wanted: int = 0
    # Set while a request makes room for this model and boots it: later ones wait on it.
    pending_load: asyncio.Future[None] | None = None
    # Unloaded by vLLM's sleep mode: the engine runs, its weights in host memory.
    asleep: bool = False
    wakes: int = 0

    def __post_init__(self) -> None:
        self.backend.sleep_mode = self.spec.sleep
        self.backend.fleet_part = self.id
        self.backend.supervisor.add_listener(self._engine_changed)

    def _engine_changed(self, state: EngineState, reason: str) -> None:
        if state not in (EngineState.READY, EngineState.UNHEALTHY):
            self.asleep = False  # a new boot, or none: awake (or gone) either way

    last_unload_reason: str | None = None

    @property
    def state(self) -> EngineState:
        return self.backend.supervisor.state

    @property
    def residency(self) -> str:
        if self.backend.prepare_error is not None or self.state == EngineState.FAILED:
            return FAILED
        if self.state in (EngineState.READY, EngineState.UNHEALTHY):
            return ASLEEP if self.asleep else RESIDENT
        if self.state == EngineState.STOPPED and self.backend.prepared:
            return COLD
        return LOADING

    @property
    def idle(self) -> bool:
        return self.wanted == 0 and self.backend.in_flight == 0

    @property
    def holds_memory(self) -> bool:
        """Whether its engine runs awake (or is about to): it counts against the budget."""
        return self.state not in (EngineState.STOPPED, EngineState.FAILED) and not self.asleep

    @property
    def takes_requests(self) -> bool:
        """Up or coming up, and awake: a request for it goes straight to its engine."""
        return self.state in _RUNNING and not self.asleep


class CatalogBackend:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # One spare engine for whichever model boots next (loragate.supervisor.spare).
        self.spares = spare_engines(settings, models=len(settings.models))
        self.entries = {
            model_id: CatalogEntry(
                model_id,
                entry,
                SupervisedEngineBackend(
                    model_settings(settings, model_id, entry),
                    notify_systemd=False,
                    spares=self.spares,
                ),
            )
            for model_id, entry in settings.models.items()
        }
        self.memory_budget: int | None = (
            int(settings.memory_budget) if settings.memory_budget is not None else None
        )
        self.swaps = 0
        self.last_swap: dict[str, Any] | None = None
        self._room = asyncio.Lock()  # one residency change at a time
        self._resolving: dict[str, asyncio.Task[CatalogEntry]] = {}
        self._missing: dict[str, float] = {}  # name -> until when no resolver is asked for it
        self._ttl_task: asyncio.Task[None] | None = None
        self._preloads: set[asyncio.Task[None]] = set()

    # ----- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        for entry in self.entries.values():
            await entry.backend.start(boot=False)
        if self.memory_budget is None:
            self.memory_budget = await asyncio.to_thread(_measured_budget)
        for entry in self.entries.values():
            if entry.spec.preload:
                task = asyncio.create_task(self._preload(entry), name=f"preload-{entry.id}")
                self._preloads.add(task)
                task.add_done_callback(self._preloads.discard)
        if self.spares is not None and not self._preloads:
            # Nothing boots now: the first request's model takes the spare.
            self.spares.replenish(engine_base_env())
        self._ttl_task = asyncio.create_task(self._unload_idle(), name="catalog-ttl")

    async def stop(self) -> None:
        if self._ttl_task is not None:
            self._ttl_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ttl_task
        for task in [*self._resolving.values(), *self._preloads]:
            task.cancel()
        await asyncio.gather(*(entry.backend.stop() for entry in self.entries.values()))

    async def _preload(self, entry: CatalogEntry) -> None:
        try:
            await self.make_resident(entry, "preload")
        except OpenAIError as exc:
            log.warning("model %s: not preloaded: %s", entry.id, exc.message)

    # ----- which model serves a name ------------------------------------------------------

    def model_ids(self) -> list[str]:
        return [name for entry in self.entries.values() for name in entry.backend.servable_models()]

    def model_entries(self) -> list[dict[str, Any]]:
        """``/v1/models``'s entries: every base and adapter, adapters with their ``parent``,
        each with its base's ``residency``."""
        found = []
        for entry in self.entries.values():
            for name in entry.backend.servable_models():
                parent = None if name == entry.id else entry.id
                found.append({"id": name, "parent": parent, "residency": entry.residency})
        return found

    def owner(self, name: str) -> CatalogEntry | None:
        for entry in self.entries.values():
            if name in entry.backend.servable_models():
                return entry
        return None

    def model_preset(self, name: str) -> dict[str, Any] | None:
        """``/v1/models/{id}``'s preset: asked of the model that serves ``name``."""
        entry = self.owner(name)
        return entry.backend.model_preset(name) if entry is not None else None

    def resolves(self, name: str) -> bool:
        """Whether an unregistered ``name`` may be found in a place the operator configured:
        an adapter folder of a model's ``adapter_dir``, or any model with ``resolvers`` (tried
        in order when a request comes; a name none of them had is not tried again for a
        while)."""
        if not _is_adapter_name(name) or self._missing.get(name, 0) > time.monotonic():
            return False
        return bool(self._places_for(name))

    def _places_for(self, name: str) -> list[tuple[CatalogEntry, str]]:
        """Where ``name`` may be, in order: each model's ``adapter_dir`` folder that exists,
        then each model's resolvers."""
        folders, remote = [], []
        for entry in self.entries.values():
            folder = entry.spec.adapter_dir
            if folder is not None and (folder.expanduser() / name).is_dir():
                folders.append((entry, str(folder.expanduser() / name)))
            for place in entry.spec.resolvers:
                source = place + name if place.startswith("hf://") else place
                remote.append((entry, source.replace("{name}", quote(name, safe=""))))
        return folders + remote

    async def _owner_for(self, name: str) -> CatalogEntry:
        entry = self.owner(name)
        if entry is not None:
            return entry
        if not self.resolves(name):
            raise model_not_found(name, self.model_ids())
        task = self._resolving.get(name)
        if task is None:  # one search per name; concurrent requests for it wait on the same one
            task = asyncio.create_task(self._find(name), name=f"resolve-{name}")
            self._resolving[name] = task
            task.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(task)

    async def _find(self, name: str) -> CatalogEntry:
        """Add ``name`` from the first place that has it, through the admin API's pipeline."""
        tried = []
        for entry, source in self._places_for(name):
            await self.make_resident(entry, f"adapter {name} requested")
            await entry.backend.wait_until_prepared()
            log.info("model %s: looking for adapter %s at %s", entry.id, name, redact_urls(source))
            try:
                # An operator's place (adapter_dir, resolvers): read wherever it is.
                await entry.backend.put_adapter(name, source, local_roots=None)
            except OpenAIError as exc:
                tried.append(f"{redact_urls(source)}: {exc.message}")
                continue
            return entry
        self._missing[name] = time.monotonic() + _MISSING_FOR_SECONDS
        log.info("adapter %s found nowhere: %s", name, "; ".join(tried))
        missing = model_not_found(name, self.model_ids())
        missing.message += " Looked for it at: " + "; ".join(tried)
        raise missing

    # ----- residency ----------------------------------------------------------------------

    async def make_resident(self, entry: CatalogEntry, reason: str) -> None:
        """Boot ``entry``'s engine if it is cold, unloading idle ones first to make room.

        Requests for a model whose load is under way wait for that load instead of queueing
        for the room again, so a burst for one model costs one boot, not one per request."""
        if entry.takes_requests or entry.residency == FAILED:
            return
        if entry.pending_load is not None:
            await asyncio.shield(entry.pending_load)
            return
        async with self._room:  # an unload in progress (STOPPING) ends first
            if entry.takes_requests or entry.residency == FAILED:
                return
            entry.pending_load = asyncio.get_running_loop().create_future()
            try:
                evicted = await self._make_room_for(entry)
                if evicted:
                    self.swaps += 1
                    self.last_swap = {
                        "loaded": entry.id,
                        "unloaded": evicted,
                        "at": time.time(),
                        "reason": reason,
                    }
                if entry.asleep:
                    log.info("model %s: waking up (%s)", entry.id, reason)
                    await entry.backend.engine.wake_up()
                    entry.asleep = False
                    entry.wakes += 1
                else:
                    log.info("model %s: loading (%s)", entry.id, reason)
                    entry.loads += 1
                    await entry.backend.load(f"loaded on demand: {reason}")
            except BaseException as exc:
                entry.pending_load.set_exception(exc)
                entry.pending_load.exception()  # retrieved: no "never retrieved" warning
                raise
            else:
                entry.pending_load.set_result(None)
            finally:
                entry.pending_load = None

    def _fits(self, entry: CatalogEntry, resident: list[CatalogEntry]) -> bool:
        cap = self.settings.max_loaded_models
        if cap is not None and len(resident) + 1 > cap:
            return False
        if self.memory_budget is None:
            return True
        held = sum(other.backend.memory_bytes or 0 for other in resident)
        return held + (entry.backend.memory_bytes or 0) <= self.memory_budget

    async def _make_room_for(self, entry: CatalogEntry) -> list[str]:
        """Unload the least recently used idle engines until ``entry`` fits; wait (within the
        queue deadline) while the others are loading or answering; a 503 when only kept
        engines stand in the way, or the wait runs out."""
        deadline = time.monotonic() + self.settings.queue_deadline
        evicted: list[str] = []
        while True:
            resident = [e for e in self.entries.values() if e is not entry and e.holds_memory]
            if self._fits(entry, resident):
                return evicted
            candidates = sorted(
                (e for e in resident if not e.spec.keep), key=lambda e: e.backend.last_used
            )
            idle = [e for e in candidates if e.residency == RESIDENT and e.idle]
            if idle:
                victim = idle[0]
                await self.unload(victim, f"making room for {entry.id}")
                evicted.append(victim.id)
                continue
            if not candidates or time.monotonic() >= deadline:
                busy = ", ".join(f"{e.id} ({e.residency})" for e in resident) or "none"
                raise OpenAIError(
                    503,
                    f"no room to load model {entry.id!r}: the resident models ({busy}) are kept, "
                    "loading, or still answering requests; retry shortly",
                    code="model_capacity",
                    headers={"Retry-After": "10"},
                )
            await asyncio.sleep(0.05)  # the least recently used drains, or finishes loading

    async def unload(self, entry: CatalogEntry, reason: str, stop: bool = False) -> None:
        """Stop ``entry``'s engine, or, with sleep mode and not ``stop``, put it to sleep."""
        entry.unloads += 1
        entry.last_unload_reason = reason
        if entry.backend.sleep_mode and not stop and entry.residency == RESIDENT:
            log.info("model %s: going to sleep (%s)", entry.id, reason)
            entry.asleep = True  # at once: no request may go to it from now on
            await entry.backend.engine.sleep()
            return
        log.info("model %s: unloading (%s)", entry.id, reason)
        await entry.backend.unload(f"unloaded: {reason}")

    async def load_by_hand(self, model_id: str) -> dict[str, Any]:
        entry = self._entry(model_id)
        await self.make_resident(entry, "loaded by an admin")
        return self.model_report(entry)

    async def unload_by_hand(self, model_id: str) -> dict[str, Any]:
        entry = self._entry(model_id)
        async with self._room:
            if entry.state not in (EngineState.STOPPED, EngineState.FAILED):
                await self.unload(entry, "unloaded by an admin", stop=True)
        return self.model_report(entry)

    def _entry(self, model_id: str) -> CatalogEntry:
        entry = self.entries.get(model_id)
        if entry is None:
            raise model_not_found(model_id, list(self.entries))
        return entry

    async def _unload_idle(self) -> None:
        while True:
            await asyncio.sleep(_TTL_CHECK_SECONDS)
            now = time.monotonic()
            for entry in self.entries.values():
                ttl = entry.spec.ttl
                idle = entry.idle and entry.residency == RESIDENT
                if ttl is not None and idle and now - entry.backend.last_used >= ttl:
                    async with self._room:
                        if entry.idle and entry.residency == RESIDENT:
                            await self.unload(entry, f"idle for {ttl:g} s (ttl)")

    # ----- serving ------------------------------------------------------------------------

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        entry = await self._owner_for(public_model)
        await self.make_resident(entry, f"a request for {public_model}")
        entry.wanted += 1  # at once: nothing may unload it between the two
        try:
            entry.backend.last_used = time.monotonic()
            return await entry.backend.forward(path, payload, public_model, stream, request_id)
        finally:
            entry.wanted -= 1

    async def relay(self, call: EngineCall) -> Response:
        if call.public_model is None:
            entry = self._default_entry()
        else:
            entry = await self._owner_for(call.public_model)
        await self.make_resident(entry, f"a request for {call.public_model or entry.id}")
        entry.wanted += 1  # at once: nothing may unload it between the two
        try:
            entry.backend.last_used = time.monotonic()
            return await entry.backend.relay(call)
        finally:
            entry.wanted -= 1

    def _default_entry(self) -> CatalogEntry:
        """For a request that names no model: the most recently used resident, else the first."""
        resident = [e for e in self.entries.values() if e.residency == RESIDENT]
        if resident:
            return max(resident, key=lambda e: e.backend.last_used)
        return next(iter(self.entries.values()))

    # ----- what health, status and admin read ----------------------------------------------

    def model_report(self, entry: CatalogEntry) -> dict[str, Any]:
        backend = entry.backend
        _, health = backend.health()
        return {
            "id": entry.id,
            "model": entry.spec.model,
            "residency": entry.residency,
            "state": str(entry.state),
            "reason": health.get("reason") or backend.supervisor.reason,
            "adapters": [name for name in backend.servable_models() if name != entry.id],
            "memory_bytes": backend.memory_bytes,
            "in_flight": backend.in_flight,
            "idle_seconds": round(time.monotonic() - backend.last_used, 1),
            "loads": entry.loads,
            "wakes": entry.wakes,
            "unloads": entry.unloads,
            "sleep_mode": backend.sleep_mode,
            "last_unload_reason": entry.last_unload_reason,
            "keep": entry.spec.keep,
            "ttl": entry.spec.ttl,
        }

    def catalog_report(self) -> dict[str, Any]:
        return {
            "models": [self.model_report(entry) for entry in self.entries.values()],
            "max_loaded_models": self.settings.max_loaded_models,
            "memory_budget": self.memory_budget,
            "swaps": self.swaps,
            "last_swap": self.last_swap,
        }

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready while every model is either servable (cold, loading or serving) or failed
        alone: a model whose engine cannot boot is reported with its reason, and the others
        keep serving (``status`` ``degraded``)."""
        reports = {entry.id: self.model_report(entry) for entry in self.entries.values()}
        failed = {k: r["reason"] for k, r in reports.items() if r["residency"] == FAILED}
        starting = not all(entry.backend.prepared for entry in self.entries.values())
        body: dict[str, Any] = {
            "status": "starting" if starting else ("degraded" if failed else "healthy"),
            "models": self.model_ids(),
            "catalog": {
                model_id: {key: report[key] for key in ("residency", "state", "reason")}
                for model_id, report in reports.items()
            },
        }
        if failed:
            body["reason"] = "; ".join(f"{k}: {why}" for k, why in failed.items())
        ready = not starting and len(failed) < len(self.entries)
        return ready, body

    # ----- the adapter admin API, model by model (``AdminBackend``) -------------------------

    def adapters_report(self) -> dict[str, Any]:
        """Every model's adapters, each entry with its ``base_model``."""
        data: list[dict[str, Any]] = []
        progress: list[dict[str, Any]] = []
        for entry in self.entries.values():
            if not entry.backend.prepared or entry.backend.prepare_error is not None:
                continue
            report = entry.backend.adapters_report()
            data += [{**adapter, "base_model": entry.id} for adapter in report["data"]]
            progress += report["progress"]
        return {"base_models": list(self.entries), "data": data, "progress": progress,
                "adapters_manifest": self._fleet_reports() or None}  # fmt: skip

    def _fleet_reports(self) -> dict[str, Any]:
        """Each model's part of a per-base-model adapters manifest, as it was applied."""
        return {
            entry.id: entry.backend.fleet.report()
            for entry in self.entries.values()
            if entry.backend.fleet is not None
        }

    def adapter_report(self, name: str) -> dict[str, Any]:
        return {**self._adapter_owner(name).backend.adapter_report(name)}

    def admit_adapter_change(self) -> None:
        for entry in self.entries.values():
            entry.backend.admit_adapter_change()

    async def put_adapter(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        preset: dict[str, Any] | None = None,
        *,
        local_roots: Sequence[Path] | None,
    ) -> dict[str, Any]:
        entry = self._adapter_owner(name, adding=True)
        await self.make_resident(entry, f"adapter {name} added by an admin")
        return await entry.backend.put_adapter(
            name, source, revision, follow, preset, local_roots=local_roots
        )

    async def remove_adapter(self, name: str) -> None:
        await self._adapter_owner(name).backend.remove_adapter(name)

    async def rollback_adapter(self, name: str) -> dict[str, Any]:
        entry = self._adapter_owner(name)
        await self.make_resident(entry, f"adapter {name} rolled back by an admin")
        return await entry.backend.rollback_adapter(name)

    async def engine_report(self) -> dict[str, Any]:
        return {entry.id: await entry.backend.engine_report() for entry in self.entries.values()}

    async def restart_engine(self) -> EngineSnapshot:
        return await self._default_entry().backend.restart_engine()

    def _adapter_owner(self, name: str, adding: bool = False) -> CatalogEntry:
        """The model an adapter belongs to; a new one goes to the only model, or to the model
        its name is prefixed with (``ID.NAME`` is not split: the catalog's ids are the choice)."""
        entry = self.owner(name)
        if entry is not None and entry.id != name:
            return entry
        if adding and len(self.entries) == 1:
            return next(iter(self.entries.values()))
        raise OpenAIError(
            404 if not adding else 400,
            f"no adapter named {name!r} in this catalog"
            if not adding
            else f"this catalog has {len(self.entries)} base models: add {name!r} in a model's "
            "lora or adapter_dir in the config file",
            code="adapter_not_found" if not adding else "ambiguous_base_model",
        )

    async def engine_metrics(self) -> bytes | None:
        """Every serving engine's own /metrics (``vllm:*``), each sample labelled with its
        ``catalog_model``; None when no engine serves."""
        scraped = await asyncio.gather(
            *(entry.backend.engine_metrics() for entry in self.entries.values())
        )
        found = {
            entry.id: text
            for entry, text in zip(self.entries.values(), scraped, strict=True)
            if text
        }
        return merge_catalog_metrics(found) if found else None

    def engine_snapshot(self) -> EngineSnapshot:
        """The default model's engine (what reads one engine: the log tail, /health's uptime)."""
        return self._default_entry().backend.engine_snapshot()

    def engine_snapshots(self) -> dict[str, EngineSnapshot]:
        """Every model's engine, by model id (the metrics' engine gauges, one per model)."""
        return {entry.id: entry.backend.engine_snapshot() for entry in self.entries.values()}


def _measured_budget() -> int:
    """What preflight measures: the free memory of the visible GPUs, or available RAM."""
    from loragate.plan.cpu import node_available_bytes
    from loragate.plan.preflight.machine import visible_gpus

    gpus = visible_gpus()
    if gpus:
        return sum(gpu.free_bytes for gpu in gpus)
    return node_available_bytes()
