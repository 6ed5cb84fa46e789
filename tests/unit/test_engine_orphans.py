"""No engine process outlives its launcher or its gateway, under any kill order.

Real processes and signals on the stand-in engine (``tools.bench.fake_engine``), started
with ``--child`` (a child that ignores SIGTERM, as a stuck vLLM EngineCore would) and, where
the test says so, ``--ignore-sigterm``. The gateway-level orders run ``gateway serve`` with
the stand-in as its engine command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from loragate.engine_states import EngineState
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.command import EngineSpec
from loragate.supervisor.engine import EngineSupervisor
from loragate.supervisor.process import ENGINE_TAG, CacheDirInUse, EnginePidFile, GatewayLock
from tools.bench.targets import write_fake_model
from tools.harness import GatewayProcess, wait_gone

FAKE_ENGINE = [sys.executable, "-m", "tools.bench.fake_engine", "--child"]
STUBBORN_ENGINE = [*FAKE_ENGINE, "--ignore-sigterm"]
GRACE = 1.0
FAST = SupervisionFields(
    startup_timeout=30, probe_interval=0.2, probe_timeout=0.5, restart_backoff=0.05,
    restart_backoff_max=0.2, crash_loop_limit=10, stop_timeout=GRACE,
)  # fmt: skip


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    # The engine's socket path must fit in 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="lg-") as name:
        yield Path(name)


def supervisor(cache_dir: Path, command: list[str]) -> EngineSupervisor:
    def build(socket_path: Path, api_key: str) -> EngineSpec:
        return EngineSpec(
            model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
            max_loras=1, max_lora_rank=8, command=command,
        )  # fmt: skip

    return EngineSupervisor(build, cache_dir=cache_dir, timings=FAST)


def boot_pids(launcher: int) -> list[int]:
    """The launcher, the engine and the engine's child, once all three run."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            pids = [launcher, *(p.pid for p in psutil.Process(launcher).children(recursive=True))]
        except psutil.Error:
            pids = []
        if len(pids) >= 3:
            return pids
        time.sleep(0.05)
    raise TimeoutError(f"the engine and its child did not start under launcher {launcher}")


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie counts as gone)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.Error:
            pass
    return running


async def wait_for(predicate, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.05)


# ----- the launcher dies or is told to stop ---------------------------------------------------


async def test_launcher_killed_with_sigkill_its_boot_is_swept_before_the_next_spawn(
    short_tmp: Path,
) -> None:
    sup = supervisor(short_tmp, FAKE_ENGINE)
    alive_at_respawn: list[list[int]] = []
    old: list[int] = []
    sup.add_listener(
        lambda state, reason: (
            alive_at_respawn.append(alive(old)) if state == EngineState.STARTING and old else None
        )
    )
    await sup.start()
    try:
        await sup.wait_until_serving(30)
        assert sup.launcher_pid is not None
        old[:] = await asyncio.to_thread(boot_pids, sup.launcher_pid)
        os.kill(old[0], signal.SIGKILL)
        await wait_for(lambda: sup.serving and sup.launcher_pid not in (None, old[0]))
        await asyncio.to_thread(boot_pids, sup.launcher_pid or 0)
        # The engine and its child went with their launcher, before the next boot began.
        assert alive_at_respawn and alive_at_respawn[0] == []
        assert alive(old) == []
    finally:
        await sup.stop()
        kill_all(old)


@pytest.mark.parametrize(
    "engine", [STUBBORN_ENGINE, FAKE_ENGINE], ids=["engine-ignores-sigterm", "child-ignores-it"]
)
async def test_sigterm_to_the_launcher_ends_its_whole_boot_within_the_grace(
    short_tmp: Path, engine: list[str]
) -> None:
    sup = supervisor(short_tmp, engine)
    old: list[int] = []
    await sup.start()
    try:
        await sup.wait_until_serving(30)
        assert sup.launcher_pid is not None
        old[:] = await asyncio.to_thread(boot_pids, sup.launcher_pid)
        os.kill(old[0], signal.SIGTERM)
        # The launcher forwards SIGTERM, then SIGKILLs what is left after the grace.
        assert await asyncio.to_thread(wait_gone, old, GRACE + 5) == []
        await wait_for(lambda: sup.serving and sup.launcher_pid not in (None, old[0]))
    finally:
        await sup.stop()
        kill_all(old)


async def test_stop_sigkills_an_engine_that_ignores_sigterm_after_the_timeout(
    short_tmp: Path,
) -> None:
    sup = supervisor(short_tmp, STUBBORN_ENGINE)
    await sup.start()
    await sup.wait_until_serving(30)
    assert sup.launcher_pid is not None
    pids = await asyncio.to_thread(boot_pids, sup.launcher_pid)
    started = time.monotonic()
    try:
        await sup.stop()
    finally:
        left = alive(pids)
        kill_all(pids)
    assert left == []
    assert time.monotonic() - started < GRACE + 10
    assert sup.state == EngineState.STOPPED


