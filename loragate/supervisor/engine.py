"""The engine supervisor: spawn, health, restart with backoff, crash-loop breaker, clean stop.

Its whole life reads top to bottom in ``_life``: boot (starting -> ready), watch (ready <->
unhealthy) until the process exits or stops answering, then restart with backoff, or give up
(failed) after ``crash_loop_limit`` failures within ``crash_loop_window``. A catalog's engine
may be put to sleep (vLLM's sleep mode) while ready: asleep, it is probed with /health alone,
never killed for its silence, takes no adapter call, and when it exits it is stopped, not
restarted (a restart would come up awake, outside the catalog's room check). Every transition
goes through ``_transition`` (checked against ``states.TRANSITIONS``) and is logged with its
reason; all of them are in this file, with what the life decides by: the endpoint a booted
engine listens on, the health probe, the boot's progress reports, the backoff and the
crash-loop count. Its timings are the ``supervision`` settings group itself.

Beside it: the processes at the OS level (``process``), why a boot failed (``failure``), the
engine's output (``output``) and command line (``command``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.engine_states import (
    RECOVERING,
    SERVING,
    EngineSnapshot,
    EngineState,
    check_transition,
)
from loragate.http import oneshot
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.command import EngineSpec, engine_argv, engine_env
from loragate.supervisor.failure import (
    BootFailed,
    ExitInfo,
    current_boot,
    exited_during_boot,
    last_boot_lines,
    summarize_failure,
)
from loragate.supervisor.output import boot_phase, tail_lines
from loragate.supervisor.process import EngineProcess
from loragate.supervisor.spare import SpareEngines
from loragate.supervisor.unix_socket import EngineSocket, EngineSocketError

# Where a booted engine listens and the key it takes: all a client of the engine needs.
# Names no address: every client connects to the endpoint's socket. A request that took this
# URL without the socket fails to resolve "engine" instead of reaching some TCP port.
ENGINE_BASE_URL = "http://engine"

log = logging.getLogger("loragate.supervisor")


@dataclass(frozen=True)
class EngineEndpoint:
    """Where the engine listens: the Unix socket ``uds`` (see ``engine_socket``), reached with
    ``base_url`` for paths and the Host header, and ``api_key``, its per-boot key."""

    uds: str
    api_key: str
    base_url: str = ENGINE_BASE_URL

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


# The engine's health probe: GET /health over its socket, and optionally a one-token
# completion, which also catches an engine whose API answers while its core is stuck.


async def probe_engine(
    endpoint: EngineEndpoint | None, timeout: float, *, deep_model: str | None = None
) -> bool:
    """Whether the engine answers; ``deep_model`` names the model for the deep probe (None:
    /health only)."""
    if endpoint is None:
        return False
    try:
        response = await oneshot.request(
            "GET", f"{endpoint.base_url}/health", timeout=timeout, uds=endpoint.uds
        )
        if response.status != 200:
            return False
        if deep_model is not None:
            response = await oneshot.request(
                "POST",
                f"{endpoint.base_url}/v1/completions",
                timeout=timeout,
                uds=endpoint.uds,
                headers=endpoint.headers,
                json={"model": deep_model, "prompt": "ping", "max_tokens": 1},
            )
            return response.status == 200
        return True
    except oneshot.PlainHTTPError as exc:
        log.debug("health probe failed: %s", exc)
        return False


# How far a boot has come, from the engine's log, reported every ``BOOT_REPORT_SECONDS`` so a
# start-up of several minutes says what it is doing (in the log, in /health, and as the message
# of the gateway's start progress record in its ``boot`` stage, which systemd's ``STATUS=``
# shows).

BOOT_REPORT_SECONDS = 15.0  # how often a boot says how far it has come


class BootProgress:
    """One boot's clock: when it started and when its next report is due."""

    def __init__(self, log_path: Path) -> None:
        self._log_path = log_path
        self.started = time.monotonic()
        self._next_report = self.started + BOOT_REPORT_SECONDS

    def report_if_due(self) -> str | None:
        """A fresh account of the boot (also logged) when one is due, else None."""
        if time.monotonic() < self._next_report:
            return None
        self._next_report += BOOT_REPORT_SECONDS
        elapsed = time.monotonic() - self.started
        lines = current_boot(tail_lines(self._log_path, 80, max_bytes=64 * 1024))
        progress = f"{elapsed:.0f} s so far: {boot_phase(lines)}"
        log.info("engine starting, %s", progress)
        return progress


