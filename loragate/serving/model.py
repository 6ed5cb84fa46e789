"""One base model's whole life: its plan, engine, adapters, leases, requests and residency.

A ``ModelRuntime`` wires the parts of one model together: the plan (``plan_engine``) decides
what its engine runs, the supervisor runs it, the adapter manager owns what the engine serves
and the routing table, and a ``Lease`` hands a request the engine and the adapter version that
answer it (the gateway's proxy carries the bytes). Start-up work that can take a while
(building the demo, downloading a model, preparing boot adapters) runs in the background so
``/health`` answers "starting" meanwhile. The catalog (``loragate.serving.catalog``) decides
when the engine boots, sleeps and stops; every refusal is a domain error (``serving.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loragate.adapters.fleet_reconciler import FleetReconciler
from loragate.adapters.manager import AdapterManager
from loragate.adapters.preset import ParameterRules, Preset
from loragate.adapters.slots import AdapterSlots
from loragate.adapters.stats import AdapterStats
from loragate.adapters.wiring import adapter_manager_for, fleet_reconciler_for
from loragate.engine_flags import engine_arg_value
from loragate.engine_states import COLD, LOADING, EngineSnapshot, EngineState, residency
from loragate.fetching.progress import WaitProgress, current_progress
from loragate.plan.engine_plan import EnginePlan, plan_engine
from loragate.plan.gpu.placement import Placement
from loragate.plan.preflight.problem import PreflightError
from loragate.serving.adapter_admin import AdapterAdmin
from loragate.serving.engine_metrics import scrape_engine_metrics
from loragate.serving.engine_names import AnyVersionRename
from loragate.serving.errors import ModelNotFound, NotServing
from loragate.serving.eviction import Occupant
from loragate.serving.sleep import asleep_hold
from loragate.settings import Settings
from loragate.settings.catalog import CatalogModel
from loragate.supervisor.client import EngineClient
from loragate.supervisor.command import EngineSpec
from loragate.supervisor.engine import EngineEndpoint, EngineSupervisor, EngineUnavailable
from loragate.supervisor.process import GatewayLock, tree_rss_bytes
from loragate.supervisor.spare import SpareEngines, spare_engines
from loragate.systemd import ServiceStart

# States of an engine that is up or coming up: a request for it goes straight to it.
_RUNNING = frozenset(
    {EngineState.STARTING, EngineState.RESTARTING, EngineState.READY, EngineState.UNHEALTHY}
)


class Lease:
    """What answers one request: the engine's ``endpoint``, the engine id of the adapter
    version leased for it (None: a request that names no model), that version's ``preset``,
    the base's engine id (answers carry it for base requests on the CPU build), and ``done``,
    to call when the answer has ended, either way (it frees the version and the adapter slot,
    and counts the request out; only the first call does). One object per request, on
    purpose: every object a request holds while it waits for the engine is one more for the
    garbage collector's youngest generation (``scripts/bench.py`` at saturation)."""

    __slots__ = ("_manager", "_model", "base_engine_id", "endpoint", "engine_id", "preset")

    def __init__(
        self,
        model: ModelRuntime,
        manager: AdapterManager,
        endpoint: EngineEndpoint,
        engine_id: str | None,
    ) -> None:
        self.endpoint = endpoint
        self.engine_id = engine_id
        self.preset: Preset | None = manager.preset_of(engine_id)
        self.base_engine_id = manager.base_engine_id
        self._model: ModelRuntime | None = model
        self._manager = manager

    def done(self) -> None:
        model, self._model = self._model, None
        if model is not None:
            model.answered(self._manager, self.engine_id)


log = logging.getLogger("loragate.gateway")


