"""A user's own model on the CPU build, the way a user meets it: `gateway serve --model DIR` with
default settings and no engine environment, and a broken model whose failure says why."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway_process import ADMIN_KEY, GatewayProcess

pytestmark = [pytest.mark.engine, pytest.mark.restarts]

ENGINE_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS", "LORAGATE_BASE_ROUTING")


@pytest.fixture()
def no_engine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    yield


def test_own_model_dir_becomes_healthy_with_defaults(
    demo_dir: Path, tmp_path: Path, no_engine_env: None
) -> None:
    model = tmp_path / "my-model"
    shutil.copytree(demo_dir / "base", model)
    process = GatewayProcess(cache_dir=tmp_path / "cache", args=["--model", str(model)]).start()
    try:
        process.wait_ready(timeout=300)
        engine = process.engine_info()
        assert "KV cache" in engine["memory"], engine
        assert engine["restarts"] == 0
        response = httpx.post(
            f"{process.url}/v1/chat/completions",
            json={
                "model": str(model),
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 4,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        log = process.log_path.read_text()
        assert "engine memory: KV cache" in log and "--kv-cache-memory-bytes" in log
    finally:
        process.stop()


def test_broken_model_fails_in_one_attempt_with_the_engine_root_cause(
    demo_dir: Path, tmp_path: Path, no_engine_env: None
) -> None:
    model = tmp_path / "broken-model"
    shutil.copytree(demo_dir / "base", model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    process = GatewayProcess(cache_dir=tmp_path / "cache", args=["--model", str(model)]).start()
    try:
        process.wait_listening()
        body = process.wait_status(503, timeout=240, state="failed")
        reason = body["reason"]
        assert "NoSuchModelForCausalLM" in reason and "are not supported" in reason, reason
        assert "See root cause above" not in reason
        engine = process.engine_info()
        assert engine["restarts"] == 0 and engine["state"] == "failed"
        assert "NoSuchModelForCausalLM" in engine["reason"]
        # gateway status shows the same reason, through the real console script.
        status = _status(process)
        assert "NoSuchModelForCausalLM" in status["engine"]["reason"]
        assert "NoSuchModelForCausalLM" in process.log_path.read_text()  # the gateway's log
    finally:
        process.stop()


def _status(process: GatewayProcess) -> dict[str, object]:
    import subprocess

    from tools.harness import GATEWAY

    done = subprocess.run(
        [str(GATEWAY), "status", "--json", "--url", process.url, "--admin-key", ADMIN_KEY],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
        check=True,
    )
    return dict(json.loads(done.stdout))