# ----- the gateway dies or is told to stop ----------------------------------------------------


def fake_gateway(directory: Path, command: list[str]) -> GatewayProcess:
    model = write_fake_model(directory / "model")
    config = directory / "gateway.yaml"  # JSON is YAML
    config.write_text(json.dumps({"engine_command": command}))
    return GatewayProcess(
        cache_dir=directory / "cache",
        args=["--model", str(model), "--config", str(config)],
        env={"LORAGATE_STOP_TIMEOUT": str(GRACE)},
    )


def engine_boot(gateway: GatewayProcess) -> list[int]:
    launcher = gateway.engine_info()["launcher_pid"]
    assert launcher is not None
    return boot_pids(int(launcher))


def test_gateway_killed_with_sigkill_leaves_no_engine_process(short_tmp: Path) -> None:
    gateway = fake_gateway(short_tmp, FAKE_ENGINE).start()
    pids: list[int] = []
    try:
        gateway.wait_ready(120)
        pids[:] = engine_boot(gateway)
        gateway.signal(signal.SIGKILL)
        assert gateway.proc is not None
        gateway.proc.wait(10)
        # The launcher's parent-death signal ends its group at once.
        assert wait_gone(pids, timeout=10) == []
    finally:
        gateway.stop()
        kill_all(pids)


def test_gateway_sigterm_ends_an_engine_that_ignores_it(short_tmp: Path) -> None:
    gateway = fake_gateway(short_tmp, STUBBORN_ENGINE).start()
    pids: list[int] = []
    try:
        gateway.wait_ready(120)
        pids[:] = engine_boot(gateway)
        gateway.signal(signal.SIGTERM)
        assert gateway.proc is not None
        assert gateway.proc.wait(60) in (0, -signal.SIGTERM)
        assert alive(pids) == []  # ended before the gateway exited
    finally:
        gateway.stop()
        kill_all(pids)


def test_launcher_and_gateway_killed_together_the_next_gateway_ends_what_was_left(
    short_tmp: Path,
) -> None:
    first = fake_gateway(short_tmp, FAKE_ENGINE).start()
    pids: list[int] = []
    try:
        first.wait_ready(120)
        pids[:] = engine_boot(first)
        # The launcher first, then the gateway before it can sweep: the engine dies with
        # its launcher; the engine's child (like vLLM's EngineCore) is left to the next gateway.
        os.kill(pids[0], signal.SIGKILL)
        first.signal(signal.SIGKILL)
        assert first.proc is not None
        first.proc.wait(10)
        assert wait_gone(pids[:2], timeout=10) == []
    finally:
        first.stop()
    second = fake_gateway(short_tmp, FAKE_ENGINE).start()  # the same cache dir
    try:
        second.wait_ready(120)
        assert alive(pids) == []
    finally:
        second.stop()
        kill_all(pids)


# ----- the pid file and the lock --------------------------------------------------------------


def tagged_sleeper(tag: str, new_session: bool = True) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"],
        env={**os.environ, ENGINE_TAG: tag},
        start_new_session=new_session,
    )


def test_end_stale_engine_kills_a_live_launcher_tree(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); "
         "time.sleep(3600)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        pids = boot_pids_of(launcher.pid, 2)
        pidfile = EnginePidFile(tmp_path)
        pidfile.write(launcher.pid, "tag-of-that-boot")
        assert pidfile.end_stale_engine() == launcher.pid
        launcher.wait(10)
        assert wait_gone(pids, timeout=10) == []
        assert not pidfile.path.exists()
    finally:
        kill_group(launcher.pid)