# How long to wait before booting the engine again after a failure.
def restart_delay(failures: int, base: float, cap: float) -> float:
    """Exponential in the recent ``failures`` (``base``, twice that, ... up to ``cap``), with
    ±20 % jitter so that several gateways on one machine do not restart in step."""
    delay = min(base * 2 ** (failures - 1), cap)
    return delay * random.uniform(0.8, 1.2)


SpecBuilder = Callable[[Path, str], EngineSpec]
StateListener = Callable[[EngineState, str], None]
ReadyHook = Callable[[], Awaitable[None]]


class EngineUnavailable(Exception):
    """The engine cannot take a request now; ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineSupervisor:
    def __init__(
        self,
        build_spec: SpecBuilder,
        *,
        cache_dir: Path,
        timings: SupervisionFields | None = None,
        spares: SpareEngines | None = None,
    ) -> None:
        self._build_spec = build_spec
        # Where a boot finds an engine that has imported vLLM already (a catalog's, shared).
        self._spares = spares
        self.timings = timings or SupervisionFields()
        self.log_path = cache_dir / "logs" / "engine.log"
        self._process = EngineProcess(cache_dir, self.log_path)
        self._socket = EngineSocket(cache_dir)
        self.state = EngineState.STOPPED
        self.reason = "not started"
        self.boot_progress: str | None = None  # while booting: time so far and what it does
        self.state_since = time.time()
        self.endpoint: EngineEndpoint | None = None
        self.restarts = 0
        self._crash_loop = CrashLoopBreaker()
        self._listeners: list[StateListener] = []
        self._ready_hooks: list[ReadyHook] = []
        self._changed = asyncio.Event()
        self._restart_requested = asyncio.Event()
        self._controlled_restart = False
        self._life_task: asyncio.Task[None] | None = None
        self._served_name = ""
        self._boot_env: dict[str, str] = {}
        self._ready_since: float | None = None
        self.waiting = 0
        self.queue_size = 256
        # vLLM's sleep mode: asleep from just before /sleep is sent until /wake_up answered.
        self._asleep = False
        self._sleep_changed = asyncio.Event()
        self._adapter_calls = 0  # under way in ``kept_awake``: a sleep waits for them

    # ----- public interface -------------------------------------------------------------

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def add_ready_hook(self, hook: ReadyHook) -> None:
        """Run ``hook`` after each boot answers /health and before the engine counts as ready."""
        self._ready_hooks.append(hook)

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    @property
    def engine_pid(self) -> int | None:
        """The vLLM API server's pid (the launcher's child), while that very process runs."""
        return self._process.engine_pid

    @property
    def launcher_pid(self) -> int | None:
        return self._process.launcher_pid

    @property
    def last_exit(self) -> ExitInfo | None:
        return self._process.last_exit

    async def start(self, reason: str = "gateway started") -> None:
        """End a stale engine left by a previous gateway, then boot in the background."""
        await asyncio.to_thread(self._process.end_stale_engine)
        # Starting now, not when the task first runs: a request that arrives at once waits.
        self._transition(EngineState.STARTING, reason)
        self._life_task = asyncio.create_task(self._life(), name="engine-supervisor")

    async def stop(self, reason: str = "gateway is shutting down") -> None:
        """Stop the engine and every process it started: SIGTERM, then SIGKILL after a timeout."""
        if self.state == EngineState.STOPPED:
            return
        if self.state != EngineState.STOPPING:
            self._transition(EngineState.STOPPING, reason)
        if self._life_task is not None:
            self._life_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._life_task
        await self._terminate(graceful=True)
        self._socket.remove()
        self._transition(EngineState.STOPPED, "stopped")

    async def restart(self, reason: str = "restart requested by an admin") -> None:
        """A controlled restart: no backoff, the crash-loop history is cleared."""
        self._crash_loop.clear()
        if self.state == EngineState.FAILED:
            # Starting now, so that a request arriving at once waits for this boot.
            self._transition(EngineState.STARTING, reason)
            self._restart_requested.set()
            return
        self._controlled_restart = True
        self.reason = reason
        await self._terminate(graceful=True)

    async def wait_until_serving(self, timeout: float) -> None:
        """Wait (bounded queue, deadline) until the engine takes requests, or raise EngineUnavailable."""
        if self.state in SERVING:
            return
        if self.state not in RECOVERING:
            raise EngineUnavailable(f"the engine is {self.state}: {self.reason}", retry_after=30)
        if self.waiting >= self.queue_size:
            raise EngineUnavailable(
                f"the engine is {self.state} and {self.waiting} requests are already waiting; retry later"
            )
        self.waiting += 1
        deadline = time.monotonic() + timeout
        try:
            while self.state not in SERVING:
                if self.state not in RECOVERING:
                    raise EngineUnavailable(
                        f"the engine is {self.state}: {self.reason}", retry_after=30
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineUnavailable(
                        f"the engine did not become ready within {timeout:g} s (it is {self.state})"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)
        finally:
            self.waiting -= 1

    def snapshot(self) -> EngineSnapshot:
        """The supervision as it is now, as one frozen value (what routes and metrics read)."""
        last_exit = self.last_exit
        state, reason, pid = self.state, self.reason, self.engine_pid
        if state in SERVING and pid is None:
            # Never "ready" without a live API server: its exit is being noticed right now.
            state = EngineState.UNHEALTHY
            reason = "the engine's API server is not running; the supervisor is ending this boot"
        return EngineSnapshot(
            state=state,
            reason=reason,
            since=self.state_since,
            boot_progress=self.boot_progress,
            pid=pid,
            launcher_pid=self.launcher_pid,
            uptime_s=self._process.uptime_s,
            restarts=self.restarts,
            last_exit=last_exit.describe() if last_exit else None,
            last_exit_at=last_exit.at if last_exit else None,
            waiting_requests=self.waiting,
            log_file=self.log_path,
        )

    def info(self, log_lines: int = 40) -> dict[str, Any]:
        return {**self.snapshot().as_dict(), "log_tail": tail_lines(self.log_path, log_lines)}

    # ----- vLLM's sleep mode (a catalog's engine) ----------------------------------------

    @property
    def asleep(self) -> bool:
        """Asleep, vLLM's /health answers (entrypoints/serve/instrumentator/health.py:22-33,
        v1/engine/async_llm.py:1089-1092), a generation waits for the wake in the paused
        scheduler (v1/engine/core.py:921-953), and a LoRA load writes slots allocated in the
        weights pool sleep unmapped (v1/worker/gpu_worker.py:587-593, gpu_model_runner.py:
        5066-5069, lora/model_manager.py:346-393)."""
        return self._asleep

    async def falling_asleep(self) -> None:
        """Mark the engine asleep, before /sleep is sent: from now on it is probed with /health
        alone and no adapter call starts (``kept_awake``); returns once those under way ended."""
        self._set_asleep(True)
        while self._adapter_calls:
            await self._sleep_changed.wait()

    def woke(self) -> None:
        """The engine answered /wake_up: probed, and adapter calls taken, as before."""
        self._set_asleep(False)

    @contextlib.asynccontextmanager
    async def kept_awake(self) -> AsyncIterator[bool]:
        """For an adapter call: False when the engine is asleep (nothing may be loaded into
        it); else True, and a sleep waits for the block to end."""
        awake = not self._asleep
        self._adapter_calls += awake
        try:
            yield awake
        finally:
            self._adapter_calls -= awake
            self._set_asleep(self._asleep)  # a sleep waiting for this call goes on

    async def until_awake(self) -> None:
        """Return once the engine is not asleep: woken, or stopped (then cold)."""
        while self._asleep:
            await self._sleep_changed.wait()

    def _set_asleep(self, asleep: bool) -> None:
        if asleep != self._asleep:
            log.info("engine %s", "going to sleep" if asleep else "awake")
        self._asleep = asleep
        changed, self._sleep_changed = self._sleep_changed, asyncio.Event()
        changed.set()

    # ----- the life cycle ----------------------------------------------------------------

    async def _life(self) -> None:
        # Supervision ends only when an asleep engine exits (stopped); whatever goes wrong
        # ends in `failed`, from which an admin restart always starts a new boot.
        reason = "gateway started"
        while True:
            try:
                await self._supervise(reason)
                return  # an asleep engine exited: stopped, until started again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not leave a dead supervisor claiming "ready"
                log.exception("engine supervision failed")
                with contextlib.suppress(Exception):
                    await self._terminate(graceful=False)
                await self._give_up(f"supervisor error: {exc!r}")
            reason = "restart requested by an admin"

    async def _supervise(self, reason: str) -> None:
        while True:
            try:
                await self._boot(reason)
                reason = await self._watch()
                if self._asleep:
                    await self._stop_asleep(reason)
                    return
            except BootFailed as failure:
                if failure.permanent and not self._controlled_restart:
                    await self._give_up(
                        f"{failure}. This is a configuration problem that a restart would "
                        "repeat: fix it, then POST /admin/engine/restart or restart the gateway "
                        f"(engine log: {self.log_path})"
                    )
                    reason = "restart requested by an admin"
                    continue
                reason = str(failure)
            if self._controlled_restart:
                self._controlled_restart = False
                self._transition(EngineState.RESTARTING, self.reason)
                self.restarts += 1
                reason = self.reason
                continue
            if await self._after_failure(reason):
                reason = "restart requested by an admin"

    async def _stop_asleep(self, reason: str) -> None:
        """An asleep engine that exited (or an admin restarted) is stopped: restarted, it would
        come up awake, holding its memory outside the catalog's room check."""
        self._controlled_restart = False
        self._ready_since = None
        self._transition(EngineState.STOPPING, f"{reason} while asleep")
        await self._terminate(graceful=True)  # what of its process group is left
        self._socket.remove()
        self._transition(
            EngineState.STOPPED, f"{reason} while asleep; stopped: the next request boots it"
        )

    async def _give_up(self, reason: str) -> None:
        """Sit in `failed` with ``reason`` until an admin asks for a restart."""
        self._ready_since = None
        self._restart_requested.clear()
        self._force_state(EngineState.FAILED, reason)
        await self._restart_requested.wait()
        self._restart_requested.clear()
        self._crash_loop.clear()

    async def _after_failure(self, reason: str) -> bool:
        """Back off before the next boot; True when it gave up (crash loop) and an admin has
        asked for a restart since."""
        timings = self.timings
        now, ready_since = time.monotonic(), self._ready_since
        failures = self._crash_loop.record(
            now, ready_since, stable_after=timings.stable_after, window=timings.crash_loop_window
        )
        self._ready_since = None
        self._transition(EngineState.RESTARTING, reason)
        if failures >= timings.crash_loop_limit:
            await self._give_up(
                f"{reason}; gave up after {failures} failures within "
                f"{timings.crash_loop_window:g} s (POST /admin/engine/restart to try again). "
                f"Last engine error: {summarize_failure(last_boot_lines(self.log_path))}"
            )
            return True
        delay = restart_delay(failures, timings.restart_backoff, timings.restart_backoff_max)
        self.reason = f"{reason}; restarting in {delay:.1f} s"
        log.info("engine restarts in %.1f s", delay)
        self.restarts += 1
        await asyncio.sleep(delay)
        return False

    async def _boot(self, reason: str) -> None:
        if self.state != EngineState.STARTING:
            self._transition(EngineState.STARTING, reason)
        await self._spawn()
        exited = self._process.exited
        assert exited is not None
        self.boot_progress = None
        progress = BootProgress(self.log_path)
        deadline = progress.started + self.timings.startup_timeout
        while not await self._probe():
            report = progress.report_if_due()
            if report is not None:
                self.boot_progress = report  # so that /health can say how far it has come
            if exited.done():
                raise exited_during_boot(await self._process.reap(), self.log_path)
            if time.monotonic() > deadline:
                await self._terminate(graceful=False)
                raise BootFailed(
                    f"engine did not answer /health within {self.timings.startup_timeout:g} s"
                )
            await asyncio.wait({exited}, timeout=0.5)
        for hook in self._ready_hooks:
            await hook()
        self.boot_progress = None
        self._transition(EngineState.READY, "engine answers /health")
        self._ready_since = time.monotonic()
        if self._spares is not None:  # the next boot's, imported while this one serves
            self._spares.replenish(self._boot_env)

    async def _watch(self) -> str:
        """Watch a ready engine until it exits or hangs; returns why it must restart."""
        exited = self._process.exited
        assert exited is not None
        failures = 0
        while True:
            await asyncio.wait({exited}, timeout=self.timings.probe_interval)
            if exited.done():
                return f"engine {(await self._process.reap()).describe()}"
            if await self._probe():
                failures = 0
                if self.state == EngineState.UNHEALTHY:
                    self._transition(EngineState.READY, "engine answers probes again")
                continue
            failures += 1
            if exited.done():
                continue
            if self._asleep:
                # Never killed asleep (a restart would come up awake): a dead engine core ends
                # the process (vLLM's API server exits after it), and a failed wake stops it.
                failures = 0
                continue
            if failures >= self.timings.probe_failures:
                if not self._process.engine_alive():
                    # The engine itself is gone and its launcher is still ending what it left:
                    # an exit, not a hang.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(exited), 5)
                    if exited.done():
                        return f"engine {(await self._process.reap()).describe()}"
                await self._terminate(graceful=False)
                await self._process.reap()
                return (
                    f"engine stopped answering health probes ({failures} in a row, "
                    f"{self.timings.probe_timeout:g} s timeout); killed it"
                )
            if self.state == EngineState.READY:
                self._transition(
                    EngineState.UNHEALTHY,
                    f"health probe failed ({failures}/{self.timings.probe_failures})",
                )

    # ----- process handling --------------------------------------------------------------

    async def _spawn(self) -> None:
        await self._process.sweep_earlier_boot()  # nothing of an earlier boot outlives it
        try:
            socket_path = self._socket.path_for_boot()
        except (EngineSocketError, OSError) as exc:
            raise BootFailed(f"cannot prepare the engine's socket: {exc}", permanent=True) from exc
        api_key = secrets.token_urlsafe(24)
        # Off the loop: building the spec verifies every boot adapter's SHA-256 (boot_modules).
        spec = await asyncio.to_thread(self._build_spec, socket_path, api_key)
        self._served_name = spec.served_name
        argv, env = engine_argv(spec), engine_env(spec)
        self._boot_env = dict(env)
        spare = self._spares.take(argv, env) if self._spares is not None else None
        self._process.spawn(
            argv,
            env,
            grace=self.timings.stop_timeout,
            log_to_stderr=spec.log_to_stderr,
            log_max_bytes=spec.log_max_bytes,
            taken=spare.proc if spare is not None else None,
        )
        self.endpoint = EngineEndpoint(str(socket_path), api_key)

    async def _terminate(self, graceful: bool) -> None:
        await self._process.terminate(graceful, self.timings.stop_timeout)

    async def _probe(self) -> bool:
        # Asleep, a generation waits for the wake (see ``asleep``): /health alone.
        deep = self.timings.deep_probe and self.state in SERVING and not self._asleep
        return await probe_engine(
            self.endpoint,
            self.timings.probe_timeout,
            deep_model=self._served_name if deep else None,
        )

    # ----- state --------------------------------------------------------------------------

    def _transition(self, target: EngineState, reason: str) -> None:
        check_transition(self.state, target)
        self._force_state(target, reason)

    def _force_state(self, target: EngineState, reason: str) -> None:
        log.info("engine %s -> %s: %s", self.state, target, reason)
        if target not in SERVING and self._asleep:
            self._set_asleep(False)  # stopping, or gone: a new boot comes up awake
        self.state = target
        self.reason = reason
        self.state_since = time.time()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in self._listeners:
            try:
                listener(target, reason)
            except Exception:  # a listener must never break supervision
                log.exception("engine state listener failed")


class CrashLoopBreaker:
    """When the engine failed recently. A run that stayed ready for ``stable_after`` seconds
    clears the count: failures hours apart are no crash loop."""

    def __init__(self) -> None:
        self._failures: deque[float] = deque()

    def __len__(self) -> int:
        return len(self._failures)

    def clear(self) -> None:
        self._failures.clear()

    def record(
        self, now: float, ready_since: float | None, *, stable_after: float, window: float
    ) -> int:
        """Count a failure at ``now`` (monotonic); returns how many fall within ``window``."""
        if ready_since is not None and now - ready_since >= stable_after:
            self._failures.clear()  # it ran fine for a while: this is no crash loop
        self._failures.append(now)
        while self._failures and now - self._failures[0] > window:
            self._failures.popleft()
        return len(self._failures)
