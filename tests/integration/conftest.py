"""One real gateway + vLLM engine (CPU build, demo model) shared by every test that can share it."""

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
        args=["--allowed-media-dir", str(media_dir)],
        # The engine inherits the gateway's environment: it keeps responses, so that
        # test_engine_surface can fetch them by id.
        env={"LORAGATE_FOLLOW_INTERVAL": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    ).start()
    try:
        process.wait_listening()
        # Poll at once, so the test of /health's start-up answer has the first one on record.
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def client(gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
