"""One base model is a catalog of one: ``gateway models list|load|unload``, and the residency
they and ``/v1/models`` report, work on a gateway started with ``--model`` as on a catalog.

A real gateway (in-process) supervising a real engine process: the stand-in engine
(``tools.bench.fake_engine``, which takes vLLM's command line) on the tiny demo model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import serving
from tests.unit.test_catalog import ADMIN, STAND_IN, chat, residency, wait_for


def one_model(tmp_path: Path, demo_dir: Path) -> Settings:
    return Settings(
        cache_dir=tmp_path / "cache",
        model=str(demo_base_dir(demo_dir)),
        lora=[f"pong={demo_adapter_dir(demo_dir, 'pong')}"],
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key="the-admin",
        adapter_source_roots=[str(demo_dir)],
    )


def models(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "loragate.cli", "models", *args]
    command += ["--url", url, "--admin-key", "the-admin"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def engine_pid(url: str) -> int | None:
    engine = httpx.get(f"{url}/admin/engine", headers=ADMIN, timeout=10).json()
    return engine.get("pid")


def test_gateway_models_list_load_unload_on_a_one_model_gateway(
    tmp_path: Path, demo_dir: Path
) -> None:
    settings = one_model(tmp_path, demo_dir)
    base = settings.served_model_name
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        listed = models(url, "list")
        assert listed.returncode == 0, listed.stderr
        rows = [line.split() for line in listed.stdout.splitlines()[1:-1]]
        assert [row[:3] for row in rows] == [[base, "resident", "ready"]], listed.stdout
        assert "pong" in listed.stdout
        as_json = json.loads(models(url, "list", "--json").stdout)
        assert [m["id"] for m in as_json["models"]] == [base]
        assert as_json["models"][0]["keep"] is True

        assert residency(url) == {base: "resident", "pong": "resident"}
        first_pid = engine_pid(url)
        unloaded = models(url, "unload", base)
        assert unloaded.returncode == 0, unloaded.stderr
        assert unloaded.stdout.strip() == f"{base}: cold (stopped)"
        assert engine_pid(url) is None
        assert residency(url) == {base: "cold", "pong": "cold"}
        # Cold, not down: /health stays 200 so a load balancer keeps sending requests.
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200 and "next request boots it" in health.json()["reason"]
        assert health.json()["engine_uptime_s"] is None  # no engine runs: no engine uptime

        answer = chat(url, "pong")  # a request boots the cold engine, as in a catalog
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "pong"
        second_pid = engine_pid(url)
        assert second_pid is not None and second_pid != first_pid
        report = httpx.get(f"{url}/admin/models", headers=ADMIN, timeout=10).json()
        (row,) = report["models"]
        # Two loads: the boot at start (a catalog's preload) and the one the request asked for.
        assert (row["residency"], row["loads"], row["unloads"]) == ("resident", 2, 1)

        loaded = models(url, "load", base)  # already resident: nothing boots
        assert loaded.returncode == 0 and loaded.stdout.startswith(f"{base}: resident")
        assert engine_pid(url) == second_pid
        missing = models(url, "load", "gamma")
        assert missing.returncode != 0 and "gamma" in missing.stderr

        assert models(url, "unload", base).returncode == 0  # and loaded by hand this time
        reloaded = models(url, "load", base)  # returns once the boot has begun
        assert reloaded.returncode == 0 and reloaded.stdout.startswith(f"{base}: loading")
        wait_for(lambda: residency(url)[base] == "resident")
        third_pid = engine_pid(url)
        assert third_pid is not None and third_pid not in (first_pid, second_pid)
        assert chat(url, "pong").json()["model"] == "pong"


def test_requests_during_an_unload_by_hand_boot_the_engine_again_once_it_stopped(
    tmp_path: Path, demo_dir: Path
) -> None:
    """A request that arrives while ``unload`` stops the engine waits for the stop, then boots
    it (it used to find the engine stopping, clear the cold mark and leave it stopped for
    good); an adapter added while cold is recorded and served after the boot."""
    settings = one_model(tmp_path, demo_dir)
    base = settings.served_model_name
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        with ThreadPoolExecutor(6) as pool:
            unloading = pool.submit(
                httpx.post, f"{url}/admin/models/{base}/unload", headers=ADMIN, timeout=60
            )
            answers = [pool.submit(chat, url, "pong") for _ in range(5)]
            assert unloading.result().status_code == 200
            statuses = [answer.result().status_code for answer in answers]
        assert set(statuses) <= {200, 503}, statuses
        assert chat(url, "pong").status_code == 200
        assert engine_pid(url) is not None
        models(url, "unload", base)
        added = httpx.put(
            f"{url}/admin/adapters/fox",
            json={"source": str(demo_adapter_dir(demo_dir, "fox"))},
            headers=ADMIN,
            timeout=60,
        )
        assert added.status_code == 200, added.text  # recorded for the next boot...
        assert engine_pid(url) is None  # ...which it did not start
        answer = chat(url, "fox")
        assert answer.status_code == 200 and answer.json()["model"] == "fox", answer.text


def test_models_admin_is_a_404_on_an_upstream_gateway() -> None:
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", admin_key="the-admin")
    with serving(create_app(settings)) as url:
        answer = httpx.get(f"{url}/admin/models", headers=ADMIN, timeout=10)
        assert answer.status_code == 404
        assert "runs no base model of its own" in answer.json()["error"]["message"]
