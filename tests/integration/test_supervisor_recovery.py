"""The supervisor against a real engine: crashes, hangs, boot failures and restarts.

These tests kill and freeze engines, so they use the ``recovering`` gateway (short probe and
backoff settings, shared with the status page's tests), not the shared one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PHRASES
from tests.gateway_process import GatewayProcess, wait_gone
from tests.integration.conftest import FAST_SUPERVISION

pytestmark = [pytest.mark.engine, pytest.mark.restarts]


def chat(url: str, model: str, timeout: float = 300, **extra: object) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=timeout)


def wait_new_engine(
    gateway: GatewayProcess, old_pid: int, timeout: float = 240
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = gateway.engine_info()
        if info["state"] == "ready" and info["pid"] not in (None, old_pid):
            return info
        time.sleep(0.5)
    raise TimeoutError(f"engine did not come back: {gateway.engine_info()}")


def test_engine_killed_mid_stream_ends_the_stream_with_an_error_and_comes_back(
    recovering: GatewayProcess,
) -> None:
    before = recovering.engine_info()
    old_pid = int(before["pid"])
    engine_tree = recovering.engine_tree_pids()
    body = {
        "model": "pong",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with httpx.stream(
        "POST", f"{recovering.url}/v1/chat/completions", json=body, timeout=120
    ) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                os.kill(old_pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["code"] == "engine_stream_interrupted"
    assert len(events) < 480

    # Requests sent while the engine restarts wait for it, then succeed.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pending = [
            pool.submit(chat, recovering.url, model)
            for model in ("pong", "fox", "loragate-demo", "owl")
        ]
        answers = [f.result() for f in pending]
    assert [a.status_code for a in answers] == [200, 200, 200, 200]
    assert PHRASES["pong"] in answers[0].json()["choices"][0]["message"]["content"]

    after = wait_new_engine(recovering, old_pid)
    assert int(after["restarts"]) == int(before["restarts"]) + 1
    assert after["last_exit"] == "killed by SIGKILL"
    assert wait_gone(engine_tree) == []  # EngineCore and Worker of the killed engine too


def test_frozen_engine_is_detected_killed_and_restarted(recovering: GatewayProcess) -> None:
    before = recovering.engine_info()
    old_pid = int(before["pid"])
    engine_tree = recovering.engine_tree_pids()
    os.kill(old_pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        deadline = frozen_at + 60
        seen = set()
        restart_reason = ""
        while time.monotonic() < deadline:
            info = recovering.engine_info()
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
    # Restarted because the probes failed, not because the process exited.
    assert "stopped answering health probes" in restart_reason, restart_reason
    wait_new_engine(recovering, old_pid)
    assert wait_gone(engine_tree) == []
    assert chat(recovering.url, "fox").status_code == 200


def test_launcher_killed_with_sigkill_leaves_no_engine_process_and_a_new_engine_serves(
    recovering: GatewayProcess,
) -> None:
    before = recovering.engine_info()
    old_pid = int(before["pid"])
    engine_tree = recovering.engine_tree_pids()
    assert len(engine_tree) >= 4, engine_tree  # launcher, API server, EngineCore, Worker
    os.kill(int(before["launcher_pid"]), signal.SIGKILL)
    try:
        wait_new_engine(recovering, old_pid)
        # Swept before the new engine was spawned, so gone by now without waiting.
        assert wait_gone(engine_tree, timeout=0.5) == []
        assert chat(recovering.url, "fox").status_code == 200
    finally:
        for pid in wait_gone(engine_tree, timeout=0.5):  # never leave an orphan engine behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_runtime_adapter_survives_an_engine_crash_and_an_admin_restart(
    recovering: GatewayProcess, demo_dir: Path
) -> None:
    put = recovering.admin(
        "PUT", "/admin/adapters/late-fox", json={"source": str(demo_dir / "adapters" / "fox")}
    )
    assert put.status_code == 200, put.text
    assert (
        PHRASES["fox"]
        in chat(recovering.url, "late-fox").json()["choices"][0]["message"]["content"]
    )

    old_pid = int(recovering.engine_info()["pid"])
    os.kill(old_pid, signal.SIGKILL)
    wait_new_engine(recovering, old_pid)
    recovering.wait_status(200)
    assert (
        PHRASES["fox"]
        in chat(recovering.url, "late-fox").json()["choices"][0]["message"]["content"]
    )

    old_pid = int(recovering.engine_info()["pid"])
    restart = recovering.admin("POST", "/admin/engine/restart")
    assert restart.status_code == 202
    wait_new_engine(recovering, old_pid)
    recovering.wait_status(200)
    assert (
        PHRASES["fox"]
        in chat(recovering.url, "late-fox").json()["choices"][0]["message"]["content"]
    )


def test_engine_that_cannot_boot_ends_failed_with_the_reason(
    demo_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "unbootable"
    model.mkdir()
    for item in (demo_dir / "base").iterdir():
        (model / item.name).symlink_to(item)
    config = json.loads((demo_dir / "base" / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    process = GatewayProcess(
        cache_dir=tmp_path / "cache",
        args=["--model", str(model), "--model-name", "unbootable"],
        env={**FAST_SUPERVISION, "LORAGATE_CRASH_LOOP_LIMIT": "2"},
    ).start()
    try:
        process.wait_listening()
        body = process.wait_status(503, timeout=300, state="failed")
        # A configuration error fails at once: no restart budget burnt on a repeat.
        assert "configuration problem" in body["reason"]
        assert "NoSuchModelForCausalLM" in body["reason"]
        info = process.engine_info()
        assert info["state"] == "failed"
        assert info["restarts"] == 0
        assert info["pid"] is None and info["launcher_pid"] is None
        refused = chat(process.url, "unbootable", timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_unavailable"
    finally:
        process.stop()
