"""The supervisor's state machine with real processes and signals, on a stand-in engine.

The stand-in (``tools.bench.fake_engine``) takes vLLM's command line and answers /health at
once, so these tests exercise spawn, probes, restarts, backoff and the crash-loop breaker in
seconds. The real engine's version of these lives in tests/integration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from loragate.engine_states import RECOVERING, TRANSITIONS, EngineState
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.command import EngineSpec
from loragate.supervisor.engine import EngineSupervisor, EngineUnavailable

FAKE_ENGINE = [sys.executable, "-m", "tools.bench.fake_engine"]
# Fails the way vLLM does on a configuration error: the root cause, then the API server's
# wrapper that points at it.
MISCONFIGURED_ENGINE = [
    sys.executable,
    "-c",
    "import sys; print('(EngineCore pid=1) ValueError: no such model'); "
    "print('RuntimeError: Engine core initialization failed. See root cause above.'); sys.exit(1)",
]
# Dies during start-up without an error of its own (as if the OOM killer took it).
KILLED_ENGINE = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
FAST = SupervisionFields(
    startup_timeout=30,
    probe_interval=0.2,
    probe_timeout=0.5,
    probe_failures=2,
    restart_backoff=0.05,
    restart_backoff_max=0.2,
    crash_loop_limit=3,
    crash_loop_window=60,
    stable_after=60,
    stop_timeout=5,
)


def fake_spec(socket_path: Path, api_key: str, command: list[str]) -> EngineSpec:
    return EngineSpec(
        model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
        max_loras=1, max_lora_rank=8, command=command,
    )  # fmt: skip


def supervisor(tmp_path: Path, command: list[str], **timings: float) -> EngineSupervisor:
    def build(socket_path: Path, api_key: str) -> EngineSpec:
        return fake_spec(socket_path, api_key, command)

    settings = FAST.model_copy(update=timings)
    return EngineSupervisor(build, cache_dir=tmp_path, timings=settings)


@pytest_asyncio.fixture(loop_scope="function")
async def running(tmp_path: Path) -> AsyncIterator[EngineSupervisor]:
    sup = supervisor(tmp_path, FAKE_ENGINE)
    states: list[str] = []
    sup.add_listener(lambda state, reason: states.append(str(state)))
    sup.states = states  # type: ignore[attr-defined]
    await sup.start()
    await sup.wait_until_serving(30)
    yield sup
    await sup.stop()


async def wait_for(predicate, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.05)


def test_every_state_can_reach_stopped() -> None:
    for state, targets in TRANSITIONS.items():
        if state not in (EngineState.STOPPED, EngineState.STOPPING):
            assert EngineState.STOPPING in targets, state


async def test_engine_exit_is_noticed_at_once_and_restarted(running: EngineSupervisor) -> None:
    pid = running.engine_pid
    assert pid is not None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    await wait_for(lambda: running.state != EngineState.READY, timeout=5)
    assert time.monotonic() - killed < FAST.probe_interval * 2
    await wait_for(
        lambda: running.state == EngineState.READY and running.engine_pid not in (None, pid)
    )
    assert running.restarts == 1
    assert running.last_exit is not None and running.last_exit.describe() == "killed by SIGKILL"
    assert running.states[-3:] == ["restarting", "starting", "ready"]  # type: ignore[attr-defined]


async def test_hung_engine_goes_unhealthy_then_is_killed_and_restarted(
    running: EngineSupervisor,
) -> None:
    pid = running.engine_pid
    assert pid is not None
    launcher = running.launcher_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_for(
            lambda: running.state == EngineState.READY and running.engine_pid not in (None, pid)
        )
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    assert "unhealthy" in running.states  # type: ignore[attr-defined]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert launcher is not None and not psutil.pid_exists(launcher)
    # The launcher's real status: not the 0 Popen reports when someone else reaped it.
    assert running.last_exit is not None
    assert running.last_exit.describe() == "killed by SIGKILL"


async def test_configuration_error_fails_at_once_with_the_engine_root_cause(
    tmp_path: Path,
) -> None:
    sup = supervisor(tmp_path, MISCONFIGURED_ENGINE)
    states: list[str] = []
    sup.add_listener(lambda state, reason: states.append(str(state)))
    await sup.start()
    try:
        await wait_for(lambda: sup.state == EngineState.FAILED)
        assert "ValueError: no such model" in sup.reason
        assert "See root cause above" not in sup.reason
        assert "configuration problem" in sup.reason
        assert sup.restarts == 0 and "restarting" not in states  # no restart budget burnt
        assert "ValueError: no such model" in sup.info()["reason"]
        await sup.restart()
        await wait_for(lambda: sup.state != EngineState.FAILED)
        await wait_for(lambda: sup.state == EngineState.FAILED)
    finally:
        await sup.stop()
    assert sup.state == EngineState.STOPPED


async def test_crash_loop_ends_failed_until_an_admin_restart(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, KILLED_ENGINE)
    await sup.start()
    try:
        await wait_for(lambda: sup.state == EngineState.FAILED)
        assert "gave up after 3 failures" in sup.reason
        assert "killed by SIGKILL" in sup.reason
        assert sup.restarts == 2
        with pytest.raises(EngineUnavailable, match="failed"):
            await sup.wait_until_serving(1)
        await asyncio.sleep(0.5)
        assert sup.state == EngineState.FAILED  # no further tries by itself
        await sup.restart()
        await wait_for(lambda: sup.state != EngineState.FAILED)
        await wait_for(lambda: sup.state == EngineState.FAILED)
    finally:
        await sup.stop()
    assert sup.state == EngineState.STOPPED


async def test_supervisor_error_ends_failed_and_an_admin_restart_recovers(
    tmp_path: Path,
) -> None:
    calls = 0

    def build(socket_path: Path, api_key: str) -> EngineSpec:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("cannot spawn: no such file")  # e.g. Popen failing
        return EngineSpec(
            model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
            max_loras=1, max_lora_rank=8, command=FAKE_ENGINE,
        )  # fmt: skip

    sup = EngineSupervisor(build, cache_dir=tmp_path, timings=FAST)
    await sup.start()
    try:
        await wait_for(lambda: sup.state == EngineState.FAILED)
        assert "cannot spawn" in sup.reason
        await sup.restart()
        await sup.wait_until_serving(30)
        assert sup.state == EngineState.READY
    finally:
        await sup.stop()


async def test_requests_wait_for_a_restart_and_a_full_queue_is_refused(
    running: EngineSupervisor,
) -> None:
    running.queue_size = 2
    # A restart slow enough that the queue is still full when the third request comes.
    running.timings = FAST.model_copy(update={"restart_backoff": 3, "restart_backoff_max": 3})
    pid = running.engine_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # Restarting, not merely unhealthy (a busy box may fail a probe first; unhealthy serves).
    await wait_for(lambda: running.state in RECOVERING, timeout=10)
    waiters = [asyncio.create_task(running.wait_until_serving(30)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(EngineUnavailable, match="already waiting"):
        await running.wait_until_serving(30)
    await asyncio.gather(*waiters)
    assert running.serving


async def test_stop_ends_launcher_engine_and_their_group(running: EngineSupervisor) -> None:
    launcher, engine = running.launcher_pid, running.engine_pid
    assert launcher is not None and engine is not None
    await running.stop()
    assert running.state == EngineState.STOPPED
    for pid in (launcher, engine):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (running.log_path.parent.parent / "engine.pid").exists()


async def test_an_engine_that_died_under_a_slow_launcher_is_an_exit_not_a_hang(
    running: EngineSupervisor,
) -> None:
    reasons: list[str] = []
    running.add_listener(
        lambda state, reason: reasons.append(reason) if state == EngineState.RESTARTING else None
    )
    launcher, engine = running.launcher_pid, running.engine_pid
    assert launcher is not None and engine is not None
    # A launcher slow to notice (a busy machine): its engine is dead, the probes fail.
    os.kill(launcher, signal.SIGSTOP)
    try:
        os.kill(engine, signal.SIGKILL)
        await wait_for(lambda: running.state == EngineState.UNHEALTHY, timeout=10)
        await asyncio.sleep(FAST.probe_interval * (FAST.probe_failures + 2))
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone if it was taken for a hang
            os.kill(launcher, signal.SIGCONT)
    await wait_for(lambda: running.serving and running.launcher_pid not in (None, launcher))
    assert reasons and reasons[0] == "engine killed by SIGKILL", reasons


async def test_the_engine_spec_is_built_off_the_event_loop(tmp_path: Path) -> None:
    """Building the spec verifies every boot adapter's digest (``boot_modules``): never on the loop."""
    threads: list[str] = []
    loop_thread = threading.current_thread().name

    def build(socket_path: Path, api_key: str) -> EngineSpec:
        threads.append(threading.current_thread().name)
        return fake_spec(socket_path, api_key, FAKE_ENGINE)

    sup = EngineSupervisor(build, cache_dir=tmp_path, timings=FAST)
    await sup.start()
    try:
        await sup.wait_until_serving(30)
    finally:
        await sup.stop()
    assert threads and loop_thread not in threads, (loop_thread, threads)