def test_end_stale_engine_kills_what_a_dead_launcher_left(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher.wait()
    orphan = tagged_sleeper("orphaned-boot")
    bystander = tagged_sleeper("another-boot")
    try:
        pidfile = EnginePidFile(tmp_path)
        pidfile.path.write_text(
            json.dumps({"pid": launcher.pid, "create_time": 1.0, "tag": "orphaned-boot"})
        )
        assert pidfile.end_stale_engine() is None  # the launcher itself was gone
        assert alive([orphan.pid]) == []
        assert alive([bystander.pid]) == [bystander.pid]
        assert not pidfile.path.exists()
    finally:
        for proc in (orphan, bystander):
            proc.kill()
            proc.wait()


def test_end_stale_engine_spares_a_process_that_reused_the_pid(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        pidfile = EnginePidFile(tmp_path)
        real = psutil.Process(other.pid).create_time()
        pidfile.path.write_text(json.dumps({"pid": other.pid, "create_time": real - 100}))
        assert pidfile.end_stale_engine() is None
        assert other.poll() is None
        assert not pidfile.path.exists()
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("content", ["", "{", "[]", '{"pid": "x"}', '{"create_time": 1}', "null"])
def test_end_stale_engine_clears_a_damaged_pid_file(tmp_path: Path, content: str) -> None:
    pidfile = EnginePidFile(tmp_path)
    pidfile.path.write_text(content)
    assert pidfile.end_stale_engine() is None
    assert not pidfile.path.exists()


def test_gateway_lock_refuses_a_second_gateway_and_frees_on_release(tmp_path: Path) -> None:
    first = GatewayLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(CacheDirInUse, match=f"pid {os.getpid()}"):
            GatewayLock(tmp_path).acquire()
    finally:
        first.release()
    again = GatewayLock(tmp_path)
    again.acquire()
    again.release()


def test_gateway_lock_of_a_killed_gateway_is_free_at_once(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from loragate.supervisor.process import GatewayLock; "
         "lock = GatewayLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); "
         "time.sleep(3600)",
         str(tmp_path)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(CacheDirInUse, match=f"pid {holder.pid}"):
            GatewayLock(tmp_path).acquire()
        holder.kill()
        holder.wait()
        lock = GatewayLock(tmp_path)
        lock.acquire()  # the kernel dropped the dead holder's lock
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def boot_pids_of(root: int, count: int) -> list[int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with_children = [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
        if len(with_children) >= count:
            return with_children
        time.sleep(0.05)
    raise TimeoutError


def kill_all(pids: list[int]) -> None:
    """Never leave a stray process behind, even when a test fails."""
    for pid in alive(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


# ----- processes that leave the engine's group and session (Ray's local cluster) ---------------


def detached_engine(directory: Path) -> tuple[list[str], Path]:
    pid_file = directory / "worker.pid"
    return [*FAKE_ENGINE, f"--detached-child={pid_file}"], pid_file


def detached_worker(pid_file: Path, launcher: int | None = None) -> int:
    """The orphaned worker's pid, once it runs outside the launcher's session."""
    deadline = time.monotonic() + 20
    while not pid_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the detached worker did not start")
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    if launcher is not None:
        assert os.getsid(pid) != os.getsid(launcher)  # it left the session, as Ray's raylet can
        assert ENGINE_TAG not in psutil.Process(pid).environ()  # no tag to find it by
        # Its daemon parent exited: the launcher, a child subreaper, adopted it.
        while psutil.Process(pid).ppid() != launcher and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(pid).ppid() == launcher
    return pid


async def test_stop_ends_a_worker_that_left_the_session_and_lost_its_parent(
    short_tmp: Path,
) -> None:
    command, pid_file = detached_engine(short_tmp)
    sup = supervisor(short_tmp, command)
    worker = 0
    await sup.start()
    try:
        await sup.wait_until_serving(30)
        assert sup.launcher_pid is not None
        worker = await asyncio.to_thread(detached_worker, pid_file, sup.launcher_pid)
    finally:
        await sup.stop()
        left = alive([worker]) if worker else []
        kill_all([worker] if worker else [])
    assert left == []


async def test_engine_exit_ends_a_worker_that_left_the_session(short_tmp: Path) -> None:
    command, pid_file = detached_engine(short_tmp)
    sup = supervisor(short_tmp, command)
    pids: list[int] = []
    await sup.start()
    try:
        await sup.wait_until_serving(30)
        assert sup.launcher_pid is not None
        launcher = sup.launcher_pid
        worker = await asyncio.to_thread(detached_worker, pid_file, launcher)
        engine = psutil.Process(launcher).children()[0].pid
        pids[:] = [launcher, engine, worker]
        os.kill(engine, signal.SIGKILL)  # the API server crashes; the launcher ends the rest
        assert await asyncio.to_thread(wait_gone, [worker], 10) == []
    finally:
        await sup.stop()
        kill_all(pids)


def test_gateway_killed_with_sigkill_leaves_no_worker_that_left_the_session(
    short_tmp: Path,
) -> None:
    command, pid_file = detached_engine(short_tmp)
    gateway = fake_gateway(short_tmp, command).start()
    pids: list[int] = []
    try:
        gateway.wait_ready(120)
        launcher = int(gateway.engine_info()["launcher_pid"])
        pids[:] = [launcher, detached_worker(pid_file, launcher)]
        gateway.signal(signal.SIGKILL)
        assert gateway.proc is not None
        gateway.proc.wait(10)
        assert wait_gone(pids, timeout=10) == []
    finally:
        gateway.stop()
        kill_all(pids)
