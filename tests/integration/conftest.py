"""Real gateways + vLLM engines (CPU build, demo model) shared by every test that can share them.

``gateway`` serves the tests that leave the engine alone; ``recovering`` (short probe and
backoff settings) serves the tests that kill, freeze and restart its engine: the status
page's and the supervisor's. Each engine boot costs about a minute of CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.gateway_process import GatewayProcess


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def gateway(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory, media_dir: Path
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("shared-gateway"),
        # vLLM's own access log stays on here (the gateway turns it off): test_security and
        # test_fuzz count the engine's access lines as their witness of what reached it.
        args=["--allowed-media-dir", str(media_dir), "--", "--no-disable-uvicorn-access-log"],
        # The engine inherits the gateway's environment: it keeps responses, so that
        # test_engine_surface can fetch them by id.
        env={
            # One engine.log for the whole suite: the witness reads that file alone.
            "LORAGATE_ENGINE_LOG_MAX_BYTES": str(1 << 30),
            "LORAGATE_FOLLOW_INTERVAL": "1",
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            # test_adapter_formats serves archive sources from 127.0.0.1.
            "LORAGATE_ALLOWED_SOURCE_NETWORKS": "127.0.0.0/8",
        },
    ).start()
    try:
        process.wait_listening()
        # Poll at once, so the test of /health's start-up answer has the first one on record.
        process.wait_ready()
        yield process
    finally:
        process.stop()


FAST_SUPERVISION = {
    "LORAGATE_PROBE_INTERVAL": "1",
    "LORAGATE_PROBE_TIMEOUT": "2",
    "LORAGATE_PROBE_FAILURES": "3",
    "LORAGATE_RESTART_BACKOFF": "0.5",
    # Its tests crash the engine on purpose, several times in a few minutes.
    "LORAGATE_CRASH_LOOP_LIMIT": "10",
    # The product's default process tree (API server, EngineCore, Worker): what these kill.
    "LORAGATE_ENGINE_BOOT_MODE": "multiprocess",
}


@pytest.fixture(scope="session")
def recovering(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway whose engine the tests may kill: every test using it checks its own
    restarts relative to what it found."""
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("recovering-gateway"), env=FAST_SUPERVISION
    ).start()
    try:
        yield process.wait_ready(timeout=900)  # a shared, busy CI box can take minutes
    finally:
        process.stop()


@pytest.fixture(scope="session")
def client(gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
