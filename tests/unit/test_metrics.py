"""The metrics module: what a scrape says after known traffic, in-process, against a fake engine."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from loragate.adapters.stats import AdapterStats
from loragate.engine_states import EngineState
from loragate.gateway.app import create_app
from loragate.gateway.observe.metrics import (
    UNKNOWN_MODEL,
    GatewayMetrics,
    Histogram,
    RequestObservation,
    RequestObserver,
)
from loragate.gateway.observe.metrics_scrape import exposition, request_families
from loragate.settings import Settings
from tests.backend_double import ProxiedBackend, adapter_stats, engine_snapshot
from tools.bench.fake_engine import FakeEngine, start_server

ADMIN = "admin-key"
JSON = {"Content-Type": "application/json"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text scrape, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest_asyncio.fixture(loop_scope="function")
async def engine() -> AsyncIterator[str]:
    server = await start_server(FakeEngine(api_key=None, models=["base", "tuned"]))
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


def client_for(backend: ProxiedBackend, tmp_path: Path, **settings: Any) -> httpx.AsyncClient:
    app = create_app(Settings(cache_dir=tmp_path, admin_key=ADMIN, **settings), backend=backend)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }


# ----- the pieces -------------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    histogram = Histogram((0.1, 1.0))
    for observed in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(observed)
    assert histogram.buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert histogram.total == pytest.approx(3.65) and histogram.count == 4


def test_requests_are_counted_by_route_model_and_status() -> None:
    metrics = GatewayMetrics()
    for model, status in (("base", 200), ("base", 200), ("tuned", 200), (None, 404)):
        observation = RequestObservation(started=10.0)
        observation.model, observation.status = model, status
        observation.upstream_seconds = 0.5 if status == 200 else 0.0
        metrics.record("/v1/chat/completions", observation, ended=10.5 + 0.001)
    samples = parse(exposition(request_families(metrics)).decode())
    route = "/v1/chat/completions"
    assert (
        value(samples, "loragate_requests_total", route=route, model_name="base", status="200") == 2
    )
    assert (
        value(samples, "loragate_requests_total", route=route, model_name="tuned", status="200")
        == 1
    )
    assert (
        value(
            samples, "loragate_requests_total", route=route, model_name=UNKNOWN_MODEL, status="404"
        )
        == 1
    )
    assert (
        value(samples, "loragate_request_duration_seconds_count", route=route, model_name="base")
        == 2
    )
    # Only requests that reached the upstream have an overhead, here 1 ms each.
    assert value(samples, "loragate_gateway_overhead_seconds_count") == 3
    assert value(samples, "loragate_gateway_overhead_seconds_bucket", le="0.0025") == 3
    assert value(samples, "loragate_gateway_overhead_seconds_bucket", le="0.0005") == 0


def test_label_values_are_escaped() -> None:
    metrics = GatewayMetrics()
    observation = RequestObservation(started=0.0)
    observation.model, observation.status = 'we"ird\\name', 200
    metrics.record("/v1/completions", observation, ended=0.01)
    samples = parse(exposition(request_families(metrics)).decode())
    assert (
        value(
            samples,
            "loragate_requests_total",
            route="/v1/completions",
            model_name='we"ird\\name',
            status="200",
        )
        == 1
    )


# ----- through the app --------------------------------------------------------------------------


async def test_scrape_counts_known_traffic_by_model_and_status(engine: str, tmp_path: Path) -> None:
    async with client_for(ProxiedBackend(engine, ["base", "tuned"]), tmp_path) as client:
        for model in ("base", "base", "tuned"):
            assert (await client.post("/v1/chat/completions", json=chat(model))).status_code == 200
        streamed = await client.post("/v1/chat/completions", json=chat("tuned", stream=True))
        assert streamed.status_code == 200 and b"[DONE]" in streamed.content
        assert (
            await client.post("/v1/completions", json={"model": "base", "prompt": "x"})
        ).status_code == 200
        for bogus in ("no-such-model", "another-one"):
            assert (await client.post("/v1/chat/completions", json=chat(bogus))).status_code == 404
        assert (
            await client.post("/v1/chat/completions", content=b"{not json", headers=JSON)
        ).status_code == 400
        assert (await client.get("/v1/models")).status_code == 200  # not an inference request

        scrape = await client.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse(scrape.text)
    chat_route, legacy = "/v1/chat/completions", "/v1/completions"
    assert (
        value(samples, "loragate_requests_total", route=chat_route, model_name="base", status="200")
        == 2
    )
    assert (
        value(
            samples, "loragate_requests_total", route=chat_route, model_name="tuned", status="200"
        )
        == 2
    )
    assert (
        value(samples, "loragate_requests_total", route=legacy, model_name="base", status="200")
        == 1
    )
    # Unchecked model names never become label values: they would let clients grow the scrape.
    assert (
        value(
            samples,
            "loragate_requests_total",
            route=chat_route,
            model_name=UNKNOWN_MODEL,
            status="404",
        )
        == 2
    )
    assert (
        value(
            samples,
            "loragate_requests_total",
            route=chat_route,
            model_name=UNKNOWN_MODEL,
            status="400",
        )
        == 1
    )
    assert not any("no-such-model" in str(labels) for _, labels in samples)
    assert value(samples, "loragate_time_to_first_token_seconds_count", model_name="tuned") == 1
    assert value(samples, "loragate_time_to_first_token_seconds_count", model_name="base") == 0
    assert value(samples, "loragate_gateway_overhead_seconds_count") == 5
    assert (
        value(
            samples, "loragate_request_duration_seconds_count", route=chat_route, model_name="base"
        )
        == 2
    )
    assert value(samples, "loragate_requests_in_flight") == 0
    assert value(samples, "process_resident_memory_bytes") > 0


async def test_metrics_need_the_admin_key_when_not_public(engine: str, tmp_path: Path) -> None:
    async with client_for(
        ProxiedBackend(engine, ["base"]), tmp_path, metrics_public=False
    ) as client:
        assert (await client.get("/metrics")).status_code == 401
        wrong = await client.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        right = await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert right.status_code == 200 and "loragate_requests_in_flight" in right.text


def engine_at(
    base_url: str, state: EngineState = EngineState.READY, adapters: AdapterStats | None = None
) -> ProxiedBackend:
    """A backend whose engine reports ``state`` (restarted twice, one request queued)."""
    engine = engine_snapshot(state=state, restarts=2, waiting_requests=1)
    return ProxiedBackend(base_url, ["base"], engine=engine, adapters=adapters, engine_url=base_url)


async def test_engine_state_adapters_and_the_engines_own_metrics_in_one_scrape(
    engine: str, tmp_path: Path
) -> None:
    adapters = adapter_stats(
        loads=3,
        swaps=1,
        load_failures=1,
        last_load_seconds=0.25,
        served=2,
        store_bytes=4096,
        store_evictions=2,
    )
    backend = engine_at(engine, adapters=adapters)
    async with client_for(backend, tmp_path) as client:
        await client.post("/v1/chat/completions", json=chat("base"))
        samples = parse((await client.get("/metrics")).text)
    assert value(samples, "loragate_engine_state", state="ready") == 1
    assert value(samples, "loragate_engine_state", state="restarting") == 0
    assert value(samples, "loragate_engine_restarts_total") == 2
    assert value(samples, "loragate_requests_queued") == 1
    assert value(samples, "loragate_adapter_loads_total") == 3
    assert value(samples, "loragate_adapter_swaps_total") == 1
    assert value(samples, "loragate_adapter_load_failures_total") == 1
    assert value(samples, "loragate_adapter_unloads_total") == 0
    assert value(samples, "loragate_adapter_last_load_duration_seconds") == 0.25
    assert value(samples, "loragate_adapters_served") == 2
    assert value(samples, "loragate_adapter_store_bytes") == 4096
    assert value(samples, "loragate_adapter_store_evictions_total") == 2
    # The engine's own metrics, fetched from its endpoint and appended.
    assert value(samples, "loragate_engine_metrics_up") == 1
    assert value(samples, "vllm:request_success_total", model_name="base", component="engine") == 1


async def test_a_silent_engine_does_not_break_the_scrape(engine: str, tmp_path: Path) -> None:
    dead = engine_at("http://127.0.0.1:9")  # discard port: nothing listens
    for backend in (dead, engine_at(engine, EngineState.RESTARTING)):
        async with client_for(backend, tmp_path) as client:
            scrape = await client.get("/metrics")
        assert scrape.status_code == 200
        samples = parse(scrape.text)
        assert value(samples, "loragate_engine_metrics_up") == 0
        assert not any(name.startswith("vllm:") for name, _ in samples)


async def test_access_log_lines_carry_request_id_model_status_and_duration(
    engine: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(
        Settings(cache_dir=tmp_path, admin_key=ADMIN), backend=ProxiedBackend(engine, ["base"])
    )
    observed = RequestObserver(app, GatewayMetrics(), access_log_enabled=True)
    caplog.set_level(logging.INFO, logger="loragate.access")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=observed), base_url="http://127.0.0.1"
    ) as client:
        response = await client.post(
            "/v1/chat/completions", json=chat("base"), headers={"X-Request-ID": "trace-42"}
        )
    assert response.headers["x-request-id"] == "trace-42"
    records = [r for r in caplog.records if r.name == "loragate.access"]
    assert len(records) == 1
    record = records[0]
    assert record.__dict__["request_id"] == "trace-42"
    assert record.__dict__["model"] == "base"
    assert record.__dict__["status"] == 200
    assert record.__dict__["duration_ms"] >= 0
    assert "trace-42" in record.getMessage()
