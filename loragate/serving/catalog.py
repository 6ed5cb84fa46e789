"""The catalog: a managed gateway's base models, each a ``ModelRuntime`` (its own engine and
adapters), booted when a request first needs it, within ``max_loaded_models`` and
``memory_budget``. A gateway serving one model is a catalog of one.

Every model of ``Settings.models`` is a ``ModelRuntime`` of its own (its cache and state under
``CACHE_DIR/models/ID``: store, manifest, engine socket and log), prepared at start (model
resolved, adapters declared) and booted on demand, or at start with ``preload``. A request for
a cold model makes room first, as ``loragate.serving.eviction`` decides (the least recently
used idle engines give way; never one with requests in flight or waiting: those drain first,
within the queue deadline; never one marked ``keep``), then the model boots while its requests
wait in its engine's queue as during a restart (bounded, with the queue deadline and
``Retry-After``). On GPUs the catalog's GPU plan (``loragate.plan.gpu``) places every model,
and room is counted per GPU, never summed; a model with ``sleep`` gives way by vLLM's sleep
mode and is woken for its next request (``loragate.serving.sleep``: what it still holds, and
why nothing is loaded into it asleep). An engine idle for its ``ttl`` is unloaded by a periodic
pass that a failed unload does not end; stopping the catalog stops every engine, whatever
failed before. An adapter name no model has registered is looked for where the operator said
(``loragate.serving.adapter_search``) and added to the model that names the place.

A gateway's one model (``--model``, no ``models:``) is the catalog's only entry: kept and
preloaded, its state directly under ``CACHE_DIR``, planned alone on the visible GPUs, its start
over once its engine has booted (systemd's ``READY=1``), an admin's adapter change recorded
for its next boot while it is unloaded, and its reports in a lone model's shape (``/health``,
``/admin/adapters``, ``/admin/engine``). Requests, residency, ``gateway models
list|load|unload`` and stopping go the catalog's way for both. Every refusal is a domain error
(``loragate.serving.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from loragate.adapters.errors import AdapterError
from loragate.adapters.preset import ParameterRules
from loragate.adapters.stats import AdapterStats
from loragate.engine_states import FAILED, RESIDENT, EngineSnapshot, EngineState
from loragate.periodic import PeriodicTask
from loragate.plan.engine_spec import model_settings
from loragate.serving.adapter_search import AdapterNotFound, AdapterSearch
from loragate.serving.engine_metrics import merge_catalog_metrics
from loragate.serving.errors import (
    AmbiguousBase,
    ModelNotFound,
    NotServing,
    ServingError,
    UnknownAdapter,
)
from loragate.serving.eviction import past_ttl
from loragate.serving.model import ModelRuntime
from loragate.serving.room import CatalogRoom
from loragate.serving.sleep import put_to_sleep, wake
from loragate.settings import Settings
from loragate.supervisor.command import engine_base_env
from loragate.supervisor.engine import EngineUnavailable
from loragate.supervisor.spare import spare_engines
from loragate.systemd import AllStarts, ServiceStart

log = logging.getLogger("loragate.gateway")

_TTL_CHECK_SECONDS = 5.0
# How long stopping waits for cancelled background tasks before stopping the engines anyway.
_BACKGROUND_GRACE_SECONDS = 5.0


class Catalog:
    def __init__(
        self,
        settings: Settings,
        *,
        preset_rules: ParameterRules | None = None,
        ttl_check_seconds: float = _TTL_CHECK_SECONDS,
    ) -> None:
        self.settings = settings
        # A gateway's one model (no ``models:``): a catalog of one, in a lone model's shape.
        self.single = not settings.models
        # One spare engine for whichever model boots next (loragate.supervisor.spare).
        self.spares = spare_engines(settings, models=len(settings.models) or 1)
        if self.single:
            # Kept and preloaded: its runtime's own spec when the config gives it none.
            models = [ModelRuntime(settings, preset_rules=preset_rules, spares=self.spares)]
        else:
            models = [
                ModelRuntime(
                    model_settings(settings, model_id, spec),
                    spec,
                    preset_rules=preset_rules,
                    spares=self.spares,
                    fleet_part=model_id,  # its part of a per-model adapters manifest
                )
                for model_id, spec in settings.models.items()
            ]
        self.entries = {model.id: model for model in models}
        self._lone = models[0]  # a catalog of one's model (read only when ``single``)
        self.room = CatalogRoom.given(settings)  # measured at start
        self.swaps = 0
        self.last_swap: dict[str, Any] | None = None
        self._changing = asyncio.Lock()  # one residency change at a time
        self._search = AdapterSearch(
            {model_id: entry.spec for model_id, entry in self.entries.items()}, self._add_from
        )
        self._ttl = PeriodicTask("catalog-ttl", self._unload_idle, ttl_check_seconds, log=log)
        self._preloads: set[asyncio.Task[None]] = set()
        self._stopping = False  # set by stop(): a request still waiting boots nothing

    # ----- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if not self.single:  # one model is planned alone on the visible GPUs
            self.room = await CatalogRoom.measure(self.settings)
        for entry in self.entries.values():
            # On GPUs: its part of the catalog's GPU plan, its GPUs and share beside the others.
            entry.gpu_placement = self.room.placements.get(entry.id)
            await entry.start(serves_once_booted=self.single)
        for entry in self.entries.values():
            if entry.spec.preload:
                task = asyncio.create_task(self._preload(entry), name=f"preload-{entry.id}")
                self._preloads.add(task)
                task.add_done_callback(self._preloads.discard)
        if self.spares is not None and not self._preloads:
            # Nothing boots now: the first request's model takes the spare.
            self.spares.replenish(engine_base_env())
        self._ttl.start()

    async def stop(self) -> None:
        """Stop every engine, whatever failed before: the background tasks (ttl, preloads,
        adapter searches) are cancelled and waited for a moment, then every engine is stopped
        together; one whose stop raises is logged and the others still stop. No engine boots
        from then on."""
        self._stopping = True
        await self._ttl.aclose()
        background = [*self._search.searches(), *self._preloads]
        for task in background:
            task.cancel()
        if background:
            done, _ = await asyncio.wait(background, timeout=_BACKGROUND_GRACE_SECONDS)
            for task in done:  # each failure was logged, or answered to its requests, already
                if not task.cancelled():
                    task.exception()
        entries = list(self.entries.values())
        outcomes = await asyncio.gather(
            *(entry.stop() for entry in entries), return_exceptions=True
        )
        for entry, outcome in zip(entries, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.error("model %s: stopping its engine failed", entry.id, exc_info=outcome)

    async def _preload(self, entry: ModelRuntime) -> None:
        try:
            await self.make_resident(entry, "preload")
        except (ServingError, AdapterError) as exc:
            log.warning("model %s: not preloaded: %s", entry.id, exc)
        except Exception:
            log.exception("model %s: not preloaded", entry.id)

    # ----- which model serves a name ------------------------------------------------------

    def model_ids(self) -> list[str]:
        if self.single:  # every request asks: a lone model's own list, as it is
            return self._lone.model_ids()
        return [name for entry in self.entries.values() for name in self._names_of(entry)]

    def _names_of(self, entry: ModelRuntime) -> list[str]:
        """The base and adapters ``entry`` serves (a lone model: those routed now, or those
        its next boot serves while cold; a catalog's: those it will serve once booted)."""
        return entry.model_ids() if self.single else entry.servable_models()

    def model_entries(self) -> list[dict[str, Any]]:
        """``/v1/models``'s entries: every base and adapter, adapters with their ``parent``,
        each with its base's ``residency``."""
        found = []
        for entry in self.entries.values():
            for name in self._names_of(entry):
                parent = None if name == entry.id else entry.id
                found.append({"id": name, "parent": parent, "residency": entry.residency})
        return found

    def owner(self, name: str) -> ModelRuntime | None:
        for entry in self.entries.values():
            if name in entry.servable_models():
                return entry
        return None

    def model_preset(self, name: str) -> dict[str, Any] | None:
        """``/v1/models/{id}``'s preset: asked of the model that serves ``name``."""
        entry = self.owner(name)
        return entry.model_preset(name) if entry is not None else None

    def resolves(self, name: str) -> bool:
        """Whether an unregistered ``name`` may be found in a place the operator configured:
        an adapter folder of a model's ``adapter_dir``, or any model with ``resolvers`` (tried
        in order when a request comes; a name none of them had is not tried again for a
        while: ``loragate.serving.adapter_search``)."""
        return self._search.may_find(name)

    async def _owner_for(self, name: str) -> ModelRuntime:
        entry = self.owner(name)
        if entry is not None:
            return entry
        if not self.resolves(name):
            raise ModelNotFound(name, self.model_ids())
        try:
            return self.entries[await self._search.find(name)]
        except AdapterNotFound as exc:
            raise ModelNotFound(name, self.model_ids(), exc.tried) from None

    async def _add_from(self, model_id: str, name: str, source: str) -> str | None:
        """Add adapter ``name`` to ``model_id`` from ``source`` through the admin API's
        pipeline (booting the model first): None once it serves, else why it could not."""
        entry = self.entries[model_id]
        async with self._kept_resident(entry, f"adapter {name} requested"):
            await entry.until_prepared(None)
            try:
                # An operator's place (adapter_dir, resolvers): read wherever it is.
                await entry.put_adapter(name, source, local_roots=None)
            except (ServingError, AdapterError) as exc:
                return str(exc)
        return None

    # ----- residency ----------------------------------------------------------------------

    async def make_resident(
        self, entry: ModelRuntime, reason: str, deadline: float | None = None
    ) -> None:
        """Boot ``entry``'s engine if it is cold, unloading idle ones first to make room.

        Requests for a model whose load is under way wait for that load instead of queueing
        for the room again, so a burst for one model costs one boot, not one per request. A
        request (``deadline``) waits for the model's preparation until then, no longer."""
        if entry.takes_requests or entry.residency == FAILED:
            return
        await entry.until_prepared(deadline)  # its plan (memory, GPUs) is known then
        if entry.pending_load is not None:
            await asyncio.shield(entry.pending_load)
            return
        async with self._changing:  # an unload in progress (STOPPING) ends first
            if entry.takes_requests or entry.residency == FAILED:
                return
            if self._stopping:
                raise NotServing("the gateway is stopping", "engine_unavailable", retry_after=5)
            entry.pending_load = asyncio.get_running_loop().create_future()
            try:
                evicted = [] if self.single else await self._make_room_for(entry)
                if evicted:
                    self.swaps += 1
                    self.last_swap = {
                        "loaded": entry.id,
                        "unloaded": evicted,
                        "at": time.time(),
                        "reason": reason,
                    }
                if entry.asleep:
                    await self._wake(entry, reason)
                else:
                    # vLLM would refuse the boot (another program took that GPU memory)?
                    refused = await self.room.boot_refusal(entry.gpu_placement)
                    if refused is not None:
                        raise _no_room(entry, refused)
                    log.info("model %s: loading (%s)", entry.id, reason)
                    entry.loads += 1
                    await entry.load(f"loaded on demand: {reason}")
            except BaseException as exc:
                entry.pending_load.set_exception(exc)
                entry.pending_load.exception()  # retrieved: no "never retrieved" warning
                raise
            else:
                entry.pending_load.set_result(None)
            finally:
                entry.pending_load = None

    async def _wake(self, entry: ModelRuntime, reason: str) -> None:
        """Wake ``entry``'s engine; one that does not wake is stopped (the next request boots
        it, within the room) and this request gets a 503."""
        log.info("model %s: waking up (%s)", entry.id, reason)
        try:
            await wake(entry.supervisor, entry.engine)
        except EngineUnavailable as exc:
            await entry.unload(f"it did not wake up: {exc}")
            raise NotServing(
                f"model {entry.id!r} did not wake up ({exc}): its engine was stopped, and the "
                "next request boots it",
                "engine_unavailable",
                retry_after=5,
            ) from None
        entry.wakes += 1

    async def _make_room_for(self, entry: ModelRuntime) -> list[str]:
        """Unload what ``loragate.serving.eviction`` says, one engine at a time (a request may
        reach one between two unloads: the decision is taken again after each), until
        ``entry`` fits; wait (within the queue deadline) while those in the way are loading or
        answering; a 503 when it cannot fit, or the wait runs out."""
        deadline = time.monotonic() + self.settings.queue_deadline
        evicted: list[str] = []
        while True:
            decision = self.room.decide(
                entry.memory_bytes,
                entry.gpu_held,
                [other.occupant() for other in self.entries.values() if other is not entry],
            )
            if decision.refused is not None:
                raise _no_room(entry, decision.refused)
            if decision.unload:
                first = decision.unload[0]
                victim = self.entries[first.model]
                await self.unload(victim, f"making room for {entry.id}", stop=not first.sleep)
                evicted.append(victim.id)
                continue
            if decision.fits:
                return evicted
            if time.monotonic() >= deadline:
                waited = (self.entries[model_id] for model_id in decision.wait_for)
                busy = ", ".join(f"{e.id} ({e.residency})" for e in waited)
                raise _no_room(
                    entry,
                    f"the models in the way ({busy}) are still loading or answering requests "
                    f"after queue_deadline ({self.settings.queue_deadline:g} s); retry shortly",
                )
            await asyncio.sleep(0.05)  # the least recently used drains, or finishes loading

    async def unload(self, entry: ModelRuntime, reason: str, stop: bool = False) -> None:
        """Stop ``entry``'s engine, or, with sleep mode and not ``stop``, put it to sleep."""
        entry.unloads += 1
        entry.last_unload_reason = reason
        if entry.sleep_mode and not stop and entry.residency == RESIDENT:
            log.info("model %s: going to sleep (%s)", entry.id, reason)
            try:  # asleep at once: no request or adapter call may go to it from now on
                await put_to_sleep(entry.supervisor, entry.engine)
                return
            except EngineUnavailable as exc:
                log.warning("model %s: did not go to sleep (%s): stopping it", entry.id, exc)
        log.info("model %s: unloading (%s)", entry.id, reason)
        await entry.unload(f"unloaded: {reason}")

    async def load_by_hand(self, model_id: str) -> dict[str, Any]:
        entry = self._entry(model_id)
        if not (self.single and not entry.prepared):  # a lone model's start boots it
            await self.make_resident(entry, "loaded by an admin")
        return entry.report()

    async def unload_by_hand(self, model_id: str) -> dict[str, Any]:
        entry = self._entry(model_id)
        async with self._changing:
            if entry.state not in (EngineState.STOPPED, EngineState.FAILED):
                entry.unloaded_by_hand = self.single  # healthy while cold: a request boots it
                await self.unload(entry, "unloaded by an admin", stop=True)
        return entry.report()

    def _entry(self, model_id: str) -> ModelRuntime:
        entry = self.entries.get(model_id)
        if entry is None:
            raise ModelNotFound(model_id, list(self.entries))
        return entry

    async def _unload_idle(self) -> None:
        """One ttl pass: unload each engine idle past its ``ttl``. An unload that raises is
        logged and the pass goes on to the others; the next pass tries it again."""
        for model_id in past_ttl([e.occupant() for e in self.entries.values()], time.monotonic()):
            entry = self.entries[model_id]
            try:
                async with self._changing:  # still idle once the room is ours?
                    model = entry.occupant()
                    if past_ttl([model], time.monotonic()):
                        others = [e.occupant() for e in self.entries.values()]
                        stop = not self.room.may_sleep(model, others)  # too little host memory
                        await self.unload(entry, f"idle for {entry.spec.ttl:g} s (ttl)", stop)
            except Exception:
                log.exception("model %s: its ttl unload failed; the next pass retries", model_id)

    # ----- serving ------------------------------------------------------------------------

    async def take(self, public_model: str | None, deadline: float) -> ModelRuntime:
        """The model that answers a request for ``public_model`` (None: a request that names
        none goes to the most recently used resident), made resident and kept so (never
        unloaded) until ``give_back``; ``ModelNotFound`` when no model has that name, nor
        finds it (a lone model's lease says so), ``NotServing`` when it is not prepared by
        ``deadline``."""
        if self.single:
            entry = self._lone
        elif public_model is None:
            entry = self._default_entry()
        else:
            entry = await self._owner_for(public_model)
        if not entry.takes_requests:
            await self.make_resident(entry, f"a request for {public_model or entry.id}", deadline)
        entry.wanted += 1  # at once: nothing may unload it between the two
        entry.last_used = time.monotonic()
        return entry

    def give_back(self, entry: ModelRuntime) -> None:
        """A request ``take`` kept ``entry`` for has its answer (or failed): it may go now."""
        entry.wanted -= 1

    @contextlib.asynccontextmanager
    async def _kept_resident(
        self, entry: ModelRuntime, reason: str, deadline: float | None = None
    ) -> AsyncIterator[None]:
        """``entry`` made resident and kept so (wanted: never unloaded) until the block ends: a
        request, or an admin's adapter change whose download may take a while. A lone model
        unloaded by hand is not booted for an adapter change: the change is recorded for its
        next boot."""
        if deadline is None and self.single:
            yield
            return
        await self.make_resident(entry, reason, deadline)
        entry.wanted += 1  # at once: nothing may unload it between the two
        try:
            entry.last_used = time.monotonic()
            yield
        finally:
            entry.wanted -= 1

    def _default_entry(self) -> ModelRuntime:
        """For a request that names no model: the most recently used resident, else the first."""
        resident = [e for e in self.entries.values() if e.residency == RESIDENT]
        if resident:
            return max(resident, key=lambda e: e.last_used)
        return next(iter(self.entries.values()))

    # ----- what health, status and admin read ----------------------------------------------

    def catalog_report(self) -> dict[str, Any]:
        limits = {"max_loaded_models": 1, "memory_budget": None} if self.single else None
        return {
            "models": [entry.report() for entry in self.entries.values()],
            **(limits or self.room.report()),
            "swaps": self.swaps,
            "last_swap": self.last_swap,
        }

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready while every model is either servable (cold, loading or serving) or failed
        alone: a model whose engine cannot boot is reported with its reason, and the others
        keep serving (``status`` ``degraded``). A lone model: ready while its engine serves
        with its adapters loaded, or once an admin unloaded it (the next request boots it)."""
        if self.single:
            return self._lone.health()
        reports = {entry.id: entry.report() for entry in self.entries.values()}
        failed = {k: r["reason"] for k, r in reports.items() if r["residency"] == FAILED}
        starting = not all(entry.prepared for entry in self.entries.values())
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
        """Every model's adapters, each entry with its ``base_model`` (a lone model's with the
        report's own ``base_model``)."""
        if self.single:
            return self._lone.adapters_report()
        data: list[dict[str, Any]] = []
        progress: list[dict[str, Any]] = []
        for entry in self.entries.values():
            if not entry.prepared or entry.prepare_error is not None:
                continue
            report = entry.adapters_report()
            data += [{**adapter, "base_model": entry.id} for adapter in report["data"]]
            progress += report["progress"]
        return {"base_models": list(self.entries), "data": data, "progress": progress,
                "adapters_manifest": self._fleet_reports() or None}  # fmt: skip

    def _fleet_reports(self) -> dict[str, Any]:
        """Each model's part of a per-base-model adapters manifest, as it was applied."""
        return {
            entry.id: entry.fleet.report()
            for entry in self.entries.values()
            if entry.fleet is not None
        }

    def adapter_report(self, name: str) -> dict[str, Any]:
        return self._adapter_owner(name).adapter_report(name)

    def admit_adapter_change(self) -> None:
        for entry in self.entries.values():
            entry.admit_adapter_change()

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
        async with self._kept_resident(entry, f"adapter {name} added by an admin"):
            return await entry.put_adapter(
                name, source, revision, follow, preset, local_roots=local_roots
            )

    async def remove_adapter(self, name: str) -> None:
        await self._adapter_owner(name).remove_adapter(name)

    async def rollback_adapter(self, name: str) -> dict[str, Any]:
        entry = self._adapter_owner(name)
        async with self._kept_resident(entry, f"adapter {name} rolled back by an admin"):
            return await entry.rollback_adapter(name)

    async def engine_report(self) -> dict[str, Any]:
        if self.single:
            return await self._lone.engine_report()
        return {entry.id: await entry.engine_report() for entry in self.entries.values()}

    async def restart_engine(self) -> EngineSnapshot:
        return await self._default_entry().restart_engine()

    def _adapter_owner(self, name: str, adding: bool = False) -> ModelRuntime:
        """The model an adapter belongs to; a new one goes to the only model, or to the model
        its name is prefixed with (``ID.NAME`` is not split: the catalog's ids are the choice).
        A lone model's own adapter manager answers for every name (an add under way too)."""
        if self.single:
            return self._lone
        entry = self.owner(name)
        if entry is not None and entry.id != name:
            return entry
        if adding and len(self.entries) == 1:
            return next(iter(self.entries.values()))
        if adding:
            raise AmbiguousBase(name, len(self.entries))
        raise UnknownAdapter(name, " in this catalog")

    async def engine_metrics(self) -> bytes | None:
        """Every serving engine's own /metrics (``vllm:*``), each sample labelled with its
        ``catalog_model`` (a lone model's as it is); None when no engine serves."""
        if self.single:
            return await self._lone.engine_metrics()
        entries = list(self.entries.values())
        scraped = await asyncio.gather(*(entry.engine_metrics() for entry in entries))
        found = {entry.id: text for entry, text in zip(entries, scraped, strict=True) if text}
        return merge_catalog_metrics(found) if found else None

    def engine_snapshot(self) -> EngineSnapshot:
        """The default model's engine (what reads one engine: the log tail, /health's uptime)."""
        return self._default_entry().engine_snapshot()

    def engine_snapshots(self) -> dict[str, EngineSnapshot]:
        """Every model's engine, by model id (the metrics' engine gauges, one per model)."""
        return {entry.id: entry.engine_snapshot() for entry in self.entries.values()}

    async def adapter_stats(self) -> AdapterStats | None:
        """A lone model's adapter counts (a catalog's are by model in ``/admin/models``)."""
        return await self._lone.adapter_stats() if self.single else None

    def max_model_len(self) -> int | None:
        """A lone model's context length (a catalog's differ by model: None)."""
        return self._lone.max_model_len() if self.single else None

    def start_report(self) -> dict[str, Any] | None:
        """A lone model's start progress for ``/health`` (a catalog's are by model)."""
        return self._lone.start_report() if self.single else None

    def service_start(self) -> ServiceStart:
        """How the start goes, for systemd: the catalog serves once every model is prepared (a
        cold one answers) and its preloads have booted; a lone model, once its engine has
        booted (not when it failed)."""
        if self.single:
            return self._lone
        models = {entry.id: entry for entry in self.entries.values()}
        return AllStarts(models, self._preloads)


def _no_room(entry: ModelRuntime, why: str) -> NotServing:
    return NotServing(f"no room to load model {entry.id!r}: {why}", "model_capacity", 10)
