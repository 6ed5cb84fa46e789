"""/metrics on the real gateway and engine: counters follow known traffic; the engine's own
metrics come through the same scrape."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine

BASE = "loragate-demo"
CHAT = "/v1/chat/completions"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(gateway: GatewayProcess) -> Samples:
    response = httpx.get(f"{gateway.url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):  # raises if any line is malformed
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def ask(client: OpenAI, model: str) -> None:
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )


def test_request_counters_follow_known_traffic_by_model_and_status(
    gateway: GatewayProcess, client: OpenAI
) -> None:
    before = scrape(gateway)
    ask(client, BASE)
    ask(client, BASE)
    ask(client, "pong")
    stream = client.chat.completions.create(
        model="fox", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert [chunk for chunk in stream]
    client.completions.create(model=BASE, prompt="hello", max_tokens=2)
    missing = httpx.post(
        f"{gateway.url}{CHAT}",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert missing.status_code == 404
    after = scrape(gateway)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "loragate_requests_total"
    assert moved(requests, route=CHAT, model_name=BASE, status="200") == 2
    assert moved(requests, route=CHAT, model_name="pong", status="200") == 1
    assert moved(requests, route=CHAT, model_name="fox", status="200") == 1
    assert moved(requests, route="/v1/completions", model_name=BASE, status="200") == 1
    assert moved(requests, route=CHAT, model_name="unknown", status="404") == 1
    assert not any("no-such-model" in str(labels) for _, labels in after)
    assert moved("loragate_request_duration_seconds_count", route=CHAT, model_name=BASE) == 2
    assert moved("loragate_time_to_first_token_seconds_count", model_name="fox") == 1
    assert moved("loragate_time_to_first_token_seconds_count", model_name="pong") == 0
    # Five requests reached the engine; each has the gateway's own share of its time.
    assert moved("loragate_gateway_overhead_seconds_count") == 5
    assert value(after, "loragate_requests_in_flight") == 0


def test_engine_metrics_come_through_the_gateways_scrape(
    gateway: GatewayProcess, client: OpenAI
) -> None:
    before = scrape(gateway)
    ask(client, "owl")
    after = scrape(gateway)
    assert value(after, "loragate_engine_metrics_up") == 1
    assert any(name.startswith("vllm:") for name, _ in after)
    # The engine counted the request the gateway sent it.
    finished = "vllm:request_success_total"
    assert total(after, finished) - total(before, finished) >= 1
    assert value(after, "loragate_engine_state", state="ready") == 1
    assert value(after, "loragate_requests_queued") == 0
    assert value(after, "loragate_adapters_served") == 3
    assert value(after, "loragate_adapter_store_bytes") > 0
    assert value(after, "process_resident_memory_bytes") > 0
