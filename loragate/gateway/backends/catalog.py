"""A catalog of base models behind one gateway: each its own supervised engine and adapters,
booted when a request first needs it, within ``max_loaded_models`` and ``memory_budget``.

Every model of ``Settings.models`` is a ``SupervisedEngineBackend`` of its own (its cache and
state under ``CACHE_DIR/models/ID``: store, manifest, engine socket and log), prepared at start
(model resolved, adapters declared) and booted on demand, or at start with ``preload``. A
request for a cold model makes room first, as ``loragate.serving.eviction`` decides (the least
recently used idle engines give way; never one with requests in flight or waiting: those drain
first, within the queue deadline; never one marked ``keep``), then the model boots while its
requests wait in its engine's queue as during a restart (bounded, with the queue deadline and
``Retry-After``). On GPUs the catalog's GPU plan (``loragate.plan.gpu``) places every model,
and room is counted per GPU, never summed; a model with ``sleep`` gives way by vLLM's sleep
mode and is woken for its next request (``loragate.serving.sleep``: what it still holds, and
why nothing is loaded into it asleep). An engine idle for its ``ttl`` is unloaded by a periodic
pass that a failed unload does not end; stopping the catalog stops every engine, whatever
failed before. An adapter name no model has registered is looked for where the operator said
(``loragate.serving.adapter_search``) and added to the model that names the place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.responses import Response

from loragate.engine_states import COLD, FAILED, LOADING, RESIDENT, EngineSnapshot, EngineState
from loragate.gateway.backends.base import EngineCall
from loragate.gateway.backends.supervised import SupervisedEngineBackend
from loragate.gateway.errors import OpenAIError, model_not_found
from loragate.periodic import PeriodicTask
from loragate.plan.engine_spec import model_settings
from loragate.serving.adapter_search import AdapterNotFound, AdapterSearch
from loragate.serving.engine_metrics import merge_catalog_metrics
from loragate.serving.eviction import Occupant, past_ttl
from loragate.serving.room import CatalogRoom
from loragate.serving.sleep import asleep_hold, put_to_sleep, wake
from loragate.settings import Settings
from loragate.settings.catalog import CatalogModel
from loragate.supervisor.command import engine_base_env
from loragate.supervisor.engine import EngineUnavailable
from loragate.supervisor.spare import spare_engines
from loragate.systemd import AllStarts

log = logging.getLogger("loragate.gateway")

_TTL_CHECK_SECONDS = 5.0
# How long stopping waits for cancelled background tasks before stopping the engines anyway.
_BACKGROUND_GRACE_SECONDS = 5.0
# States of an engine that is up or coming up: a request for it goes straight to it.
_RUNNING = frozenset(
    {EngineState.STARTING, EngineState.RESTARTING, EngineState.READY, EngineState.UNHEALTHY}
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
    wakes: int = 0
    last_unload_reason: str | None = None

    def __post_init__(self) -> None:
        self.backend.sleep_mode = self.spec.sleep
        self.backend.fleet_part = self.id

    @property
    def state(self) -> EngineState:
        return self.backend.supervisor.state

    @property
    def asleep(self) -> bool:
        """Unloaded by vLLM's sleep mode: the engine runs, its weights in host memory."""
        return self.backend.supervisor.asleep

    @property
    def residency(self) -> str:
        return self.backend.residency(asleep=self.asleep)

    @property
    def idle(self) -> bool:
        return self.wanted == 0 and self.backend.in_flight == 0

    @property
    def takes_requests(self) -> bool:
        """Up or coming up, and awake: a request for it goes straight to its engine."""
        return self.state in _RUNNING and not self.asleep

    def occupant(self) -> Occupant:
        """This model as the room decision (``loragate.serving.eviction``) sees it."""
        residency, backend = self.residency, self.backend
        if residency == LOADING and self.state == EngineState.STOPPED:
            residency = COLD  # still being prepared: no engine yet, it holds nothing
        asleep = asleep_hold(backend.gpu_placement, backend.gpu_held)
        return Occupant(
            self.id,
            residency,
            last_used=backend.last_used,
            requests=self.wanted + backend.in_flight,
            memory_bytes=backend.memory_bytes,
            held_bytes=backend.gpu_held,
            asleep_bytes=asleep.gpu_bytes,
            asleep_held=asleep.gpus,
            asleep_host_bytes=asleep.host_bytes,
            keep=self.spec.keep,
            sleeps=backend.sleep_mode,
            ttl=self.spec.ttl,
        )


