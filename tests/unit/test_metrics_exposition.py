"""The scrape as Prometheus tooling reads it: prometheus_client's parser, standard process
metrics once, build info, and the engine's series under public adapter names."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import PlainTextResponse

from loragate.gateway.app import create_app
from loragate.serving.engine_metrics import merge_catalog_metrics, relabel_engine_metrics
from loragate.serving.engine_names import AnyVersionRename
from loragate.settings import Settings
from tests.backend_double import ProxiedBackend, adapter_stats, engine_snapshot, serving

ENGINE_TEXT = """\
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 987654.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="9",version="3.11.9"} 1.0
# HELP python_gc_collections_total Number of times this generation was collected
# TYPE python_gc_collections_total counter
python_gc_collections_total{generation="0"} 424242.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="3",running_lora_adapters="fox@00112233aabb,__base__@0123456789ab",waiting_lora_adapters=""} 1.7e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 2.0
"""


def stand_in_engine() -> FastAPI:
    engine = FastAPI()

    @engine.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(ENGINE_TEXT)

    return engine


@pytest.fixture
def scrape(tmp_path: Path) -> Iterator[str]:
    with serving(stand_in_engine()) as engine_url:
        backend = ProxiedBackend(
            engine_url,
            ["base", "fox"],
            engine=engine_snapshot(),
            adapters=adapter_stats(last_load_seconds=0.5, served=1),
            engine_url=engine_url,
        )
        # As the managed backend does: engine ids back to public names.
        backend.rename_engine_ids = AnyVersionRename("__base__@0123456789ab", "base").everywhere
        app = create_app(Settings(cache_dir=tmp_path), backend=backend)
        with serving(app) as url:
            yield httpx.get(url + "/metrics", timeout=10).text


def test_the_scrape_parses_with_prometheus_client(scrape: str) -> None:
    families = {family.name: family for family in text_string_to_metric_families(scrape)}
    # Standard process metrics, the gateway's own, each series once (the engine's are dropped).
    for name in ("process_open_fds", "process_start_time_seconds", "process_cpu_seconds"):
        assert len(families[name].samples) == 1, name
    # The engine's value (no process here has that many) was dropped, the gateway's kept.
    assert families["process_open_fds"].samples[0].value != 987654.0
    assert families["loragate_build_info"].samples[0].labels["version"]
    assert "loragate_adapter_last_load_duration_seconds" in families
    names = Counter(
        line.split("{")[0].split(" ")[0] for line in scrape.splitlines() if line[:1] != "#"
    )
    assert names["process_open_fds"] == 1
    assert names["python_info"] == 1
    # The gateway's garbage collections, one series per generation; the engine's dropped.
    collections = families["python_gc_collections"].samples
    assert sorted(s.labels["generation"] for s in collections) == ["0", "1", "2"]
    assert 424242.0 not in {s.value for s in collections}


def test_engine_series_carry_public_names_and_their_component(scrape: str) -> None:
    families = {family.name: family for family in text_string_to_metric_families(scrape)}
    lora = families["vllm:lora_requests_info"].samples[0].labels
    assert lora["running_lora_adapters"] == "fox,base"
    assert lora["component"] == "engine"
    running = families["vllm:num_requests_running"].samples[0].labels
    assert running == {"engine": "0", "model_name": "base", "component": "engine"}
    assert "@" not in scrape


def test_samples_without_labels_get_the_component_label() -> None:
    text = b"# TYPE up gauge\nup 1.0\nempty{} 2\n"
    assert relabel_engine_metrics(text, None) == (
        b'# TYPE up gauge\nup{component="engine"} 1.0\nempty{component="engine"} 2\n'
    )


def test_a_catalogs_engines_merge_into_one_valid_exposition() -> None:
    """Two engines' series (the same families, the same labels but for the model) under one
    HELP and TYPE each, told apart by ``catalog_model``."""
    histogram = (
        "# HELP vllm:e2e_request_latency_seconds Latency.\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="M"} 1.0\n'
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="M"} 2.0\n'
        'vllm:e2e_request_latency_seconds_count{model_name="M"} 2.0\n'
        'vllm:e2e_request_latency_seconds_sum{model_name="M"} 1.5\n'
    )
    texts = {
        model_id: relabel_engine_metrics(
            (ENGINE_TEXT + histogram).replace('model_name="base"', 'model_name="M"').encode(), None
        )
        for model_id in ("alpha", "beta")
    }
    merged = merge_catalog_metrics(texts).decode()
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    running = families["vllm:num_requests_running"].samples
    assert sorted(s.labels["catalog_model"] for s in running) == ["alpha", "beta"]
    assert all(s.labels["component"] == "engine" for s in running)
    latency = families["vllm:e2e_request_latency_seconds"].samples
    assert len(latency) == 8 and {s.labels["catalog_model"] for s in latency} == {"alpha", "beta"}
    assert "process_open_fds" not in merged  # the gateway's own, as for one engine
