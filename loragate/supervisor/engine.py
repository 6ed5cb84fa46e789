"""The engine supervisor: spawn, health, restart with backoff, crash-loop breaker, clean stop.

Its whole life reads top to bottom in ``_life``: boot (starting -> ready), watch (ready <->
unhealthy) until the process exits or stops answering, then restart with backoff, or give up
(failed) after ``crash_loop_limit`` failures within ``crash_loop_window``. Every transition
goes through ``_transition`` (checked against ``states.TRANSITIONS``) and is logged with its
reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from loragate.http import oneshot
from loragate.supervisor.engine_command import EngineSpec, engine_argv, engine_env, redacted
from loragate.supervisor.engine_log import boot_phase, open_engine_log, tail_lines
from loragate.supervisor.engine_socket import EngineSocket, EngineSocketError
from loragate.supervisor.pidfile import EnginePidFile
from loragate.supervisor.process_tree import ENGINE_TAG, kill_boot, kill_tree_now, stop_tree
from loragate.supervisor.snapshot import EngineSnapshot
from loragate.supervisor.states import (
    RECOVERING,
    SERVING,
    EngineState,
    check_transition,
)

log = logging.getLogger("loragate.supervisor")

SpecBuilder = Callable[[Path, str], EngineSpec]
StateListener = Callable[[EngineState, str], None]
ReadyHook = Callable[[], Awaitable[None]]


# Names no address: every client connects to the endpoint's socket. A request that took this
# URL without the socket fails to resolve "engine" instead of reaching some TCP port.
ENGINE_BASE_URL = "http://engine"


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


@dataclass(frozen=True)
class ExitInfo:
    returncode: int
    at: float

    def describe(self) -> str:
        # The launcher reports a signal death of the engine as 128 + signal number.
        code = self.returncode
        if code < 0 or code > 128:
            signum = -code if code < 0 else code - 128
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(signum).name}"
        return f"exit code {code}"

    @property
    def is_error_exit(self) -> bool:
        """Exited with an error status of its own, not killed by a signal."""
        return 0 < self.returncode < 128


@dataclass(frozen=True)
class BootMark:
    """What finds a boot's processes once its launcher is gone: the launcher's pid (their
    process group) and start time, and the tag in their environment."""

    tag: str
    group: int
    started: float


@dataclass(frozen=True)
class SupervisorTimings:
    startup_timeout: float = 900.0
    probe_interval: float = 5.0
    probe_timeout: float = 5.0
    probe_failures: int = 3
    deep_probe: bool = False
    restart_backoff: float = 1.0
    restart_backoff_max: float = 30.0
    crash_loop_limit: int = 3
    crash_loop_window: float = 600.0
    stable_after: float = 120.0
    stop_timeout: float = 20.0


class EngineUnavailable(Exception):
    """The engine cannot take a request now; ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _BootFailed(Exception):
    """A boot that did not reach ready; ``permanent`` when another attempt would fail the same
    way (a configuration error: bad flag, too little memory, unsupported model, missing files)."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")
# Lines that only point elsewhere: vLLM's API server says these after the real error.
_WRAPPER_ERRORS = (
    "See root cause above",
    "Engine core initialization failed",
    "Engine process failed to start",
)
_BOOT_BANNER = "===== loragate: engine boot at"
BOOT_REPORT_SECONDS = 15.0  # how often a boot says how far it has come
# Start-up errors that another attempt can fix by itself (the next boot removes a stale socket).
_TRANSIENT_ERRORS = ("Address already in use", "EADDRINUSE")


def current_boot(lines: list[str]) -> list[str]:
    """The lines of ``lines`` written since the last boot banner (all of them if none)."""
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith(_BOOT_BANNER):
            return lines[index + 1 :]
    return lines


def root_cause(lines: list[str], limit: int = 600) -> str | None:
    """The engine's own root-cause line: the last ``SomethingError: ...`` line that is not a
    wrapper pointing at another, with the indented lines that continue it (pydantic puts the
    actual reason there). None when the log holds no error line."""
    found: int | None = None
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index]
        if not _ERROR_LINE.search(line):
            continue
        if found is None:
            found = index
        if not any(wrapper in line for wrapper in _WRAPPER_ERRORS):
            found = index
            break
    if found is None:
        return None
    parts = [lines[found].strip()]
    for follow in lines[found + 1 : found + 3]:
        if follow.startswith((" ", "\t")):
            parts.append(follow.strip())
    text = " ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize_failure(lines: list[str], limit: int = 600) -> str:
    """The most telling line of an engine log tail: its root cause, else its last line."""
    cause = root_cause(lines, limit)
    if cause is not None:
        return cause
    return lines[-1].strip()[:limit] if lines else "no output"


def _exit_future(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future for ``proc``'s exit code, from a daemon thread (never blocks interpreter exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def settle(code: int) -> None:
        if not future.done():
            future.set_result(code)

    def wait() -> None:
        code = proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, code)

    threading.Thread(target=wait, name=f"engine-wait-{proc.pid}", daemon=True).start()
    return future


class EngineSupervisor:
    def __init__(
        self,
        build_spec: SpecBuilder,
        *,
        cache_dir: Path,
        timings: SupervisorTimings | None = None,
    ) -> None:
        self._build_spec = build_spec
        self.timings = timings or SupervisorTimings()
        self.log_path = cache_dir / "logs" / "engine.log"
        self._pidfile = EnginePidFile(cache_dir)
        self._socket = EngineSocket(cache_dir)
        self.state = EngineState.STOPPED
        self.reason = "not started"
        self.boot_progress: str | None = None  # while booting: time so far and what it does
        self.state_since = time.time()
        self.endpoint: EngineEndpoint | None = None
        self.restarts = 0
        self.last_exit: ExitInfo | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        # (launcher pid, API server pid, its create time): see ``engine_pid``.
        self._api_server: tuple[int, int, float] | None = None
        self._boot_mark: BootMark | None = None
        self._exit: asyncio.Future[int] | None = None
        self._spawned_at: float | None = None
        self._failures: deque[float] = deque()
        self._listeners: list[StateListener] = []
        self._ready_hooks: list[ReadyHook] = []
        self._changed = asyncio.Event()
        self._restart_requested = asyncio.Event()
        self._controlled_restart = False
        self._life_task: asyncio.Task[None] | None = None
        self._served_name = ""
        self._ready_since: float | None = None
        self.waiting = 0
        self.queue_size = 256

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
        """The vLLM API server's pid (the launcher's child), while that very process runs.

        Remembered once found: when the API server dies, its own children (EngineCore,
        workers) become the launcher's until it ends them, and must not pass for it.
        """
        if self._proc is None or self._proc.poll() is not None:
            return None
        server = self._api_server
        if server is None or server[0] != self._proc.pid:
            with contextlib.suppress(psutil.Error):
                children = psutil.Process(self._proc.pid).children()
                if children:
                    child = children[0]
                    server = (self._proc.pid, child.pid, child.create_time())
                    self._api_server = server
            if server is None or server[0] != self._proc.pid:
                return None
        _, pid, created = server
        try:
            if psutil.Process(pid).create_time() == created:
                return pid
        except psutil.Error:
            pass
        return None

    def _engine_alive(self) -> bool:
        pid = self.engine_pid
        if pid is None:
            return False
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    @property
    def launcher_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    async def start(self) -> None:
        """End a stale engine left by a previous gateway, then boot in the background."""
        await asyncio.to_thread(self._pidfile.end_stale_engine)
        # Starting now, not when the task first runs: a request that arrives at once waits.
        self._transition(EngineState.STARTING, "gateway started")
        self._life_task = asyncio.create_task(self._life(), name="engine-supervisor")

    async def stop(self) -> None:
        """Stop the engine and every process it started: SIGTERM, then SIGKILL after a timeout."""
        if self.state == EngineState.STOPPED:
            return
        if self.state != EngineState.STOPPING:
            self._transition(EngineState.STOPPING, "gateway is shutting down")
        if self._life_task is not None:
            self._life_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._life_task
        await self._terminate(graceful=True)
        self._socket.remove()
        self._transition(EngineState.STOPPED, "stopped")

    async def restart(self, reason: str = "restart requested by an admin") -> None:
        """A controlled restart: no backoff, the crash-loop history is cleared."""
        self._failures.clear()
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
        return EngineSnapshot(
            state=self.state,
            reason=self.reason,
            since=self.state_since,
            boot_progress=self.boot_progress,
            pid=self.engine_pid,
            launcher_pid=self.launcher_pid,
            uptime_s=round(time.time() - self._spawned_at, 1)
            if self._spawned_at and self._proc
            else None,
            restarts=self.restarts,
            last_exit=self.last_exit.describe() if self.last_exit else None,
            last_exit_at=self.last_exit.at if self.last_exit else None,
            waiting_requests=self.waiting,
            log_file=self.log_path,
        )

    def info(self, log_lines: int = 40) -> dict[str, Any]:
        return {**self.snapshot().as_dict(), "log_tail": tail_lines(self.log_path, log_lines)}

    # ----- the life cycle ----------------------------------------------------------------

    async def _life(self) -> None:
        # Supervision never ends by itself: whatever goes wrong ends in `failed`, from which
        # an admin restart always starts a new boot.
        reason = "gateway started"
        while True:
            try:
                await self._supervise(reason)
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
            except _BootFailed as failure:
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

    async def _give_up(self, reason: str) -> None:
        """Sit in `failed` with ``reason`` until an admin asks for a restart."""
        self._ready_since = None
        self._restart_requested.clear()
        self._force_state(EngineState.FAILED, reason)
        await self._restart_requested.wait()
        self._restart_requested.clear()
        self._failures.clear()

    async def _after_failure(self, reason: str) -> bool:
        """Back off before the next boot; True when it gave up (crash loop) and an admin has
        asked for a restart since."""
        now = time.monotonic()
        if self._ready_since is not None and now - self._ready_since >= self.timings.stable_after:
            self._failures.clear()  # it ran fine for a while: this is no crash loop
        self._ready_since = None
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.timings.crash_loop_window:
            self._failures.popleft()
        self._transition(EngineState.RESTARTING, reason)
        if len(self._failures) >= self.timings.crash_loop_limit:
            lines = current_boot(tail_lines(self.log_path, 400, max_bytes=256 * 1024))
            await self._give_up(
                f"{reason}; gave up after {len(self._failures)} failures within "
                f"{self.timings.crash_loop_window:g} s (POST /admin/engine/restart to try again). "
                f"Last engine error: {summarize_failure(lines)}"
            )
            return True
        delay = min(
            self.timings.restart_backoff * 2 ** (len(self._failures) - 1),
            self.timings.restart_backoff_max,
        )
        delay *= random.uniform(0.8, 1.2)
        self.reason = f"{reason}; restarting in {delay:.1f} s"
        log.info("engine restarts in %.1f s", delay)
        self.restarts += 1
        await asyncio.sleep(delay)
        return False

    async def _boot(self, reason: str) -> None:
        if self.state != EngineState.STARTING:
            self._transition(EngineState.STARTING, reason)
        await self._spawn()
        assert self._exit is not None
        self.boot_progress = None
        started = time.monotonic()
        deadline = started + self.timings.startup_timeout
        next_report = started + BOOT_REPORT_SECONDS
        while not await self._probe():
            if time.monotonic() >= next_report:
                next_report += BOOT_REPORT_SECONDS
                self._report_boot(time.monotonic() - started)
            if self._exit.done():
                info = await self._reap()
                lines = current_boot(tail_lines(self.log_path, 400, max_bytes=256 * 1024))
                cause = root_cause(lines)
                raise _BootFailed(
                    f"engine exited during start-up ({info.describe()}): "
                    f"{cause or summarize_failure(lines)}",
                    permanent=info.is_error_exit
                    and cause is not None
                    and not any(text in cause for text in _TRANSIENT_ERRORS),
                )
            if time.monotonic() > deadline:
                await self._terminate(graceful=False)
                raise _BootFailed(
                    f"engine did not answer /health within {self.timings.startup_timeout:g} s"
                )
            await asyncio.wait({self._exit}, timeout=0.5)
        for hook in self._ready_hooks:
            await hook()
        self.boot_progress = None
        self._transition(EngineState.READY, "engine answers /health")
        self._ready_since = time.monotonic()

    def _report_boot(self, elapsed: float) -> None:
        """How far the boot has come, in the log and in ``info()`` (so /health can say)."""
        lines = current_boot(tail_lines(self.log_path, 80, max_bytes=64 * 1024))
        self.boot_progress = f"{elapsed:.0f} s so far: {boot_phase(lines)}"
        log.info("engine starting, %s", self.boot_progress)

    async def _watch(self) -> str:
        """Watch a ready engine until it exits or hangs; returns why it must restart."""
        assert self._exit is not None
        failures = 0
        while True:
            await asyncio.wait({self._exit}, timeout=self.timings.probe_interval)
            if self._exit.done():
                return f"engine {(await self._reap()).describe()}"
            if await self._probe():
                failures = 0
                if self.state == EngineState.UNHEALTHY:
                    self._transition(EngineState.READY, "engine answers probes again")
                continue
            failures += 1
            if self._exit.done():
                continue
            if failures >= self.timings.probe_failures:
                if not self._engine_alive():
                    # The engine itself is gone and its launcher is still ending what it left:
                    # an exit, not a hang.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self._exit), 5)
                    if self._exit.done():
                        return f"engine {(await self._reap()).describe()}"
                await self._terminate(graceful=False)
                await self._reap()
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
        await self._sweep(self._boot_mark)  # nothing of an earlier boot outlives it
        try:
            socket_path = self._socket.path_for_boot()
        except (EngineSocketError, OSError) as exc:
            raise _BootFailed(f"cannot prepare the engine's socket: {exc}", permanent=True) from exc
        api_key = secrets.token_urlsafe(24)
        # Off the loop: building the spec verifies every boot adapter's SHA-256 (boot_modules).
        spec = await asyncio.to_thread(self._build_spec, socket_path, api_key)
        self._served_name = spec.served_name
        argv = engine_argv(spec)
        env = engine_env(spec)
        env["LORAGATE_PARENT_PID"] = str(os.getpid())
        tag = secrets.token_hex(8)
        env[ENGINE_TAG] = tag
        grace = f"{self.timings.stop_timeout:g}"
        launcher = [sys.executable, "-m", "loragate.supervisor.launcher", "--grace", grace, "--"]
        launcher += argv
        log_handle = open_engine_log(self.log_path)
        log.info("spawning engine: %s", " ".join(redacted(argv)))
        try:
            self._proc = subprocess.Popen(
                launcher,
                stdin=subprocess.DEVNULL,
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            log_handle.close()
        self._boot_mark = BootMark(
            tag, self._proc.pid, psutil.Process(self._proc.pid).create_time()
        )
        self._pidfile.write(self._proc.pid, tag)
        self._spawned_at = time.time()
        self.endpoint = EngineEndpoint(str(socket_path), api_key)
        self._exit = _exit_future(self._proc)

    async def _reap(self) -> ExitInfo:
        """Record the launcher's exit and kill whatever of its boot still runs: when the
        launcher itself was killed, the engine's processes are no longer under it."""
        info = self._record_exit()
        await self._sweep(self._boot_mark)
        return info

    async def _sweep(self, mark: BootMark | None) -> None:
        """SIGKILL every process left of the boot ``mark`` names."""
        if mark is None:
            return
        killed = await asyncio.to_thread(kill_boot, mark.tag, mark.group, mark.started)
        if killed:
            log.warning("killed leftover engine processes of an ended boot: %s", killed)
        if self._boot_mark == mark:
            self._boot_mark = None

    def _record_exit(self) -> ExitInfo:
        assert self._proc is not None
        code = self._proc.poll()
        info = ExitInfo(returncode=code if code is not None else -9, at=time.time())
        self.last_exit = info
        return info

    async def _terminate(self, graceful: bool) -> None:
        # This boot's, taken now: supervision may spawn the next one while this awaits.
        proc, exited, mark = self._proc, self._exit, self._boot_mark
        if proc is None:
            return
        if graceful:
            await asyncio.to_thread(stop_tree, proc.pid, self.timings.stop_timeout)
        else:
            await asyncio.to_thread(kill_tree_now, proc.pid)
        if exited is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(exited), 10)
        await self._sweep(mark)
        if self._proc is proc:
            self._pidfile.clear()

    async def _probe(self) -> bool:
        endpoint = self.endpoint
        if endpoint is None:
            return False
        timeout = self.timings.probe_timeout
        try:
            response = await oneshot.request(
                "GET", f"{endpoint.base_url}/health", timeout=timeout, uds=endpoint.uds
            )
            if response.status != 200:
                return False
            if self.timings.deep_probe and self.state in SERVING:
                response = await oneshot.request(
                    "POST",
                    f"{endpoint.base_url}/v1/completions",
                    timeout=timeout,
                    uds=endpoint.uds,
                    headers=endpoint.headers,
                    json={"model": self._served_name, "prompt": "ping", "max_tokens": 1},
                )
                return response.status == 200
            return True
        except oneshot.PlainHTTPError as exc:
            log.debug("health probe failed: %s", exc)
            return False

    # ----- state --------------------------------------------------------------------------

    def _transition(self, target: EngineState, reason: str) -> None:
        check_transition(self.state, target)
        self._force_state(target, reason)

    def _force_state(self, target: EngineState, reason: str) -> None:
        log.info("engine %s -> %s: %s", self.state, target, reason)
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