class CatalogBackend:
    def __init__(
        self, settings: Settings, *, ttl_check_seconds: float = _TTL_CHECK_SECONDS
    ) -> None:
        self.settings = settings
        # One spare engine for whichever model boots next (loragate.supervisor.spare).
        self.spares = spare_engines(settings, models=len(settings.models))
        self.entries = {
            model_id: CatalogEntry(
                model_id,
                entry,
                SupervisedEngineBackend(
                    model_settings(settings, model_id, entry),
                    spares=self.spares,
                ),
            )
            for model_id, entry in settings.models.items()
        }
        self.room = CatalogRoom.given(settings)  # measured at start
        self.swaps = 0
        self.last_swap: dict[str, Any] | None = None
        self._changing = asyncio.Lock()  # one residency change at a time
        self._search = AdapterSearch(
            {model_id: entry.spec for model_id, entry in self.entries.items()}, self._add_from
        )
        self._ttl = PeriodicTask("catalog-ttl", self._unload_idle, ttl_check_seconds, log=log)
        self._preloads: set[asyncio.Task[None]] = set()

    # ----- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.room = await CatalogRoom.measure(self.settings)
        for entry in self.entries.values():
            # On GPUs: its part of the catalog's GPU plan, its GPUs and share beside the others.
            entry.backend.gpu_placement = self.room.placements.get(entry.id)
            await entry.backend.start(boot=False)
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
        together; one whose stop raises is logged and the others still stop."""
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
            *(entry.backend.stop() for entry in entries), return_exceptions=True
        )
        for entry, outcome in zip(entries, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.error("model %s: stopping its engine failed", entry.id, exc_info=outcome)

    async def _preload(self, entry: CatalogEntry) -> None:
        try:
            await self.make_resident(entry, "preload")
        except OpenAIError as exc:
            log.warning("model %s: not preloaded: %s", entry.id, exc.message)
        except Exception:
            log.exception("model %s: not preloaded", entry.id)

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
        while: ``loragate.serving.adapter_search``)."""
        return self._search.may_find(name)

    async def _owner_for(self, name: str) -> CatalogEntry:
        entry = self.owner(name)
        if entry is not None:
            return entry
        if not self.resolves(name):
            raise model_not_found(name, self.model_ids())
        try:
            return self.entries[await self._search.find(name)]
        except AdapterNotFound as exc:
            missing = model_not_found(name, self.model_ids())
            missing.message += " Looked for it at: " + "; ".join(exc.tried)
            raise missing from None

    async def _add_from(self, model_id: str, name: str, source: str) -> str | None:
        """Add adapter ``name`` to ``model_id`` from ``source`` through the admin API's
        pipeline (booting the model first): None once it serves, else why it could not."""
        entry = self.entries[model_id]
        async with self._kept_resident(entry, f"adapter {name} requested"):
            await entry.backend.wait_until_prepared()
            try:
                # An operator's place (adapter_dir, resolvers): read wherever it is.
                await entry.backend.put_adapter(name, source, local_roots=None)
            except OpenAIError as exc:
                return exc.message
        return None

    # ----- residency ----------------------------------------------------------------------

    async def make_resident(self, entry: CatalogEntry, reason: str) -> None:
        """Boot ``entry``'s engine if it is cold, unloading idle ones first to make room.

        Requests for a model whose load is under way wait for that load instead of queueing
        for the room again, so a burst for one model costs one boot, not one per request."""
        if entry.takes_requests or entry.residency == FAILED:
            return
        await entry.backend.wait_until_prepared()  # its plan (memory, GPUs) is known then
        if entry.pending_load is not None:
            await asyncio.shield(entry.pending_load)
            return
        async with self._changing:  # an unload in progress (STOPPING) ends first
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
                    await self._wake(entry, reason)
                else:
                    # vLLM would refuse the boot (another program took that GPU memory)?
                    refused = await self.room.boot_refusal(entry.backend.gpu_placement)
                    if refused is not None:
                        raise _no_room(entry, refused)
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

    async def _wake(self, entry: CatalogEntry, reason: str) -> None:
        """Wake ``entry``'s engine; one that does not wake is stopped (the next request boots
        it, within the room) and this request gets a 503."""
        log.info("model %s: waking up (%s)", entry.id, reason)
        try:
            await wake(entry.backend.supervisor, entry.backend.engine)
        except EngineUnavailable as exc:
            await entry.backend.unload(f"it did not wake up: {exc}")
            raise OpenAIError(
                503,
                f"model {entry.id!r} did not wake up ({exc}): its engine was stopped, and the "
                "next request boots it",
                code="engine_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        entry.wakes += 1

    async def _make_room_for(self, entry: CatalogEntry) -> list[str]:
        """Unload what ``loragate.serving.eviction`` says, one engine at a time (a request may
        reach one between two unloads: the decision is taken again after each), until
        ``entry`` fits; wait (within the queue deadline) while those in the way are loading or
        answering; a 503 when it cannot fit, or the wait runs out."""
        deadline = time.monotonic() + self.settings.queue_deadline
        evicted: list[str] = []
        while True:
            decision = self.room.decide(
                entry.backend.memory_bytes,
                entry.backend.gpu_held,
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

    async def unload(self, entry: CatalogEntry, reason: str, stop: bool = False) -> None:
        """Stop ``entry``'s engine, or, with sleep mode and not ``stop``, put it to sleep."""
        entry.unloads += 1
        entry.last_unload_reason = reason
        if entry.backend.sleep_mode and not stop and entry.residency == RESIDENT:
            log.info("model %s: going to sleep (%s)", entry.id, reason)
            try:  # asleep at once: no request or adapter call may go to it from now on
                await put_to_sleep(entry.backend.supervisor, entry.backend.engine)
                return
            except EngineUnavailable as exc:
                log.warning("model %s: did not go to sleep (%s): stopping it", entry.id, exc)
        log.info("model %s: unloading (%s)", entry.id, reason)
        await entry.backend.unload(f"unloaded: {reason}")

    async def load_by_hand(self, model_id: str) -> dict[str, Any]:
        entry = self._entry(model_id)
        await self.make_resident(entry, "loaded by an admin")
        return self.model_report(entry)

    async def unload_by_hand(self, model_id: str) -> dict[str, Any]:
        entry = self._entry(model_id)
        async with self._changing:
            if entry.state not in (EngineState.STOPPED, EngineState.FAILED):
                await self.unload(entry, "unloaded by an admin", stop=True)
        return self.model_report(entry)

    def _entry(self, model_id: str) -> CatalogEntry:
        entry = self.entries.get(model_id)
        if entry is None:
            raise model_not_found(model_id, list(self.entries))
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

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        entry = await self._owner_for(public_model)
        async with self._kept_resident(entry, f"a request for {public_model}"):
            return await entry.backend.forward(path, payload, public_model, stream, request_id)

    async def relay(self, call: EngineCall) -> Response:
        if call.public_model is None:
            entry = self._default_entry()
        else:
            entry = await self._owner_for(call.public_model)
        async with self._kept_resident(entry, f"a request for {call.public_model or entry.id}"):
            return await entry.backend.relay(call)

    @contextlib.asynccontextmanager
    async def _kept_resident(self, entry: CatalogEntry, reason: str) -> AsyncIterator[None]:
        """``entry`` made resident and kept so (wanted: never unloaded) until the block ends: a
        request, or an admin's adapter change whose download may take a while."""
        await self.make_resident(entry, reason)
        entry.wanted += 1  # at once: nothing may unload it between the two
        try:
            entry.backend.last_used = time.monotonic()
            yield
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
        asleep = asleep_hold(backend.gpu_placement, backend.gpu_held)
        return {
            "id": entry.id,
            "model": entry.spec.model,
            "residency": entry.residency,
            "state": str(entry.state),
            "reason": health.get("reason") or backend.supervisor.reason,
            "adapters": [name for name in backend.servable_models() if name != entry.id],
            "memory_bytes": backend.memory_bytes,
            # What it still holds asleep: of its GPUs, and of host memory (its weights).
            "asleep_gpu_bytes": asleep.gpu_bytes if entry.asleep else None,
            "asleep_host_bytes": asleep.host_bytes if entry.asleep else None,
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
            **self.room.report(),
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
        async with self._kept_resident(entry, f"adapter {name} added by an admin"):
            return await entry.backend.put_adapter(
                name, source, revision, follow, preset, local_roots=local_roots
            )

    async def remove_adapter(self, name: str) -> None:
        await self._adapter_owner(name).backend.remove_adapter(name)

    async def rollback_adapter(self, name: str) -> dict[str, Any]:
        entry = self._adapter_owner(name)
        async with self._kept_resident(entry, f"adapter {name} rolled back by an admin"):
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
        entries = list(self.entries.values())
        scraped = await asyncio.gather(*(entry.backend.engine_metrics() for entry in entries))
        found = {entry.id: text for entry, text in zip(entries, scraped, strict=True) if text}
        return merge_catalog_metrics(found) if found else None

    def engine_snapshot(self) -> EngineSnapshot:
        """The default model's engine (what reads one engine: the log tail, /health's uptime)."""
        return self._default_entry().backend.engine_snapshot()

    def engine_snapshots(self) -> dict[str, EngineSnapshot]:
        """Every model's engine, by model id (the metrics' engine gauges, one per model)."""
        return {entry.id: entry.backend.engine_snapshot() for entry in self.entries.values()}

    def service_start(self) -> AllStarts:
        """How the start goes, for systemd: the catalog serves once every model is prepared (a
        cold one answers) and its preloads have booted."""
        models = {entry.id: entry.backend for entry in self.entries.values()}
        return AllStarts(models, self._preloads)


def _no_room(entry: CatalogEntry, why: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"no room to load model {entry.id!r}: {why}",
        code="model_capacity",
        headers={"Retry-After": "10"},
    )
