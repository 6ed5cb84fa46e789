"""`gateway cache` through the real console script against a real running gateway (`gateway
demo`, in front of the stand-in engine: the gateway, its lock, store, manifest and admin API
are the product's, and no vLLM is needed): the gateway is asked at --url what it serves, and
prune takes only the version nothing serves while the gateway goes on serving and can still
roll back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_process import ADMIN_KEY, GatewayProcess
from tools.harness import GATEWAY


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("cache-gateway")
    config = workdir / "gateway.yaml"  # JSON is YAML
    config.write_text(
        json.dumps({"engine_command": [sys.executable, "-m", "tools.bench.fake_engine"]})
    )
    process = GatewayProcess(cache_dir=workdir / "cache", args=["--config", str(config)]).start()
    try:
        yield process.wait_ready(timeout=120)
    finally:
        process.stop()


def variant(demo_dir: Path, adapter: str, where: Path) -> Path:
    """A copy of a demo adapter that is a version of its own (its config differs)."""
    shutil.copytree(demo_dir / "adapters" / adapter, where)
    config = json.loads((where / "adapter_config.json").read_text())
    config["lora_dropout"] = 0.0125
    (where / "adapter_config.json").write_text(json.dumps(config))
    return where


def cache_cli(gateway: GatewayProcess, hub: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAGATE_", "STATE_DIR"))}
    env["HF_HUB_CACHE"] = str(hub)  # an empty Hugging Face cache: only the gateway's items
    return subprocess.run(
        [str(GATEWAY), "cache", *args, "--cache-dir", str(gateway.cache_dir)],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip


def put(gateway: GatewayProcess, name: str, source: Path) -> str:
    response = gateway.admin("PUT", f"/admin/adapters/{name}", json={"source": str(source)})
    assert response.status_code == 200, response.text
    return str(response.json()["version"])


def items_of(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    assert done.returncode == 0, done.stdout + done.stderr
    return {Path(item["path"]).name: item for item in json.loads(done.stdout)["items"]}


def test_prune_against_a_running_gateway_takes_only_what_it_does_not_serve(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path
) -> None:
    hub = tmp_path / "hub"
    hub.mkdir()
    rollback = put(gateway, "cache-pet", variant(demo_dir, "fox", tmp_path / "fox-v2"))
    live = put(gateway, "cache-pet", variant(demo_dir, "owl", tmp_path / "owl-v2"))
    dropped = put(gateway, "cache-gone", variant(demo_dir, "pong", tmp_path / "pong-v2"))
    assert gateway.admin("DELETE", "/admin/adapters/cache-gone").status_code == 200
    asked = ("--url", gateway.url, "--admin-key", ADMIN_KEY)

    listed = cache_cli(gateway, hub, "list", "--json", *asked)
    items = items_of(listed)
    assert items[rollback]["used_by"] == ["cache-pet (rollback)"]
    assert items[live]["used_by"] == ["cache-pet (live)"]
    assert items[dropped]["used_by"] == [] and items[dropped]["prunable"]
    assert {"pong (live)", "fox (live)", "owl (live)"} <= {
        why for item in items.values() for why in item["used_by"]
    }
    assert gateway.proc is not None
    (asked_gateway,) = json.loads(listed.stdout)["gateways"]
    assert asked_gateway["pid"] == gateway.proc.pid and asked_gateway["asked"] is True
    table = cache_cli(gateway, hub, "list", *asked).stdout
    row = next(line for line in table.splitlines() if dropped[:12] in line)
    assert row.split()[:2] == ["adapter", "version"] and row.endswith(" -")
    assert f"from {tmp_path / 'pong-v2'}" in table

    # Asked at an address that is not this gateway's, nothing is removed.
    refused = cache_cli(gateway, hub, "prune", "--url", "http://127.0.0.1:9")
    assert refused.returncode == 1
    assert f"gateway {gateway.proc.pid} runs on" in refused.stderr
    assert "pass its address with --url" in refused.stderr
    assert (gateway.cache_dir / "adapters" / "versions" / dropped).is_dir()

    pruned = cache_cli(gateway, hub, "prune", *asked)
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    removed = [line for line in pruned.stdout.splitlines() if line.startswith("removed ")]
    assert removed == [f"removed adapter version {dropped[:12]} ({removed[0].split('(')[1]}"]
    left = items_of(cache_cli(gateway, hub, "list", "--json", *asked))
    assert dropped not in left and {rollback, live} <= set(left)
    # The gateway serves on, and its rollback version is still there to roll back to.
    chat = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "cache-pet", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    back = gateway.admin("POST", "/admin/adapters/cache-pet/rollback")
    assert back.status_code == 200 and back.json()["version"] == rollback