# Boots slowly the way vLLM does: says it loads the weights, takes a while, then serves.
SLOW_ENGINE = [
    sys.executable,
    "-c",
    "import os, sys, time; "
    "print('(Worker pid=1) INFO 11-30 18:03:56 [cpu_model_runner.py:68] Starting to load model "
    "x...', flush=True); time.sleep(2); "
    "os.execv(sys.executable, [sys.executable, '-m', 'tools.bench.fake_engine', *sys.argv[1:]])",
]


async def test_a_slow_boot_says_how_far_it_has_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("loragate.supervisor.engine.BOOT_REPORT_SECONDS", 0.3)
    caplog.set_level(logging.INFO, logger="loragate.supervisor")
    sup = supervisor(tmp_path, SLOW_ENGINE)
    seen: list[str] = []
    await sup.start()
    try:
        deadline = time.monotonic() + 30
        while sup.state != EngineState.READY and time.monotonic() < deadline:
            if sup.boot_progress and sup.boot_progress not in seen:
                seen.append(sup.boot_progress)
            await asyncio.sleep(0.05)
        assert sup.state == EngineState.READY
        assert any("s so far: loading the model's weights" in line for line in seen), seen
        assert "engine starting, " in caplog.text
        assert sup.boot_progress is None and sup.info()["boot_progress"] is None
    finally:
        await sup.stop()


@pytest.mark.parametrize(
    ("lines", "phase"),
    [
        ([], "starting Python and importing vLLM"),
        (["(APIServer pid=7) INFO 11-30 18:02:41 [api_utils.py:286] non-default args: {}"],
         "reading the model's configuration"),
        (["(Worker pid=7) INFO 11-30 18:03:56 [cpu_model_runner.py:68] Starting to load model m",
          "Loading safetensors checkpoint shards:  40% Completed | 2/5"],
         "loading the model's weights"),
        (["(EngineCore pid=7) INFO 11-30 18:04:03 [kv_cache_utils.py:2327] CPU KV cache size: 1"],
         "allocating the KV cache and warming up"),
        (["(APIServer pid=7) INFO 11-30 18:04:07 [x.py:1] Something new in vLLM 0.33"],
         "Something new in vLLM 0.33"),
    ],
)  # fmt: skip
def test_boot_phase_reads_the_engines_last_telling_line(lines: list[str], phase: str) -> None:
    from loragate.supervisor.output import boot_phase

    assert boot_phase(lines) == phase
