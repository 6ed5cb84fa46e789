"""A lock and pid file under the cache dir: one gateway per cache dir, and no stale engines.

The gateway holds an flock on ``gateway.lock`` for its whole life. ``engine.pid`` records the
engine launcher's pid and start time and the boot's tag (``process_tree.ENGINE_TAG``); a new
gateway that finds it (after a crash or SIGKILL of the old one) ends that engine tree, and
whatever is left of that boot, before spawning its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import IO

import psutil

from loragate.supervisor.process_tree import kill_boot, kill_tree_now

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
    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / "engine.pid"

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
