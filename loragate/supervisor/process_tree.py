"""Stopping a process, its process group and every descendant: SIGTERM first, SIGKILL after.

When the launcher is gone, its descendants can no longer be found from it. A boot's processes
are then found two ways (``boot_processes``): by its process group (the launcher's pid; the
kernel does not reuse that number while any member lives, and members must be younger than
the launcher), and by a tag in their environment (``ENGINE_TAG``), which also finds one that
left the group. The tag alone is not enough: vLLM renames its EngineCore and Worker with
setproctitle, which overwrites the memory /proc/PID/environ shows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

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
