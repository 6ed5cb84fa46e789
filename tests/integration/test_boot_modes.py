"""The supervisor's guarantees with ``engine_boot_mode`` 'single-process', on the real engine.

In that mode vLLM's worker runs inside its engine core: the boot is the launcher, the API
server (the pid the supervisor reports, probes and restarts) and one EngineCore process,
which holds the model. Each guarantee the multiprocess tests check (test_supervisor_recovery,
test_gateway_lifecycle) is checked here again: a SIGKILL of either engine process is
recovered from, a frozen API server is caught by the health probe, and a gateway that is
killed or stopped leaves no engine process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import PHRASES
from tests.gateway_process import GatewayProcess, wait_gone
from tests.integration.conftest import FAST_SUPERVISION
from tests.integration.test_supervisor_recovery import chat, wait_new_engine

pytestmark = [pytest.mark.engine, pytest.mark.restarts]

SINGLE_PROCESS = {**FAST_SUPERVISION, "LORAGATE_ENGINE_BOOT_MODE": "single-process"}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("single-process-gateway"), env=SINGLE_PROCESS
    ).start()
    try:
        yield process.wait_ready(timeout=900)
    finally:
        process.stop()


def titles(pids: list[int]) -> dict[int, str]:
    """Each live pid's command line as ``ps`` shows it (vLLM retitles its engine core)."""
    found = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found[pid] = " ".join(psutil.Process(pid).cmdline())
    return found


def engine_core_pid(gateway: GatewayProcess) -> int:
    cores = [
        pid for pid, title in titles(gateway.engine_tree_pids()).items() if "EngineCore" in title
    ]
    assert len(cores) == 1, titles(gateway.engine_tree_pids())
    return cores[0]


def assert_serves(gateway: GatewayProcess) -> None:
    answer = chat(gateway.url, "pong")
    assert answer.status_code == 200, answer.text
    assert PHRASES["pong"] in answer.json()["choices"][0]["message"]["content"]


def test_the_boot_is_the_api_server_and_one_engine_core_with_no_worker(
    single_process: GatewayProcess,
) -> None:
    info = single_process.engine_info()
    tree = titles(single_process.engine_tree_pids())
    assert not any("Worker" in title for title in tree.values()), tree
    assert sum("EngineCore" in title for title in tree.values()) == 1, tree
    server = psutil.Process(int(info["pid"]))
    assert "vllm.entrypoints.openai.api_server" in " ".join(server.cmdline())
    assert server.environ()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert_serves(single_process)


def test_api_server_killed_with_sigkill_is_restarted_and_serves(
    single_process: GatewayProcess,
) -> None:
    before = single_process.engine_info()
    old_pid = int(before["pid"])
    engine_tree = single_process.engine_tree_pids()
    os.kill(old_pid, signal.SIGKILL)
    after = wait_new_engine(single_process, old_pid)
    assert int(after["restarts"]) == int(before["restarts"]) + 1
    assert after["last_exit"] == "killed by SIGKILL"
    assert wait_gone(engine_tree) == []  # its EngineCore too
    assert_serves(single_process)


def test_engine_core_killed_with_sigkill_is_noticed_and_the_engine_restarted(
    single_process: GatewayProcess,
) -> None:
    """The engine core holds the model here: its death leaves an API server that cannot
    answer, which the supervisor must not keep."""
    before = single_process.engine_info()
    old_pid = int(before["pid"])
    engine_tree = single_process.engine_tree_pids()
    os.kill(engine_core_pid(single_process), signal.SIGKILL)
    after = wait_new_engine(single_process, old_pid)
    assert int(after["restarts"]) == int(before["restarts"]) + 1
    assert wait_gone(engine_tree) == []
    assert_serves(single_process)


def test_frozen_engine_is_detected_by_the_health_probe_and_restarted(
    single_process: GatewayProcess,
) -> None:
    before = single_process.engine_info()
    old_pid = int(before["pid"])
    engine_tree = single_process.engine_tree_pids()
    os.kill(old_pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        seen = set()
        restart_reason = ""
        while time.monotonic() < frozen_at + 60:
            info = single_process.engine_info()
            seen.add(info["state"])
            if info["state"] in ("restarting", "starting"):
                restart_reason = str(info["reason"])
                break
            time.sleep(0.2)
        detected_after = time.monotonic() - frozen_at
    finally:
        with contextlib.suppress(ProcessLookupError):  # it is normally dead by now
            os.kill(old_pid, signal.SIGCONT)
    # interval 1 s, 3 failures of at most 2 s each: detection well inside 15 s.
    assert detected_after < 15, f"hang noticed only after {detected_after:.1f} s ({seen})"
    assert "unhealthy" in seen
    assert "stopped answering health probes" in restart_reason, restart_reason
    wait_new_engine(single_process, old_pid)
    assert wait_gone(engine_tree) == []
    assert_serves(single_process)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_gateway_killed_or_stopped_leaves_no_engine_process(
    tmp_path: Path, how: signal.Signals
) -> None:
    process = GatewayProcess(cache_dir=tmp_path / "cache", env=SINGLE_PROCESS).start()
    tree: list[int] = []
    try:
        process.wait_ready(timeout=900)
        tree = process.engine_tree_pids()
        assert len(tree) >= 3, titles(tree)  # launcher, API server, EngineCore
        process.signal(how)
        assert process.proc is not None
        process.proc.wait(60)
        assert wait_gone(tree, timeout=30) == []
    finally:
        process.stop()
        for pid in wait_gone(tree, timeout=0.5):  # never leave an orphan engine behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
