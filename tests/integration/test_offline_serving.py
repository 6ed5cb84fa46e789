"""Serving from the cache alone: Hugging Face ids with HF_HUB_OFFLINE=1, and a Datature Vi run.

There is no hub here, so the tests lay files out exactly as ``gateway pull`` (huggingface_hub's
snapshot cache) and the Vi SDK leave them, then start `gateway serve` with the network off.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests import adapter_fixtures as fx
from tests.conftest import phrase_of
from tests.gateway_process import GatewayProcess

pytestmark = [pytest.mark.engine, pytest.mark.restarts]

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def as_hub_snapshot(src: Path, hub_cache: Path, repo_id: str) -> Path:
    """Copy ``src`` into huggingface_hub's cache layout, as a finished download leaves it."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def chat(url: str, model: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_cached_hub_model_and_adapter_serve_with_hf_hub_offline(
    demo_dir: Path, tmp_path: Path
) -> None:
    """From the user's Hugging Face hub cache (``HF_HUB_CACHE``), as vLLM or
    ``huggingface-cli download`` left them: served offline, the base model not copied."""
    cache, hub_cache = tmp_path / "cache", tmp_path / "hf-hub"
    base = as_hub_snapshot(demo_dir / "base", hub_cache, "loragate-test/tiny-llama")
    as_hub_snapshot(demo_dir / "adapters" / "fox", hub_cache, "loragate-test/fox-lora")
    process = GatewayProcess(
        cache_dir=cache,
        args=[
            "--model", "loragate-test/tiny-llama",
            "--model-name", "tiny",
            "--lora", "fox=hf://loragate-test/fox-lora",
            "--", "--dtype", "float32",
        ],
        env={
            "HF_HUB_OFFLINE": "1",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_CACHE": str(hub_cache),
        },
    ).start()  # fmt: skip
    try:
        process.wait_ready()
        assert (
            phrase_of(chat(process.url, "fox").json()["choices"][0]["message"]["content"]) == "fox"
        )
        answer = chat(process.url, "tiny")
        assert (
            answer.status_code == 200
            and phrase_of(answer.json()["choices"][0]["message"]["content"]) is None
        )
        # The engine reads the hub cache's snapshot; loragate's cache holds no copy of it.
        weights = {p.name for p in base.iterdir() if p.suffix == ".safetensors"}
        assert weights and not [p for p in cache.rglob("*") if p.name in weights]
        assert not list(cache.rglob("models--*"))
        info = {a["name"]: a for a in process.admin("GET", "/admin/adapters").json()["data"]}["fox"]
        assert info["revision"] == COMMIT  # pinned to what was cached
    finally:
        process.stop()


def test_datature_vi_run_serves_its_base_and_its_adapter(demo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run = fx.make_vi_run(demo_dir / "adapters" / "owl", cache / "vi-runs" / "run-42")
    shutil.rmtree(run / "model_full")
    shutil.copytree(demo_dir / "base", run / "model_full")
    (run / "model_full" / "run.json").write_text(json.dumps({"runId": "run-42"}))
    process = GatewayProcess(
        cache_dir=cache,
        args=["--run-id", "run-42", "--", "--dtype", "float32"],
    ).start()
    try:
        process.wait_ready()
        models = [m["id"] for m in httpx.get(f"{process.url}/v1/models").json()["data"]]
        assert models == ["run-42-base", "run-42"]
        assert (
            phrase_of(chat(process.url, "run-42").json()["choices"][0]["message"]["content"])
            == "owl"
        )
        assert (
            phrase_of(chat(process.url, "run-42-base").json()["choices"][0]["message"]["content"])
            is None
        )
    finally:
        process.stop()
