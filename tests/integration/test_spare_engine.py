"""The spare engine (``spare_engine``, ``loragate.supervisor.spare``) on the real engine.

A gateway with a spare keeps one process that has imported vLLM beside its engine, under a
launcher of its own. The next boot (here: the restart after a SIGKILL) is handed to it: the new
API server is that very process, it answers with the same adapters, and a new spare follows.
Every guarantee of a plain boot holds: the restart is counted, nothing of the killed boot is
left, and a gateway killed or stopped leaves neither its engine nor its spare.
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

from loragate.supervisor.spare import SPARE_MODULE
from tests.gateway_process import GatewayProcess, wait_gone
from tests.integration.conftest import FAST_SUPERVISION
from tests.integration.test_boot_modes import assert_serves
from tests.integration.test_supervisor_recovery import wait_new_engine

pytestmark = [pytest.mark.engine, pytest.mark.restarts]

WITH_SPARE = {
    **FAST_SUPERVISION,
    "LORAGATE_ENGINE_BOOT_MODE": "single-process",
    "LORAGATE_SPARE_ENGINE": "true",
}


def waiting_spare(gateway: GatewayProcess, timeout: float = 120) -> dict[str, object]:
    """``/admin/engine``'s spare, once one waits, with its launcher's process tree."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spare = gateway.engine_info()["spare_engine"]
        if spare["launcher_pid"] is not None:
            return dict(spare)
        time.sleep(0.5)
    raise TimeoutError(f"no spare engine: {gateway.engine_info()['spare_engine']}")


def tree(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    return []


@pytest.fixture(scope="module")
def spared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("spare-gateway"), env=WITH_SPARE
    ).start()
    try:
        yield process.wait_ready(timeout=900)
    finally:
        process.stop()


def test_a_restart_is_taken_by_the_spare_and_a_new_spare_follows(
    spared: GatewayProcess,
) -> None:
    spare = waiting_spare(spared)
    spare_launcher = int(str(spare["launcher_pid"]))
    assert psutil.Process(spare_launcher).ppid() == spared.proc.pid  # type: ignore[union-attr]
    before = spared.engine_info()
    old_pid = int(before["pid"])
    old_tree = spared.engine_tree_pids()
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    after = wait_new_engine(spared, old_pid)
    back_s = time.monotonic() - killed_at
    assert int(after["restarts"]) == int(before["restarts"]) + 1
    # The new engine is the spare: its launcher, and under it the spare's own process.
    assert after["launcher_pid"] == spare_launcher
    server = psutil.Process(int(after["pid"]))
    assert SPARE_MODULE in " ".join(server.cmdline())
    assert server.environ()["LORAGATE_ENGINE_TAG"]  # its boot's tag: the sweep finds it
    assert "takes this boot" in spared.log_path.read_text(errors="replace")
    assert after["spare_engine"]["boots_taken"] == 1
    assert wait_gone(old_tree) == []
    assert_serves(spared)  # the boot's adapters came with the order
    # And the next boot has a spare again.
    following = waiting_spare(spared)
    assert following["launcher_pid"] not in (None, spare_launcher)
    print(f"engine back {back_s:.1f} s after the kill, booted by the spare")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_gateway_killed_or_stopped_leaves_neither_engine_nor_spare(
    tmp_path: Path, how: signal.Signals
) -> None:
    process = GatewayProcess(cache_dir=tmp_path / "cache", env=WITH_SPARE).start()
    pids: list[int] = []
    try:
        process.wait_ready(timeout=900)
        spare = waiting_spare(process)
        pids = process.engine_tree_pids() + tree(int(str(spare["launcher_pid"])))
        assert len(pids) >= 5, pids  # launcher, API server, EngineCore; the spare's two
        process.signal(how)
        assert process.proc is not None
        process.proc.wait(60)
        assert wait_gone(pids, timeout=30) == []
    finally:
        process.stop()
        for pid in wait_gone(pids, timeout=0.5):  # never leave an orphan behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
