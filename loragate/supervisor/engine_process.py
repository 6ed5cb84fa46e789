"""One boot's processes at the OS level: the launcher started in a session of its own, the
vLLM API server under it, and whatever of the boot outlives the launcher.

The supervisor decides when to spawn, reap and terminate; this module knows how: the launcher
command, the pidfile a later gateway reads to end a stale engine, the tag and process group
that find a boot's processes once their launcher is gone (``process_tree``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from loragate.logs import hide_secrets
from loragate.supervisor.engine_command import redacted, secret_values
from loragate.supervisor.engine_exit import ExitInfo, exit_future
from loragate.supervisor.engine_log import EngineLogFile, EngineOutput
from loragate.supervisor.pidfile import EnginePidFile
from loragate.supervisor.process_tree import ENGINE_TAG, kill_boot, kill_tree_now, stop_tree

log = logging.getLogger("loragate.supervisor")
# How long a reap waits for the boot's last output to reach the log file (what failure
# reports read next): its processes are dead by then, so the pipe is at its end.
_OUTPUT_DRAIN_SECONDS = 5.0


@dataclass(frozen=True)
class BootMark:
    """What finds a boot's processes once its launcher is gone: the launcher's pid (their
    process group) and start time, and the tag in their environment."""

    tag: str
    group: int
    started: float


class EngineProcess:
    """The launcher of the current boot (at most one at a time) and what is known of it."""

    def __init__(self, cache_dir: Path, log_path: Path) -> None:
        self._log_file = EngineLogFile(log_path, max_bytes=0)  # sized by each spawn
        self._output: EngineOutput | None = None
        self._pidfile = EnginePidFile(cache_dir)
        self._proc: subprocess.Popen[bytes] | None = None
        # (launcher pid, API server pid, its create time): see ``engine_pid``.
        self._api_server: tuple[int, int, float] | None = None
        self._boot_mark: BootMark | None = None
        # Settles with the launcher's exit code; replaced by each spawn.
        self.exited: asyncio.Future[int] | None = None
        self._spawned_at: float | None = None
        self.last_exit: ExitInfo | None = None

    @property
    def launcher_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

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

    def engine_alive(self) -> bool:
        pid = self.engine_pid
        if pid is None:
            return False
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    @property
    def uptime_s(self) -> float | None:
        if self._spawned_at and self._proc:
            return round(time.time() - self._spawned_at, 1)
        return None

    def end_stale_engine(self) -> None:
        """End an engine a previous gateway left running (blocking: waits for it to go)."""
        self._pidfile.end_stale_engine()

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        grace: float,
        log_to_stderr: bool,
        log_max_bytes: int,
    ) -> None:
        """Start ``argv`` under the launcher, which gives the engine ``grace`` seconds to stop;
        its output goes through a pipe to the log file (rotated past ``log_max_bytes``) and,
        when ``log_to_stderr``, to the gateway's stderr."""
        env["LORAGATE_PARENT_PID"] = str(os.getpid())
        tag = secrets.token_hex(8)
        env[ENGINE_TAG] = tag
        launcher = [sys.executable, "-m", "loragate.supervisor.launcher", "--grace", f"{grace:g}"]
        launcher += ["--", *argv]
        self._log_file.max_bytes = log_max_bytes
        self._log_file.start_boot()
        # The engine may print its arguments (vLLM does, and argparse quotes a bad one): its
        # secrets are hidden in every log line and tail shown from now on (``loragate.logs``).
        hide_secrets(secret_values(argv))
        log.info("spawning engine: %s", " ".join(redacted(argv)))
        self._proc = subprocess.Popen(
            launcher,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        self._output = EngineOutput(self._proc.stdout, self._log_file, to_stderr=log_to_stderr)
        self._output.start()
        self._boot_mark = BootMark(
            tag, self._proc.pid, psutil.Process(self._proc.pid).create_time()
        )
        self._pidfile.write(self._proc.pid, tag)
        self._spawned_at = time.time()
        self.exited = exit_future(self._proc)

    async def sweep_earlier_boot(self) -> None:
        """Kill whatever is left of the previous boot, so nothing of it outlives the next."""
        await self._sweep(self._boot_mark)

    async def reap(self) -> ExitInfo:
        """Record the launcher's exit and kill whatever of its boot still runs: when the
        launcher itself was killed, the engine's processes are no longer under it."""
        info = self._record_exit()
        await self._sweep(self._boot_mark)
        await self._drain_output()
        return info

    async def _drain_output(self) -> None:
        output = self._output
        if output is not None:
            await asyncio.to_thread(output.join, _OUTPUT_DRAIN_SECONDS)

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

    async def terminate(self, graceful: bool, stop_timeout: float) -> None:
        """End the launcher's whole tree: SIGTERM, then SIGKILL after ``stop_timeout`` when
        ``graceful``, at once otherwise; then sweep what of the boot escaped the tree."""
        # This boot's, taken now: supervision may spawn the next one while this awaits.
        proc, exited, mark = self._proc, self.exited, self._boot_mark
        if proc is None:
            return
        if graceful:
            await asyncio.to_thread(stop_tree, proc.pid, stop_timeout)
        else:
            await asyncio.to_thread(kill_tree_now, proc.pid)
        if exited is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(exited), 10)
        await self._sweep(mark)
        if self._proc is proc:
            self._pidfile.clear()
            await self._drain_output()
