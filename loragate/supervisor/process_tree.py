"""Stopping a process, its process group and every descendant: SIGTERM first, SIGKILL after.

Each engine boot also carries a tag in its environment (``ENGINE_TAG``), inherited by every
process it starts: when the launcher is gone, its group and its descendants can no longer be
found from it, and the tag still finds them (even one that left the group).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

ENGINE_TAG = "LORAGATE_ENGINE_TAG"


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
    _, alive = psutil.wait_procs(victims, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
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
    psutil.wait_procs(victims, timeout=max(0.0, deadline - time.monotonic()))


def tagged(tag: str) -> list[psutil.Process]:
    """The live processes whose environment carries ``ENGINE_TAG=tag`` (this user's, or all
    for root: another user's environment cannot be read)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(ENGINE_TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def kill_tagged(tag: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process of the boot tagged ``tag``; their pids. Blocks up to ``timeout``."""
    victims = tagged(tag)
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(victims, timeout=timeout)
    return [proc.pid for proc in victims]
