"""The gateway's own life: systemd notifications, SIGKILL without orphans, SIGTERM that drains."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway_process import GatewayProcess, wait_gone
from tests.systemd_socket import NotifySocket, notify_socket

pytestmark = [pytest.mark.engine, pytest.mark.restarts]


@pytest.fixture()
def notify() -> Iterator[NotifySocket]:
    with notify_socket() as sock:
        yield sock


@dataclass
class KilledGateway:
    """What a gateway left behind after SIGKILL: its cache dir (with a runtime adapter)."""

    cache_dir: Path
    notify_messages: list[str]
    engine_tree: list[int]
    survivors: list[int]


@pytest.fixture(scope="module")
def killed_gateway(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> KilledGateway:
    """A gateway that started (telling systemd), took a runtime adapter and was SIGKILLed.

    A fixture, not a test, so that the next gateway's test does not depend on test order.
    """
    cache_dir = tmp_path_factory.mktemp("lifecycle-cache")
    with notify_socket() as notify:
        return _started_and_killed(cache_dir, demo_dir, notify)


def _started_and_killed(cache_dir: Path, demo_dir: Path, notify: NotifySocket) -> KilledGateway:
    env = {
        "NOTIFY_SOCKET": str(notify.path),
        "LORAGATE_ENGINE_BOOT_MODE": "multiprocess",
    }  # the whole tree: Worker too
    process = GatewayProcess(cache_dir=cache_dir, env=env).start()
    try:
        process.wait_ready()
        notify.wait("READY=1")
        # A runtime adapter, to be served again by the next gateway on this cache dir.
        put = process.admin(
            "PUT", "/admin/adapters/second-owl", json={"source": str(demo_dir / "adapters" / "owl")}
        )
        assert put.status_code == 200, put.text
        tree = process.engine_tree_pids()
        process.signal(signal.SIGKILL)
        assert process.proc is not None
        process.proc.wait(10)
        survivors = wait_gone(tree, timeout=30)
    finally:
        process.stop()
    return KilledGateway(cache_dir, list(notify.messages), tree, survivors)


def test_gateway_killed_with_sigkill_leaves_no_engine_process(
    killed_gateway: KilledGateway,
) -> None:
    messages = killed_gateway.notify_messages
    engine_statuses = [m for m in messages if m.startswith("STATUS=engine")]
    assert engine_statuses[0].startswith("STATUS=engine starting")
    ready_at = messages.index("READY=1")
    assert any(m.startswith("STATUS=engine ready") for m in messages[:ready_at])
    # While it prepares and boots, each progress line also extends systemd's start timeout.
    extending = [m for m in messages[:ready_at] if "EXTEND_TIMEOUT_USEC=" in m]
    assert extending and extending[0].startswith("STATUS=prepare"), messages[:ready_at]
    assert any(m.startswith("STATUS=boot") for m in extending), messages[:ready_at]
    tree = killed_gateway.engine_tree
    assert len(tree) >= 4, tree  # launcher, API server, EngineCore, Worker
    assert killed_gateway.survivors == []


def test_new_gateway_on_the_same_cache_dir_starts_cleanly_and_serves_runtime_adapters(
    killed_gateway: KilledGateway, notify: NotifySocket
) -> None:
    env = {"NOTIFY_SOCKET": str(notify.path)}
    process = GatewayProcess(cache_dir=killed_gateway.cache_dir, env=env).start()
    try:
        process.wait_ready()
        answer = httpx.post(
            f"{process.url}/v1/chat/completions",
            json={
                "model": "second-owl",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert answer.status_code == 200
        # The owl adapter hoots (" hoot" or " hoot hoot ..."); nothing else here does.
        assert "hoot" in answer.json()["choices"][0]["message"]["content"]

        # SIGTERM with a request in flight: the request completes, then everything exits.
        tree = process.engine_tree_pids()
        # Streamed, so the first token says the request is running at the engine: SIGTERM lands
        # mid-generation with no polling race (400 tokens take the tiny model a second or more).
        long_request = {
            "model": "pong",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"{process.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=long_request, timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    break  # the first token
            process.signal(signal.SIGTERM)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]", rest[-3:]
        chunks = [json.loads(data) for data in rest[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 400
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert process.proc is not None
        # uvicorn re-raises the signal after its clean shutdown; systemd counts that as success.
        assert process.proc.wait(60) in (0, -signal.SIGTERM)
        assert wait_gone(tree, timeout=30) == []
        notify.wait("STOPPING=1", timeout=5)
    finally:
        process.stop()
