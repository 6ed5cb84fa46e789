"""The engine report's pid is the API server's, known from the launcher, never guessed.

The launcher is a child subreaper, so its children are not only the API server: an orphan a
process of the engine left behind is adopted by it. Real processes here: the launcher spawns a
small engine that leaves such an orphan under the launcher and reports both pids.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from loragate.engine_states import EngineState
from loragate.supervisor.process import EngineProcess
from tests.unit.test_engine_orphans import FAKE_ENGINE, supervisor

# An "API server" that leaves an orphan (a double fork) under the launcher, then serves.
ENGINE = """
import json, os, sys, time
helper = os.fork()
if helper == 0:
    orphan = os.fork()
    if orphan == 0:
        time.sleep(300)
        os._exit(0)
    os._exit(0)
os.waitpid(helper, 0)
time.sleep(0.2)  # the orphan is the launcher's now
orphans = [int(p) for p in open(f"/proc/{os.getppid()}/task/{os.getppid()}/children").read().split()]
with open(sys.argv[1], "w") as out:
    json.dump({"server": os.getpid(), "others": [p for p in orphans if p != os.getpid()]}, out)
time.sleep(300)
"""


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="lg-") as name:
        yield Path(name)


async def _report(path: Path) -> dict[str, object]:
    deadline = time.monotonic() + 20
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, "the engine never reported"
        await asyncio.sleep(0.05)
    return dict(json.loads(path.read_text()))


async def test_the_api_servers_pid_is_named_beside_an_adopted_orphan_and_after_it_dies(
    short_tmp: Path,
) -> None:
    process = EngineProcess(short_tmp, short_tmp / "engine.log")
    report = short_tmp / "pids.json"
    argv = [sys.executable, "-c", ENGINE, str(report)]
    process.spawn(argv, dict(os.environ), grace=1.0, log_to_stderr=False, log_max_bytes=1 << 20)
    try:
        seen = await _report(report)
        server, others = seen["server"], seen["others"]
        assert isinstance(others, list) and len(others) == 1  # another child of the launcher
        launcher = process.launcher_pid
        assert launcher is not None
        assert {c.pid for c in psutil.Process(launcher).children()} == {server, *others}
        for _ in range(10):
            assert process.engine_pid == server
            await asyncio.sleep(0.02)
        os.kill(others[0], signal.SIGKILL)  # the other child goes while the engine serves
        deadline = time.monotonic() + 5
        while others[0] in {c.pid for c in psutil.Process(launcher).children()}:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert process.engine_pid == server
        assert process.engine_alive()
        os.kill(int(str(server)), signal.SIGKILL)  # the API server goes: no pid is named
        deadline = time.monotonic() + 10
        while process.engine_pid is not None:
            assert time.monotonic() < deadline, "a dead API server is still named"
            await asyncio.sleep(0.05)
    finally:
        await process.terminate(graceful=False, stop_timeout=1)


async def test_ready_always_comes_with_a_live_api_servers_pid(short_tmp: Path) -> None:
    engine = supervisor(short_tmp, FAKE_ENGINE)
    await engine.start()
    try:
        deadline = time.monotonic() + 30
        while engine.state != EngineState.READY:
            assert time.monotonic() < deadline, engine.reason
            await asyncio.sleep(0.05)
        snapshot = engine.snapshot()
        assert snapshot.pid is not None
        assert psutil.Process(snapshot.pid).ppid() == snapshot.launcher_pid
        os.kill(snapshot.pid, signal.SIGKILL)
        # Until the supervisor has seen the exit, no snapshot says ready without a pid.
        deadline = time.monotonic() + 30
        while engine.snapshot().restarts == 0:
            seen = engine.snapshot()
            assert seen.state != EngineState.READY or seen.pid is not None, seen
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        while engine.state != EngineState.READY:
            assert time.monotonic() < deadline, engine.reason
            await asyncio.sleep(0.05)
        again = engine.snapshot()
        assert again.pid is not None and again.pid != snapshot.pid
    finally:
        await engine.stop()
