"""systemd hears from the gateway's process, whatever serves behind it: ``READY=1`` once it
serves, ``STATUS=`` on the way, ``WATCHDOG=1`` while it runs, ``STOPPING=1`` when it stops;
for a one-model gateway, a catalog, an upstream URL and a custom backend alike.

A real AF_UNIX datagram socket stands in for systemd's ``NOTIFY_SOCKET``. The gateways run
their real app lifespan in-process (``gateway serve`` runs the same one), their engines the
stand-in (``tools.bench.fake_engine``, which takes vLLM's command line); the last test runs a
real ``gateway serve`` process in front of a stand-in upstream server.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from loragate.gateway.app import create_app
from loragate.gateway.server.serve import GatewayServer
from loragate.settings import Settings
from tests.backend_double import RecordingBackend, free_port
from tests.gateway_process import GatewayProcess
from tests.systemd_socket import NotifySocket, notify_socket
from tests.unit.test_catalog import STAND_IN, catalog_settings
from tools.bench.fake_engine import FakeEngine, start_server


@pytest.fixture
def systemd(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    with notify_socket() as notify:
        monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        yield notify


@contextlib.asynccontextmanager
async def stand_in_upstream() -> AsyncIterator[str]:
    """A stand-in OpenAI-compatible server, as ``--upstream-url`` names one (served by the
    test's own event loop: a fixture's may be another, idle while the test runs)."""
    server = await start_server(FakeEngine(api_key=None, models=["upstream-base"]))
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()
        await server.wait_closed()


def one_model(tmp_path: Path, demo_dir: Path) -> Settings:
    return Settings(
        cache_dir=tmp_path / "cache",
        model=str(demo_base_dir(demo_dir)),
        lora=[f"pong={demo_adapter_dir(demo_dir, 'pong')}"],
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key="the-admin",
    )


def health(app: FastAPI) -> tuple[bool, dict[str, Any]]:
    ready, body = app.state.gateway.backend.health()
    return bool(ready), body


async def test_a_one_model_gateway_is_ready_once_its_engine_is_and_says_so_when_it_stops(
    tmp_path: Path, demo_dir: Path, systemd: NotifySocket
) -> None:
    app = create_app(one_model(tmp_path, demo_dir))
    async with app.router.lifespan_context(app):
        ready_at = await systemd.wait_for("READY=1")
        assert health(app)[0], health(app)
        before = systemd.messages[:ready_at]
        # The start's progress, with more time, then the engine's own states.
        assert before[0].startswith("STATUS=prepare "), before
        assert "EXTEND_TIMEOUT_USEC=30000000" in before[0]
        engine = [m for m in before if m.startswith("STATUS=engine")]
        assert engine[0].startswith("STATUS=engine starting"), before
        assert engine[-1].startswith("STATUS=engine ready"), before
        assert systemd.index("STOPPING=1") is None
    stopping_at = await systemd.wait_for("STOPPING=1")
    assert stopping_at > ready_at
    assert systemd.messages.count("READY=1") == 1


async def test_a_catalog_is_ready_once_its_models_answer_cold_and_says_so_when_it_stops(
    tmp_path: Path, demo_dir: Path, systemd: NotifySocket
) -> None:
    app = create_app(catalog_settings(tmp_path, demo_dir))
    async with app.router.lifespan_context(app):
        ready_at = await systemd.wait_for("READY=1")
        ready, body = health(app)
        assert ready, body
        assert {m["residency"] for m in body["catalog"].values()} == {"cold"}  # nothing booted
        # The last word before it: what serves (a cold model answers: a request boots it).
        assert systemd.messages[ready_at - 1] == "STATUS=serving alpha, beta"
        progress = [m for m in systemd.messages[:ready_at] if "EXTEND_TIMEOUT_USEC=" in m]
        assert progress and progress[0].startswith("STATUS=alpha: prepare "), progress
    stopping_at = await systemd.wait_for("STOPPING=1")
    assert stopping_at > ready_at


async def test_a_catalog_with_a_preload_is_ready_only_once_that_engine_has_booted(
    tmp_path: Path, demo_dir: Path, systemd: NotifySocket
) -> None:
    base = str(demo_base_dir(demo_dir))
    models = {"alpha": {"model": base, "preload": True}, "beta": {"model": base}}
    app = create_app(catalog_settings(tmp_path, demo_dir, models=models))
    async with app.router.lifespan_context(app):
        ready_at = await systemd.wait_for("READY=1")
        before = systemd.messages[:ready_at]
        assert "STATUS=alpha: engine ready: engine answers /health" in before, before
        assert not any(m.startswith("STATUS=beta: engine") for m in before), before  # cold
        catalog = health(app)[1]["catalog"]
        assert (catalog["alpha"]["residency"], catalog["beta"]["residency"]) == ("resident", "cold")
    assert await systemd.wait_for("STOPPING=1") > ready_at


async def test_an_upstream_gateway_is_ready_once_started_and_says_so_when_it_stops(
    tmp_path: Path, systemd: NotifySocket
) -> None:
    async with stand_in_upstream() as upstream:
        app = create_app(Settings(cache_dir=tmp_path, upstream_url=upstream))
        async with app.router.lifespan_context(app):
            ready_at = await systemd.wait_for("READY=1")
            assert health(app)[0], health(app)
    assert await systemd.wait_for("STOPPING=1") > ready_at
    assert systemd.messages == ["READY=1", "STOPPING=1"]  # nothing to report on the way


async def test_a_custom_backend_gateway_is_ready_once_started_and_says_so_when_it_stops(
    tmp_path: Path, systemd: NotifySocket
) -> None:
    app = create_app(Settings(cache_dir=tmp_path), backend=RecordingBackend())
    async with app.router.lifespan_context(app):
        await systemd.wait_for("READY=1")
    await systemd.wait_for("STOPPING=1")
    assert systemd.messages == ["READY=1", "STOPPING=1"]


async def test_the_watchdog_is_pinged_while_the_gateway_runs_and_not_after_it_stops(
    tmp_path: Path, systemd: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # a ping every 20 ms
    app = create_app(Settings(cache_dir=tmp_path), backend=RecordingBackend())
    async with app.router.lifespan_context(app):
        await systemd.wait_for("READY=1")
        await asyncio.sleep(0.1)
        assert systemd.messages.count("WATCHDOG=1") >= 2, systemd.messages
    await systemd.wait_for("STOPPING=1")
    await asyncio.sleep(0.1)  # five intervals
    assert systemd.messages[-1] == "STOPPING=1", systemd.messages


async def test_a_gateway_whose_model_cannot_be_prepared_never_says_ready(
    tmp_path: Path, systemd: NotifySocket
) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", model=str(tmp_path / "no-such-model"))
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        deadline = time.monotonic() + 30
        (model,) = app.state.gateway.backend.catalog.entries.values()  # a catalog of one
        while model.prepare_error is None:
            assert time.monotonic() < deadline, "the model was never refused"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
    await systemd.wait_for("STOPPING=1")
    assert systemd.index("READY=1") is None, systemd.messages  # systemd's start timeout ends it


async def test_a_one_model_gateway_whose_engine_failed_says_ready_after_an_admins_restart(
    tmp_path: Path, demo_dir: Path, systemd: NotifySocket
) -> None:
    """The engine fails its boots until the operator fixes it (here: a file appears), then an
    admin's restart brings it up: systemd hears READY=1 then, before its start timeout."""
    fixed = tmp_path / "fixed"
    engine = tmp_path / "engine.sh"
    engine.write_text(f'#!/bin/sh\n[ -e {fixed} ] || exit 3\nexec {" ".join(STAND_IN)} "$@"\n')
    engine.chmod(0o755)
    settings = one_model(tmp_path, demo_dir).model_copy(
        update={"engine_command": [str(engine)], "crash_loop_limit": 1, "restart_backoff": 0.1}
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        backend = app.state.gateway.backend
        (model,) = backend.catalog.entries.values()  # a catalog of one
        deadline = time.monotonic() + 60
        while model.state != "failed":
            assert time.monotonic() < deadline, model.state
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert systemd.index("READY=1") is None, systemd.messages
        fixed.touch()
        await backend.restart_engine()
        await systemd.wait_for("READY=1")
        assert health(app)[0], health(app)
    await systemd.wait_for("STOPPING=1")


def test_gateway_serve_fails_on_a_taken_port_before_starting_anything(tmp_path: Path) -> None:
    """The port is bound and listened on before the app starts (a client connecting after
    READY=1 is queued, never refused): a taken one fails the start with nothing started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started: list[str] = []
        app = FastAPI(lifespan=_recording_lifespan(started))
        server = GatewayServer(app, Settings(), host="127.0.0.1", port=port)
        with pytest.raises(OSError):
            asyncio.run(server.serve(install_signals=False))
        assert started == []


def _recording_lifespan(started: list[str]) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started.append("startup")
        yield

    return lifespan


async def test_a_catalog_none_of_whose_models_can_be_prepared_never_says_ready(
    tmp_path: Path, demo_dir: Path, systemd: NotifySocket
) -> None:
    models = {name: {"model": str(tmp_path / "no-such-model")} for name in ("alpha", "beta")}
    app = create_app(catalog_settings(tmp_path, demo_dir, models=models))
    async with app.router.lifespan_context(app):
        await systemd.wait_for("STATUS=no model could start; failed: alpha, beta")
        await asyncio.sleep(0.1)
    await systemd.wait_for("STOPPING=1")
    assert systemd.index("READY=1") is None, systemd.messages


def test_gateway_serve_in_front_of_an_upstream_tells_systemd_ready_then_stopping(
    tmp_path: Path, systemd: NotifySocket
) -> None:
    port = free_port()
    stand_in = subprocess.Popen(
        [*STAND_IN, "--port", str(port), "--served-model-name", "upstream-base"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gateway = GatewayProcess(
        cache_dir=tmp_path / "cache",
        args=["--upstream-url", f"http://127.0.0.1:{port}/v1"],
        env={"NOTIFY_SOCKET": str(systemd.path)},
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # listening, so the gateway's first look at it finds its models
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            assert time.monotonic() < deadline and stand_in.poll() is None, "no stand-in"
            time.sleep(0.05)
        gateway.start()
        systemd.wait("READY=1", timeout=60)
        gateway.wait_listening(timeout=10)
        models = httpx.get(f"{gateway.url}/v1/models", timeout=10, trust_env=False).json()
        assert [model["id"] for model in models["data"]] == ["upstream-base"]
        assert systemd.index("STOPPING=1") is None
        gateway.signal(signal.SIGTERM)
        assert gateway.proc is not None
        assert gateway.proc.wait(30) in (0, -signal.SIGTERM)
        systemd.wait("STOPPING=1", timeout=5)
        assert systemd.messages == ["READY=1", "STOPPING=1"]
    finally:
        gateway.stop()
        stand_in.terminate()
        stand_in.wait(10)