class ModelRuntime(AdapterAdmin):
    # With --adapters-manifest: what converges this gateway's adapters on the fleet's.
    fleet: FleetReconciler | None = None
    # A catalog's spare engines, shared by its models, or a lone model's own when it asks
    # for one (``loragate.supervisor.spare``).
    spares: SpareEngines | None = None

    def __init__(
        self,
        settings: Settings,
        spec: CatalogModel | None = None,
        *,
        preset_rules: ParameterRules | None = None,
        spares: SpareEngines | None = None,
        fleet_part: str | None = None,
    ) -> None:
        self.settings = settings
        self.preset_rules = preset_rules
        # Its id in the catalog (its served name), and what the catalog's config says of it
        # (a gateway's one model: kept, and booted at start).
        self.spec = spec or CatalogModel(
            model=settings.model or settings.served_model_name, keep=True, preload=True
        )
        self.cache_dir = settings.cache_dir.expanduser().resolve()
        self.base_name = settings.served_model_name
        self.spares = spares if spares is not None else spare_engines(settings, models=1)
        self.supervisor = EngineSupervisor(
            self._engine_spec, cache_dir=self.cache_dir, timings=settings, spares=self.spares
        )
        self.supervisor.queue_size = settings.queue_size
        self.engine = EngineClient(self.supervisor)
        self.manager: AdapterManager | None = None
        self.slots: AdapterSlots | None = None
        # What the engine runs, decided once prepared (``plan_engine``); boots add their own.
        self.plan: EnginePlan | None = None
        self.model_dir: Path | None = None
        self.zero_adapter = False
        # What loragate chose for the engine's memory, when the user did not.
        self.memory_plan: str | None = None
        # Whether the engine runs loragate's fixed CPU LoRA ops (loragate.engine_plugin).
        self.cpu_lora_ops = False
        # A catalog's placement of this model on its GPUs, set before start (None: planned
        # alone on the visible GPUs), and what the planned engine holds of each GPU.
        self.gpu_placement: Placement | None = None
        self.gpu_held: dict[int, int] | None = None
        self._lock = GatewayLock(self.cache_dir)
        self._prepared = asyncio.Event()
        self._prepare_error: str | None = None
        self._bootstrap_task: asyncio.Task[None] | None = None
        # Requests sent to the engine and not yet answered, and when the last one ended: what a
        # catalog reads to unload only an idle engine, the least recently used first.
        self.in_flight = 0
        self.last_used = time.monotonic()
        # Stopped by ``gateway models unload``: cold until loaded by hand or by a request.
        self.unloaded_by_hand = False
        # What the plan says the running engine holds, for a catalog's memory budget.
        self.memory_bytes: int | None = None
        # A catalog model unloaded by vLLM's sleep mode: the engine runs with it enabled.
        self.sleep_mode = self.spec.sleep
        # A catalog model: its part of a per-base-model adapters manifest (``models.ID``).
        self.fleet_part = fleet_part
        # What the catalog counts of it: requests past the room check and not yet handed to
        # the engine (waiting for its boot: it is idle, and may be unloaded, only with none of
        # these and none in flight); the boot under way that later requests wait on; its
        # loads, wakes and unloads, and why it was last unloaded.
        self.wanted = 0
        self.pending_load: asyncio.Future[None] | None = None
        self.loads = self.wakes = self.unloads = 0
        self.last_unload_reason: str | None = None
        # How far the start has come (download, dequantization, boot): /health, STATUS=.
        self.start_progress = WaitProgress(
            name=self.base_name, source=settings.model or "", stage="prepare"
        )
        self._engine_settled = asyncio.Event()  # ready or failed once: ``until_serving``
        self.supervisor.add_listener(self._engine_changed)

    # ----- life cycle ---------------------------------------------------------------------

    async def start(self, serves_once_booted: bool = False) -> None:
        """Prepare the model and adapters in the background; ``load`` boots the engine (the
        catalog decides when). ``serves_once_booted``: the start is over (``until_serving``)
        only once the engine has booted or failed, not once prepared (a gateway's one model)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        if self.spares is not None:
            await asyncio.to_thread(self.spares.end_stale)
        self._serves_once_booted = serves_once_booted
        self._bootstrap_task = asyncio.create_task(self._bootstrap(), name="engine-bootstrap")

    async def stop(self) -> None:
        task = self._bootstrap_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.fleet is not None:
            await self.fleet.aclose()
        if self.manager is not None:
            await self.manager.aclose()
        await self.supervisor.stop()
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)
        await self.engine.aclose()
        self._lock.release()

    def _engine_changed(self, state: EngineState, reason: str) -> None:
        if state == EngineState.STARTING and self._prepared.is_set():
            self.start_progress.enter("boot")
        elif state == EngineState.READY:
            self.start_progress.enter("done")
            self.unloaded_by_hand = False
        if state in (EngineState.STARTING, EngineState.RESTARTING):
            self._engine_settled.clear()  # a boot under way: ready, failed or stopped next
        elif state in (EngineState.READY, EngineState.FAILED, EngineState.STOPPED):
            self._engine_settled.set()  # stopped while booting: cold, and a cold model serves

    def service_start(self) -> ServiceStart:  # how the start goes, for systemd: itself
        return self

    async def until_serving(self) -> bool:
        """True once it serves: its engine is ready (a catalog's cold model: once prepared);
        False when the start gave up (not prepared, or its engine failed)."""
        await self._prepared.wait()
        booting = self._serves_once_booted or self.supervisor.state != EngineState.STOPPED
        if self._prepare_error is None and booting:
            await self._engine_settled.wait()
        return self._prepare_error is None and self.supervisor.state != EngineState.FAILED

    def add_status_listener(self, listener: Callable[[str], None]) -> None:
        """``listener`` gets ``engine STATE: reason`` on each of the engine's transitions."""
        self.supervisor.add_listener(lambda state, why: listener(f"engine {state}: {why}"))

    def describe_start(self) -> str | None:
        """What the start waits on, in one line (None once over, or for a cold model); a
        boot's phase is the supervisor's latest report."""
        record = self.start_progress
        failed = self._prepare_error is not None or self.supervisor.state == EngineState.FAILED
        if record.finished or failed or (self._prepared.is_set() and record.stage != "boot"):
            return None
        if record.stage == "boot":
            record.message = self.supervisor.boot_progress or "engine starting"
        return record.describe()

    def start_report(self) -> dict[str, Any] | None:
        """The start's progress record for ``/health`` while it lasts, else None."""
        return None if self.describe_start() is None else self.start_progress.as_dict()

    async def _bootstrap(self) -> None:
        # The model's download and dequantization report into this record (context variable).
        current_progress.set(self.start_progress)
        try:
            await self._prepare()
        except Exception as exc:
            preflight = isinstance(exc, PreflightError)  # its own words: what to change
            self._prepare_error = (
                str(exc) if preflight else f"could not prepare the model and adapters: {exc}"
            )
            log.error(self._prepare_error)
            self.start_progress.error = self._prepare_error
            self.start_progress.enter("failed")
            self._prepared.set()
            return
        assert self.manager is not None
        self.supervisor.add_ready_hook(self.manager.on_engine_ready)
        if self._serves_once_booted:
            self.start_progress.enter("boot")  # in the same step: the start goes on (systemd)
        self._prepared.set()

    @property
    def prepared(self) -> bool:
        """Whether the model and adapters are set up (successfully or not)."""
        return self._prepared.is_set()

    @property
    def prepare_error(self) -> str | None:
        return self._prepare_error

    async def until_prepared(self, deadline: float | None) -> None:
        """Return once the model and adapters are set up (or could not be); with a
        ``deadline``, ``NotServing`` (``engine_starting``) when they are not by then."""
        if self._prepared.is_set():
            return
        if deadline is None:
            await self._prepared.wait()
            return
        try:
            await asyncio.wait_for(self._prepared.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise NotServing(
                "the gateway is still preparing the model; retry shortly",
                "engine_starting",
                retry_after=10,
            ) from None

    async def load(self, reason: str) -> None:
        """Boot the engine of a started backend whose engine is stopped (a cold model), once
        a stop under way has ended."""
        await self._prepared.wait()
        while self.supervisor.state == EngineState.STOPPING:
            await asyncio.sleep(0.05)
        if self._prepare_error is None and self.supervisor.state == EngineState.STOPPED:
            self.start_progress.enter("boot")
            await self.supervisor.start(reason)

    async def unload(self, reason: str) -> None:
        """Stop the engine, keeping the model, adapters and store: ``load`` boots it again."""
        await self.supervisor.stop(reason)

    async def _prepare(self) -> None:
        settings = self.settings
        self.plan = plan = await plan_engine(
            settings, self.cache_dir, self.gpu_placement, sleep_mode=self.sleep_mode
        )
        self.model_dir, self.sleep_mode = plan.model_dir, plan.spec.sleep_mode
        self.zero_adapter, self.cpu_lora_ops = plan.zero_adapter, plan.cpu_lora_ops
        self.memory_plan, self.memory_bytes = plan.memory_plan, plan.memory_bytes
        self.gpu_held = plan.gpu.held_bytes if plan.gpu is not None else None
        # The same CPU-build guard: never more distinct adapters in flight than engine slots.
        self.slots = AdapterSlots(plan.spec.max_loras) if plan.zero_adapter else None
        self.manager = adapter_manager_for(
            settings,
            self.cache_dir,
            plan.model_dir,
            plan.base_config,
            engine=self.engine,
            supervisor=self.supervisor,
            base_name=self.base_name,
            zero_adapter=plan.zero_adapter,
            preset_rules=self.preset_rules,
        )
        # A cold model (a catalog's, or one unloaded by hand) records adapter changes for
        # its next boot instead of waiting for an engine nobody is booting.
        self.manager.declare_while_stopped = True
        self.fleet = fleet_reconciler_for(settings, self.manager, self.fleet_part)
        # With a manifest, it names every adapter (the demo's and a Vi run's included).
        await self.manager.declare_all([] if self.fleet is not None else list(plan.boot_loras))
        self.manager.follower.sync()
        self.manager.store_watch.start()
        if self.fleet is not None:
            self.fleet.start()

    def _engine_spec(self, socket_path: Path, api_key: str) -> EngineSpec:
        """The plan's engine spec for one boot: on ``socket_path``, with ``api_key`` and the
        adapters the manager boots with now."""
        assert self.plan is not None and self.manager is not None
        return self.plan.spec.for_boot(socket_path, api_key, self.manager.boot_modules())

    # ----- what the routes ask --------------------------------------------------------------

    def max_model_len(self) -> int | None:
        """The engine's context length: from its model list once it has booted, else from a
        ``--max-model-len`` after ``--``."""
        if self.engine.max_model_len is not None:
            return self.engine.max_model_len
        given = engine_arg_value(list(self.settings.engine_args), "--max-model-len")
        return int(given) if given is not None and given.isdigit() else None

    def model_ids(self) -> list[str]:
        if self.manager is None:
            return [self.base_name]
        if self.unloaded_by_hand:
            return self.servable_models()  # cold: what its next boot serves, as in a catalog
        return self.manager.public_models()

    def model_preset(self, model: str) -> dict[str, Any] | None:
        return self.manager.model_preset(model) if self.manager is not None else None

    def servable_models(self) -> list[str]:
        """The base, then every adapter it will serve once its engine boots: those routed now
        and those its manifest declares (a catalog lists these while the engine is cold)."""
        if self.manager is None:
            return [self.base_name]
        declared = self.manager.manifest_names() | set(self.manager.public_models())
        return [self.base_name, *sorted(declared - {self.base_name})]

    def health(self) -> tuple[bool, dict[str, Any]]:
        state = self.supervisor.state
        if self._prepare_error is not None:
            return False, {"status": "failed", "reason": self._prepare_error}
        if self.unloaded_by_hand and state == EngineState.STOPPED:
            # Ready: the next request boots it (a load balancer must keep sending them).
            reason = "unloaded by an admin (gateway models unload): the next request boots it"
            return True, {"status": "healthy", "reason": reason, "models": self.model_ids()}
        if self.manager is None or (state == EngineState.STOPPED and not self._prepared.is_set()):
            return False, {"status": "starting", "reason": "preparing the model and adapters"}
        fleet: dict[str, Any] = (
            {"adapters_manifest": self.fleet.summary()} if self.fleet is not None else {}
        )
        body: dict[str, Any] = {
            "status": str(state),
            "reason": self.supervisor.reason,
            "models": self.model_ids(),
            **fleet,
        }
        if self.supervisor.boot_progress is not None:
            body["boot_progress"] = self.supervisor.boot_progress
        if self.supervisor.serving and self.fleet is not None and not self.fleet.applied_once:
            body["status"] = "starting"
            body["reason"] = "applying the adapters manifest" + (
                " (it could not be read: see GET /admin/adapters)"
                if self.fleet.manifest_error
                else ""
            )
            return False, body
        if self.supervisor.serving and self.manager.all_loaded:
            return True, {"status": "healthy", "models": self.model_ids(), **fleet}
        if self.supervisor.serving:
            body["status"] = "starting" if state == EngineState.READY else str(state)
            body["reason"] = (
                "adapters not loaded: "
                + "; ".join(f"{name}: {error}" for name, error in self.manager.failures.items())
                if self.manager.failures
                else "loading adapters"
            )
        return False, body

    @property
    def serves_now(self) -> bool:
        """Prepared, and its engine serves: a request needs no wait."""
        return self.supervisor.serving and self._prepared.is_set()

    async def until_engine_serves(self, deadline: float) -> None:
        """Return once the engine serves, or raise ``NotServing`` at ``deadline`` (or at once
        when the model could not be prepared, or its engine gave up)."""
        if self.supervisor.serving and self._prepared.is_set():
            return
        await self.until_prepared(deadline)
        if self._prepare_error is not None:
            raise NotServing(self._prepare_error, "engine_failed")
        try:
            await self.supervisor.wait_until_serving(max(0.0, deadline - time.monotonic()))
        except EngineUnavailable as exc:
            raise NotServing(str(exc), "engine_unavailable", exc.retry_after) from None

    async def lease(self, public_model: str | None, deadline: float) -> Lease:
        """The engine and adapter version for one request to ``public_model`` (None: it names
        none), the version leased (and its adapter slot taken) until ``Lease.done``. Call once
        ``until_engine_serves`` has returned."""
        manager, endpoint = self.manager, self.supervisor.endpoint
        if manager is None or endpoint is None:  # stopped since: wait for it again
            await self.until_engine_serves(deadline)
            manager, endpoint = self.manager, self.supervisor.endpoint
            assert manager is not None and endpoint is not None
        engine_id = (
            None if public_model is None else await self._lease(manager, public_model, deadline)
        )
        self.in_flight += 1
        return Lease(self, manager, endpoint, engine_id)

    async def _lease(self, manager: AdapterManager, public_model: str, deadline: float) -> str:
        """The engine id serving ``public_model``, leased (and its slot taken) until done."""
        engine_id = manager.acquire(public_model)
        if engine_id is None:
            raise ModelNotFound(public_model, self.model_ids())
        if self.slots is not None and not self.slots.try_acquire(engine_id):
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self.slots.acquire(engine_id)
            except BaseException as exc:
                manager.release(engine_id)
                if isinstance(exc, TimeoutError):
                    raise NotServing(
                        "too many adapters are busy in the engine; retry shortly",
                        "adapter_slots_busy",
                        retry_after=5,
                    ) from None
                raise
        return engine_id

    def rename_engine_ids(self, data: bytes) -> bytes:
        """Adapter version ids in ``data`` (the engine's metric labels) to public names."""
        if self.manager is None:
            return data
        return AnyVersionRename(self.manager.base_engine_id, self.base_name).everywhere(data)

    def answered(self, manager: AdapterManager, engine_id: str | None) -> None:
        """A lease's ``done``: the answer to a request sent with ``engine_id`` has ended."""
        self.in_flight -= 1
        self.last_used = time.monotonic()
        if engine_id is not None:
            manager.release(engine_id)
            if self.slots is not None:
                self.slots.release(engine_id)

    # ----- what metrics and status read (``ObservableBackend``) ------------------------------

    def engine_snapshot(self) -> EngineSnapshot:
        return self.supervisor.snapshot()

    async def adapter_stats(self) -> AdapterStats | None:
        if self.manager is None:
            return None
        size = await asyncio.to_thread(self.manager.store_size)
        return self.manager.stats(store_bytes=size)

    async def engine_metrics(self) -> bytes | None:
        endpoint = self.supervisor.endpoint
        if endpoint is None or not self.supervisor.serving:
            return None
        return await scrape_engine_metrics(endpoint, self.rename_engine_ids)

    # ----- admin (``AdminBackend``) ----------------------------------------------------------

    async def engine_report(self) -> dict[str, Any]:
        info = self.supervisor.info()
        launcher = info.get("launcher_pid")
        rss = await asyncio.to_thread(tree_rss_bytes, launcher) if launcher else None
        return {
            **info,
            "memory": self.memory_plan,
            "cpu_lora_ops": self.cpu_lora_ops,
            "base_routing": "zero-adapter" if self.zero_adapter else "direct",
            "rss_bytes": rss,
            "spare_engine": self.spares.report() if self.spares is not None else None,
        }

    async def restart_engine(self) -> EngineSnapshot:
        await self.supervisor.restart()
        return self.supervisor.snapshot()

    # ----- what the catalog reads ------------------------------------------------------------

    @property
    def id(self) -> str:
        """Its id in the catalog: its served name."""
        return self.base_name

    @property
    def state(self) -> EngineState:
        return self.supervisor.state

    @property
    def asleep(self) -> bool:
        """Unloaded by vLLM's sleep mode: the engine runs, its weights in host memory."""
        return self.supervisor.asleep

    @property
    def residency(self) -> str:
        return residency(
            self.supervisor.state,
            prepared=self.prepared,
            failed=self._prepare_error is not None,
            asleep=self.asleep,
        )

    @property
    def idle(self) -> bool:
        return self.wanted == 0 and self.in_flight == 0

    @property
    def takes_requests(self) -> bool:
        """Up or coming up, and awake: a request for it goes straight to its engine."""
        return self.state in _RUNNING and not self.asleep

    def occupant(self) -> Occupant:
        """This model as the room decision (``loragate.serving.eviction``) sees it."""
        residency = self.residency
        if residency == LOADING and self.state == EngineState.STOPPED:
            residency = COLD  # still being prepared: no engine yet, it holds nothing
        asleep = asleep_hold(self.gpu_placement, self.gpu_held)
        return Occupant(
            self.id,
            residency,
            last_used=self.last_used,
            requests=self.wanted + self.in_flight,
            memory_bytes=self.memory_bytes,
            held_bytes=self.gpu_held,
            asleep_bytes=asleep.gpu_bytes,
            asleep_held=asleep.gpus,
            asleep_host_bytes=asleep.host_bytes,
            keep=self.spec.keep,
            sleeps=self.sleep_mode,
            ttl=self.spec.ttl,
        )

    def report(self) -> dict[str, Any]:
        """This model as ``/admin/models`` (``gateway models list``) shows it."""
        _, health = self.health()
        asleep = asleep_hold(self.gpu_placement, self.gpu_held)
        return {
            "id": self.id,
            "model": self.spec.model,
            "residency": self.residency,
            "state": str(self.state),
            "reason": health.get("reason") or self.supervisor.reason,
            "adapters": [name for name in self.servable_models() if name != self.id],
            "memory_bytes": self.memory_bytes,
            # What it still holds asleep: of its GPUs, and of host memory (its weights).
            "asleep_gpu_bytes": asleep.gpu_bytes if self.asleep else None,
            "asleep_host_bytes": asleep.host_bytes if self.asleep else None,
            "in_flight": self.in_flight,
            "idle_seconds": round(time.monotonic() - self.last_used, 1),
            "loads": self.loads,
            "wakes": self.wakes,
            "unloads": self.unloads,
            "sleep_mode": self.sleep_mode,
            "last_unload_reason": self.last_unload_reason,
            "keep": self.spec.keep,
            "ttl": self.spec.ttl,
        }
