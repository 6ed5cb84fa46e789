"""One boot's processes at the OS level: the launcher started in a session of its own, the
vLLM API server under it, and whatever of the boot outlives the launcher.

The supervisor decides when to spawn, reap and terminate; this module knows how: the launcher
command and its parent-death signal, the lock and pidfile by which a later gateway ends a stale
engine, and the tag and process group that find a boot's processes once their launcher is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from loragate.logs import hide_secrets
from loragate.supervisor.command import redacted, secret_values
from loragate.supervisor.failure import ExitInfo, exit_future
from loragate.supervisor.output import EngineLogFile, EngineOutput

# A lock and pid file under the cache dir: one gateway per cache dir, and no stale engines.
#
# The gateway holds an flock on ``gateway.lock`` for its whole life. ``engine.pid`` records the
# engine launcher's pid and start time and the boot's tag (``process_tree.ENGINE_TAG``); a new
# gateway that finds it (after a crash or SIGKILL of the old one) ends that engine tree, and
# whatever is left of that boot, before spawning its own.
log = logging.getLogger("loragate.supervisor")


class CacheDirInUse(RuntimeError):
    pass


class GatewayLock:
    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / "gateway.lock"
        self._handle: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise CacheDirInUse(
                f"another loragate gateway (pid {owner}) is using the cache dir {self.path.parent}; "
                "stop it first or pass a different --cache-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


class EnginePidFile:
    def __init__(self, cache_dir: Path, name: str = "engine.pid") -> None:
        self.path = cache_dir / name

    def write(self, pid: int, tag: str | None = None) -> None:
        record = {
            "pid": pid,
            "create_time": psutil.Process(pid).create_time(),
            "gateway": os.getpid(),
            "tag": tag,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def end_stale_engine(self) -> int | None:
        """Kill the engine a previous gateway left behind: the launcher's tree if the launcher
        still runs, and what is left of its boot if not (``process_tree.boot_processes``); the
        launcher's pid if it still ran, else None."""
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.clear()
            return None
        if not isinstance(record, dict):
            self.clear()
            return None
        ended: int | None = None
        try:
            pid, started = int(record["pid"]), float(record["create_time"])
        except (TypeError, ValueError, KeyError):
            self.clear()
            return None
        with contextlib.suppress(psutil.Error):
            if abs(psutil.Process(pid).create_time() - started) < 0.01:
                ended = pid  # else gone, or the pid now names another process: spared
        if ended is not None:
            log.warning("ending a stale engine (pid %s) left by a previous gateway", ended)
            kill_tree_now(ended)
        tag = record.get("tag")
        leftovers = kill_boot(tag if isinstance(tag, str) and tag else None, pid, started)
        if leftovers:
            log.warning("ended stale engine processes left by a previous gateway: %s", leftovers)
        self.clear()
        return ended


# Linux parent-death signal: the kernel signals us when the process that spawned us dies.
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` when our parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def set_child_subreaper() -> bool:
    """Adopt our orphaned descendants (Linux >= 3.4): a process whose parent dies is
    reparented to us instead of to init, so it stays in our tree even if it left our process
    group or session. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


# Stopping a process, its process group and every descendant: SIGTERM first, SIGKILL after.
#
# When the launcher is gone, its descendants can no longer be found from it. A boot's processes
# are then found two ways (``boot_processes``): by its process group (the launcher's pid; the
# kernel does not reuse that number while any member lives, and members must be younger than
# the launcher), and by a tag in their environment (``ENGINE_TAG``), which also finds one that
# left the group. The tag alone is not enough: vLLM renames its EngineCore and Worker with
# setproctitle, which overwrites the memory /proc/PID/environ shows.
ENGINE_TAG = "LORAGATE_ENGINE_TAG"


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` to end; those still running. A zombie counts as
    gone. Never reaps: psutil's own wait would reap a child of ours (the launcher) before its
    ``Popen`` does, and ``Popen`` would then report exit code 0 for a killed launcher."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [proc for proc in procs if _running(proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    return members


