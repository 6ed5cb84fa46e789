"""What a catalog of base models shows outside its admin routes: ``/metrics`` (a series per
model, the swaps, each model's engine), ``/metrics/recent`` and ``gateway status``; and a
single-model gateway's scrape without any of it.

Real gateways (in-process uvicorn) over real stand-in engine processes, as in test_catalog.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import ProxiedBackend, engine_snapshot, serving
from tests.unit.test_catalog import ADMIN, catalog, catalog_settings, chat, wait_for
from tests.unit.test_metrics import parse, value

CATALOG_FAMILIES = ("loragate_model_", "loragate_catalog_")


def test_metrics_show_every_model_its_residency_memory_use_and_the_swaps(
    tmp_path: Path, demo_dir: Path
) -> None:
    settings = catalog_settings(tmp_path, demo_dir, max_loaded_models=1)
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        assert chat(url, "pong").status_code == 200  # alpha loads
        before_beta = time.time()
        assert chat(url, "fox").status_code == 200  # beta loads, alpha unloaded for it
        after_beta = time.time()
        scrape = httpx.get(f"{url}/metrics", timeout=10)
        report = catalog(url)
        recent = httpx.get(f"{url}/metrics/recent", timeout=10).json()
    samples = parse(scrape.text)  # prometheus_client's parser: a valid exposition

    def residency(model: str) -> str:
        states = ("resident", "loading", "asleep", "cold", "failed")
        shown = [s for s in states if value(samples, "loragate_model_residency",
                                            model_name=model, residency=s) == 1]  # fmt: skip
        assert len(shown) == 1, shown
        return shown[0]

    assert residency("alpha") == "cold" and residency("beta") == "resident"
    for model in ("alpha", "beta"):
        assert value(samples, "loragate_model_loads_total", model_name=model) == 1
        assert value(samples, "loragate_model_adapters", model_name=model) == 1
        memory = value(samples, "loragate_model_memory_bytes", model_name=model)
        planned = report[model]["memory_bytes"]
        assert math.isnan(memory) if planned is None else memory == planned
    assert value(samples, "loragate_model_unloads_total", model_name="alpha") == 1
    assert value(samples, "loragate_model_unloads_total", model_name="beta") == 0
    assert value(samples, "loragate_model_requests_in_flight", model_name="beta") == 0
    beta_used = value(samples, "loragate_model_last_used_timestamp_seconds", model_name="beta")
    assert before_beta - 1 <= beta_used <= after_beta + 1
    assert value(samples, "loragate_catalog_swaps_total") == 1
    swapped_at = value(samples, "loragate_catalog_last_swap_timestamp_seconds")
    assert before_beta <= swapped_at <= after_beta
    assert swapped_at == report["_"]["last_swap"]["at"]
    assert value(samples, "loragate_catalog_max_loaded_models") == 1
    assert value(samples, "loragate_catalog_memory_budget_bytes") == report["_"]["memory_budget"]
    # Each model's own engine, not the one the gateway would send a model-less request to.
    assert value(samples, "loragate_engine_state", model_name="beta", state="ready") == 1
    assert value(samples, "loragate_engine_state", model_name="alpha", state="stopped") == 1
    assert value(samples, "loragate_engine_restarts_total", model_name="alpha") == 0
    assert value(samples, "loragate_requests_queued", model_name="beta") == 0
    assert not [key for key in samples if key[0] == "loragate_engine_state" and
                "model_name" not in dict(key[1])]  # fmt: skip
    assert "loragate_engine_metrics_up" not in scrape.text  # no engine's /metrics is asked
    # The requests by public model, as for a single model.
    assert value(samples, "loragate_requests_total", route="/v1/chat/completions",
                 model_name="fox", status="200") == 1  # fmt: skip
    assert recent["queued"] == 0 and recent["in_flight"] == 0


def test_a_single_model_scrape_has_no_catalog_series_and_one_unlabelled_engine(
    tmp_path: Path,
) -> None:
    engine = engine_snapshot(restarts=3, waiting_requests=2)
    backend = ProxiedBackend("http://127.0.0.1:9", ["base"], engine=engine)
    with serving(create_app(Settings(cache_dir=tmp_path), backend=backend)) as url:
        scrape = httpx.get(f"{url}/metrics", timeout=10).text
    samples = parse(scrape)
    assert not [name for name, _ in samples if name.startswith(CATALOG_FAMILIES)]
    assert value(samples, "loragate_engine_state", state="ready") == 1
    assert value(samples, "loragate_engine_restarts_total") == 3
    assert value(samples, "loragate_requests_queued") == 2
    assert value(samples, "loragate_engine_metrics_up") == 0  # nothing listens on port 9


def gateway_status(url: str) -> dict[str, object]:
    command = [sys.executable, "-m", "loragate.cli", "status", "--json", "--url", url]
    done = subprocess.run(
        [*command, "--admin-key", ADMIN["Authorization"].removeprefix("Bearer ")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    status: dict[str, object] = json.loads(done.stdout)
    return status


def test_gateway_status_shows_every_model_each_engine_and_the_swaps(
    tmp_path: Path, demo_dir: Path
) -> None:
    settings = catalog_settings(tmp_path, demo_dir, max_loaded_models=1)
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        assert chat(url, "alpha").status_code == 200
        assert chat(url, "beta").status_code == 200
        status = gateway_status(url)
    catalog_shown = status["catalog"]
    assert isinstance(catalog_shown, dict)
    models = {model["id"]: model for model in catalog_shown["models"]}
    assert models["alpha"]["residency"] == "cold" and models["beta"]["residency"] == "resident"
    assert models["alpha"]["adapters"] == ["pong"] and models["beta"]["loads"] == 1
    assert "making room for beta" in models["alpha"]["last_unload_reason"]
    assert catalog_shown["swaps"] == 1
    assert catalog_shown["last_swap"]["loaded"] == "beta"
    assert catalog_shown["last_swap"]["unloaded"] == ["alpha"]
    assert catalog_shown["max_loaded_models"] == 1
    engines = status["engine"]
    assert isinstance(engines, dict) and set(engines) == {"alpha", "beta"}
    assert engines["beta"]["state"] == "ready" and engines["alpha"]["state"] == "stopped"
    assert not [model for model, engine in engines.items() if "log_tail" in engine]
    adapters = status["adapters"]
    assert isinstance(adapters, list)
    assert {(a["name"], a["base_model"]) for a in adapters} == {("pong", "alpha"), ("fox", "beta")}
