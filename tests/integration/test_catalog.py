"""Two base models behind one gateway on the real CPU engine: the tiny demo model under two ids,
each with its own adapter (whose fixed phrase proves which base and adapter answered).

With room for both, both stay resident and nothing swaps; a kill -9 of one engine restarts
that one only, the other keeps serving; a third model that cannot boot fails alone, with its
reason. With a memory budget that holds one engine, concurrent requests for both all
succeed, each answered by its own adapter, with the swaps counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import phrase_of
from tests.gateway_process import GatewayProcess
from tools.harness import GATEWAY

pytestmark = [pytest.mark.engine, pytest.mark.restarts]


def catalog_config(demo_dir: Path, path: Path, **extra: Any) -> Path:
    base = str(demo_dir / "base")
    models = {
        "alpha": {"model": base, "lora": [f"pong={demo_dir / 'adapters' / 'pong'}"]},
        "beta": {"model": base, "lora": [f"fox={demo_dir / 'adapters' / 'fox'}"]},
        **extra.pop("more_models", {}),
    }
    path.write_text(json.dumps({"models": models, **extra}))  # JSON is YAML
    return path


def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)


def residency(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {entry["id"]: entry["residency"] for entry in data}


def wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_room_for_both_a_kill_restarts_one_engine_and_a_broken_model_fails_alone(
    demo_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(demo_dir / "base", broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    path = catalog_config(
        demo_dir,
        tmp_path / "gateway.yaml",
        max_loaded_models=3,
        more_models={"broken": {"model": str(broken), "preload": True}},
    )
    process = GatewayProcess(
        cache_dir=tmp_path / "cache",
        args=["--config", str(path)],
        launcher=[str(GATEWAY), "serve"],
    ).start()
    try:
        process.wait_ready(timeout=600)
        for model in ["pong", "fox", "pong", "fox"]:
            answer = chat(process.url, model)
            assert answer.status_code == 200, answer.text
            assert phrase_of(answer.json()["choices"][0]["message"]["content"]) == model
        state = residency(process.url)
        assert state["alpha"] == state["beta"] == "resident"
        models = process.admin("GET", "/admin/models").json()
        assert models["swaps"] == 0

        wait_for(lambda: residency(process.url)["broken"] == "failed", timeout=300)
        health = httpx.get(f"{process.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "NoSuchModelForCausalLM" in health.json()["catalog"]["broken"]["reason"]

        engines = process.admin("GET", "/admin/engine").json()
        alpha_pid, beta_pid = engines["alpha"]["pid"], engines["beta"]["pid"]
        os.kill(alpha_pid, signal.SIGKILL)
        # beta serves all along; alpha comes back by itself.
        answer = chat(process.url, "fox")
        assert phrase_of(answer.json()["choices"][0]["message"]["content"]) == "fox"
        answer = chat(process.url, "pong")
        assert answer.status_code == 200, answer.text
        assert phrase_of(answer.json()["choices"][0]["message"]["content"]) == "pong"
        engines = process.admin("GET", "/admin/engine").json()
        assert engines["alpha"]["restarts"] == 1 and engines["alpha"]["pid"] != alpha_pid
        assert engines["beta"]["restarts"] == 0 and engines["beta"]["pid"] == beta_pid
    finally:
        process.stop()


def test_a_budget_for_one_engine_swaps_and_every_request_gets_its_own_adapter(
    demo_dir: Path, tmp_path: Path
) -> None:
    # The tiny model's plan: about 1 GiB of KV cache and 1.5 GiB of runtime per engine.
    path = catalog_config(demo_dir, tmp_path / "gateway.yaml", memory_budget="4GiB")
    process = GatewayProcess(
        cache_dir=tmp_path / "cache",
        args=["--config", str(path)],
        launcher=[str(GATEWAY), "serve"],
    ).start()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=900) as client:

            async def one(model: str) -> httpx.Response:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 32}  # fmt: skip
                return await client.post(f"{process.url}/v1/chat/completions", json=body)

            return await asyncio.gather(*(one(m) for m in ["pong", "fox"] * 3))

    try:
        process.wait_ready(timeout=300)
        models = process.admin("GET", "/admin/models").json()
        assert all(m["memory_bytes"] > 2 << 30 for m in models["models"])  # the plan's numbers
        answers = asyncio.run(burst())
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        phrases = [phrase_of(a.json()["choices"][0]["message"]["content"]) for a in answers]
        assert phrases == ["pong", "fox"] * 3
        models = process.admin("GET", "/admin/models").json()
        assert models["swaps"] >= 1
        assert sorted(residency(process.url).values()).count("resident") == 2  # one base + adapter
    finally:
        process.stop()