def stop_tree(pid: int, timeout: float) -> None:
    """End ``pid`` (a process-group leader), its group and all descendants; blocks up to ``timeout``.

    The group catches what vLLM's multiprocessing spawns; the psutil sweep catches anything
    that moved to another group. Whatever still lives after ``timeout`` gets SIGKILL.
    """
    try:
        leader = psutil.Process(pid)
        victims = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        victims = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        victims += [p for p in group_members(os.getpgid(pid)) if p not in victims]
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    alive = wait_gone(victims, timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_gone(alive, 5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_tree_now(pid: int) -> None:
    """SIGKILL ``pid``'s whole tree at once (no grace), e.g. after a hang."""
    victims = []
    with contextlib.suppress(psutil.Error):
        victims = [psutil.Process(pid), *descendants(pid)]
    signal_group(pid, signal.SIGKILL)
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + 5
    wait_gone(victims, max(0.0, deadline - time.monotonic()))


def boot_processes(tag: str | None, group: int, started: float) -> list[psutil.Process]:
    """The live processes of the boot whose launcher (pid ``group``, created at ``started``)
    led process group ``group``, or whose environment carries ``ENGINE_TAG=tag``."""
    now = time.time()
    # A live process with the launcher's pid but another start time means the number was
    # reused, which the kernel allows only once the old group is empty: match no group then.
    group_is_ours = True
    with contextlib.suppress(psutil.Error):
        group_is_ours = abs(psutil.Process(group).create_time() - started) < 0.01
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            in_group = (
                group_is_ours
                and os.getpgid(proc.pid) == group
                and started - 0.01 <= proc.create_time() <= now
            )
            if in_group or (tag is not None and proc.environ().get(ENGINE_TAG) == tag):
                found.append(proc)
    return found


def kill_boot(tag: str | None, group: int, started: float, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process of that boot (see ``boot_processes``); their pids. Blocks up to
    ``timeout`` for them to go."""
    victims = boot_processes(tag, group, started)
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_gone(victims, timeout)
    return [proc.pid for proc in victims]


def tree_rss_bytes(pid: int | None) -> int | None:
    """Resident memory of ``pid`` and every process under it (the engine's API server, engine
    core and workers), or None when it is gone. Shared pages count once per process."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


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


REPORT_FD = "LORAGATE_LAUNCHER_REPORT_FD"
"""The launcher's environment names the pipe on which it reports the pid it spawned."""


class Launcher(subprocess.Popen[bytes]):
    """The launcher process, and the pid of the API server it spawned, as it reported it.

    Known, not guessed: the launcher writes its ``Popen``'s pid on a pipe of its own
    (``REPORT_FD``) as soon as the engine exists. Its other children (orphans it adopted as a
    subreaper, a helper that came first) are never taken for the API server.
    """

    report_fd = -1  # the pipe's read end, until the report is read
    _api_server: int | None = None

    def api_server_pid(self) -> int | None:
        """The pid the launcher spawned (None until it reported it; read without blocking)."""
        if self._api_server is None and self.report_fd >= 0:
            try:
                data = os.read(self.report_fd, 64)
            except BlockingIOError:
                return None
            except OSError:
                data = b""
            self.close_report()  # a whole report, or the end of a launcher that made none
            with contextlib.suppress(ValueError):
                self._api_server = int(data.split()[0]) if data.strip() else None
        return self._api_server

    def close_report(self) -> None:
        if self.report_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.report_fd)
            self.report_fd = -1


def spawn_launcher(argv: list[str], env: dict[str, str], grace: float, *, stdin: int) -> Launcher:
    """``argv`` under the launcher (``loragate.supervisor.launcher``), which gives it ``grace``
    seconds to stop, in a session of its own, its output on one pipe; ``env`` gets the boot's
    new tag (``ENGINE_TAG``) and this gateway's pid (its launcher dies with it)."""
    env["LORAGATE_PARENT_PID"] = str(os.getpid())
    env[ENGINE_TAG] = secrets.token_hex(8)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    launcher = [sys.executable, "-m", "loragate.supervisor.launcher", "--grace", f"{grace:g}"]
    try:
        proc = Launcher(
            [*launcher, "--", *argv],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**env, REPORT_FD: str(write_end)},
            start_new_session=True,
            pass_fds=(write_end,),
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    proc.report_fd = read_end
    return proc


class EngineProcess:
    """The launcher of the current boot (at most one at a time) and what is known of it."""

    def __init__(self, cache_dir: Path, log_path: Path) -> None:
        self._log_file = EngineLogFile(log_path, max_bytes=0)  # sized by each spawn
        self._output: EngineOutput | None = None
        self._pidfile = EnginePidFile(cache_dir)
        self._proc: Launcher | None = None
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
        """The vLLM API server's pid, while that very process runs under this boot's launcher.

        The pid is the one the launcher reported spawning (``Launcher``); it counts only while
        that process lives and is still the launcher's child (not a zombie, not a later
        process that reused the number).
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        pid = proc.api_server_pid()
        if pid is None:
            return None
        try:
            server = psutil.Process(pid)
            if server.ppid() == proc.pid and server.status() != psutil.STATUS_ZOMBIE:
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
        """Seconds since the running engine was spawned; None once it has exited (stopped,
        unloaded or dead), not the time since the last one was."""
        if self._spawned_at and self._proc is not None and self._proc.poll() is None:
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
        taken: Launcher | None = None,
    ) -> None:
        """Start ``argv`` under the launcher, which gives the engine ``grace`` seconds to stop,
        or adopt ``taken``, a spare engine's launcher that was handed this boot (with its tag
        in ``env``: ``loragate.supervisor.spare``); its output goes through a pipe to the log
        file (rotated past ``log_max_bytes``) and, when ``log_to_stderr``, to the gateway's
        stderr."""
        self._log_file.max_bytes = log_max_bytes
        self._log_file.start_boot()
        # The engine may print its arguments (vLLM does, and argparse quotes a bad one): its
        # secrets are hidden in every log line and tail shown from now on (``loragate.logs``).
        hide_secrets(secret_values(argv))
        if taken is not None:
            tag = env[ENGINE_TAG]
            log.info(
                "engine boot (spare engine's launcher pid %s): %s",
                taken.pid,
                " ".join(redacted(argv)),
            )
            self._proc = taken
        else:
            log.info("spawning engine: %s", " ".join(redacted(argv)))
            self._proc = spawn_launcher(argv, env, grace, stdin=subprocess.DEVNULL)
            tag = env[ENGINE_TAG]
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
        self._proc.close_report()
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
