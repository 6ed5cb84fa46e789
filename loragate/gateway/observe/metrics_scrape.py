"""GET /metrics: every family the gateway exposes, written by ``prometheus_client``.

Requests are recorded lock-free in ``metrics.GatewayMetrics`` (a few dict operations per
request); a scrape turns that record, the engine's state and the adapter counters into metric
families for a collector, and ``prometheus_client`` writes the exposition (names, escaping,
``NaN``, histogram buckets), followed by its standard ``process_*`` and ``python_info``
families and ``loragate_build_info`` (``gateway_process_metrics``), then the engine's own series with
``component="engine"``. The model is labelled ``model_name``, as vLLM labels its own series.

A catalog of base models (``CatalogAdmin``) adds one series per model (``model_name``: its
id): residency, memory, last use, loads and unloads, and the engine gauges of each model's
engine instead of one engine's; and the catalog's swaps. Its serving engines' own ``vllm:*``
series are appended as one exposition (``merge_catalog_metrics``): each sample also labelled
``catalog_model``, each family's HELP and TYPE written once, since every engine writes the
same families.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from loragate.adapters.stats import AdapterStats
from loragate.engine_states import RESIDENCIES, EngineSnapshot, EngineState
from loragate.gateway.backends.base import (
    CatalogAdmin,
    adapter_stats_of,
    engine_metrics_of,
    engine_snapshot_of,
)

if TYPE_CHECKING:
    from loragate.gateway.observe.metrics import GatewayMetrics
    from loragate.gateway.runtime import Gateway

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NAN = float("nan")

# The gateway's own process metrics (``process_*``, ``python_info``, ``python_gc_*``: its garbage
# collections by generation, which cost a proxy CPU at saturation; ``loragate_build_info``):
# prometheus_client's standard collectors in a registry of their own, so the scrape writes them
# once, after the gateway's families and before the engine's (whose own ``process_*`` and
# ``python_*`` families ``serving.engine_metrics`` drops).
_registry = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=_registry)
PlatformCollector(registry=_registry)
GCCollector(registry=_registry)
_build = Gauge(
    "loragate_build_info",
    "loragate's version (the value is always 1).",
    ["version"],
    registry=_registry,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("loragate")
    except PackageNotFoundError:
        return "unknown"


_build.labels(version=_version()).set(1)


def gateway_process_metrics() -> bytes:
    """``process_*``, ``python_info``, ``python_gc_*`` and ``loragate_build_info``, as
    prometheus_client writes them."""
    return generate_latest(_registry)


class _Families(Collector):
    """One scrape's families, handed to a registry of its own."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def request_families(metrics: GatewayMetrics) -> list[Metric]:
    """The gateway's request metrics, by route and public model (``model_name``)."""
    requests = CounterMetricFamily(
        "loragate_requests",
        "Inference requests answered, by route, public model and HTTP status.",
        labels=["route", "model_name", "status"],
    )
    for (route, model, status), count in sorted(metrics.requests.items()):
        requests.add_metric([route, model, str(status)], count)
    duration = HistogramMetricFamily(
        "loragate_request_duration_seconds",
        "Time from request to the end of the answer.",
        labels=["route", "model_name"],
    )
    for (route, model), histogram in sorted(metrics.duration.items()):
        duration.add_metric([route, model], histogram.buckets(), histogram.total)
    ttft = HistogramMetricFamily(
        "loragate_time_to_first_token_seconds",
        "Streamed requests: time to the first event.",
        labels=["model_name"],
    )
    for model, histogram in sorted(metrics.ttft.items()):
        ttft.add_metric([model], histogram.buckets(), histogram.total)
    overhead = HistogramMetricFamily(
        "loragate_gateway_overhead_seconds",
        "Time a proxied request spent in the gateway itself (its duration minus the upstream's).",
    )
    overhead.add_metric([], metrics.overhead.buckets(), metrics.overhead.total)
    in_flight = GaugeMetricFamily(
        "loragate_requests_in_flight", "Inference requests being answered now."
    )
    in_flight.add_metric([], metrics.in_flight)
    return [requests, duration, ttft, overhead, in_flight, *token_families(metrics)]


def token_families(metrics: GatewayMetrics) -> list[Metric]:
    """Tokens by public model, from each answer's ``usage`` (streamed answers included)."""
    prompt = CounterMetricFamily(
        "loragate_prompt_tokens",
        "Prompt tokens of answered requests (the engine's usage), by public model.",
        labels=["model_name"],
    )
    for model, count in sorted(metrics.prompt_tokens.items()):
        prompt.add_metric([model], count)
    completion = CounterMetricFamily(
        "loragate_completion_tokens",
        "Generated tokens of answered requests (the engine's usage), by public model.",
        labels=["model_name"],
    )
    for model, count in sorted(metrics.completion_tokens.items()):
        completion.add_metric([model], count)
    tpot = HistogramMetricFamily(
        "loragate_time_per_output_token_seconds",
        "Streamed requests: time per generated token after the first.",
        labels=["model_name"],
    )
    for model, histogram in sorted(metrics.tpot.items()):
        tpot.add_metric([model], histogram.buckets(), histogram.total)
    return [prompt, completion, tpot]


async def render(gateway: Gateway) -> bytes:
    """The whole scrape: the gateway's metrics, its backend's state, then the engine's own."""
    families = request_families(gateway.metrics)
    backend = gateway.backend
    if isinstance(backend, CatalogAdmin):
        families += catalog_families(backend.catalog_report())
        engines: dict[tuple[str, ...], EngineSnapshot] = {
            (model_id,): engine for model_id, engine in backend.engine_snapshots().items()
        }
        families += _engine_families(engines, ["model_name"])
    elif (engine := engine_snapshot_of(backend)) is not None:
        families += _engine_families({(): engine}, [])
    adapters = await adapter_stats_of(backend)
    if adapters is not None:
        families += _adapter_families(adapters)
    engine_text = await engine_metrics_of(backend)
    # One unlabelled gauge cannot say which of a catalog's engines answered: a catalog has none.
    if not isinstance(backend, CatalogAdmin):
        families.append(
            _gauge(
                "loragate_engine_metrics_up",
                "Whether the engine's own /metrics answered this scrape.",
                1 if engine_text else 0,
            )
        )
    return exposition(families) + gateway_process_metrics() + (engine_text or b"")


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _engine_families(
    engines: Mapping[tuple[str, ...], EngineSnapshot], labels: Sequence[str]
) -> list[Metric]:
    """The engine gauges, one series per engine: ``engines`` by their ``labels``' values (one
    engine and no labels for a single model; a catalog's by ``model_name``)."""
    state = GaugeMetricFamily(
        "loragate_engine_state",
        "The engine's life-cycle state (1 for the current one).",
        labels=[*labels, "state"],
    )
    restarts = CounterMetricFamily(
        "loragate_engine_restarts", "Engine restarts since the gateway started.", labels=labels
    )
    queued = GaugeMetricFamily(
        "loragate_requests_queued",
        "Requests waiting for the engine to become ready.",
        labels=labels,
    )
    for values, engine in engines.items():
        for known in EngineState:
            state.add_metric([*values, str(known)], 1 if known == engine.state else 0)
        restarts.add_metric(list(values), engine.restarts)
        queued.add_metric(list(values), engine.waiting_requests)
    return [state, restarts, queued]


def catalog_families(report: dict[str, Any]) -> list[Metric]:
    """A catalog's models by ``model_name`` (``CatalogAdmin.catalog_report``), and its swaps."""
    by_model = ["model_name"]
    residency = GaugeMetricFamily(
        "loragate_model_residency",
        "Where a catalog model is: resident, loading, asleep, cold or failed (1 for the current "
        "one).",
        labels=[*by_model, "residency"],
    )
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "memory_bytes": GaugeMetricFamily(
            "loragate_model_memory_bytes",
            "The memory a model's engine is planned to hold (what counts against the "
            "memory budget while it runs).",
            labels=by_model,
        ),
        "in_flight": GaugeMetricFamily(
            "loragate_model_requests_in_flight",
            "Requests a model's engine is answering now.",
            labels=by_model,
        ),
        "last_used": GaugeMetricFamily(
            "loragate_model_last_used_timestamp_seconds",
            "When a model last answered a request (Unix time; its start until its first).",
            labels=by_model,
        ),
        "adapters": GaugeMetricFamily(
            "loragate_model_adapters", "Adapters a model serves.", labels=by_model
        ),
        "loads": CounterMetricFamily(
            "loragate_model_loads", "Boots of a model's engine into memory.", labels=by_model
        ),
        "unloads": CounterMetricFamily(
            "loragate_model_unloads",
            "Unloads of a model's engine (to make room, idle past its ttl, or by an admin).",
            labels=by_model,
        ),
    }
    now = time.time()
    for model in report["models"]:
        name = [model["id"]]
        for known in dict.fromkeys([*RESIDENCIES, model["residency"]]):  # each shown once
            residency.add_metric([*name, known], 1 if model["residency"] == known else 0)
        memory = model["memory_bytes"]
        families["memory_bytes"].add_metric(name, NAN if memory is None else memory)
        families["in_flight"].add_metric(name, model["in_flight"])
        families["last_used"].add_metric(name, round(now - model["idle_seconds"], 1))
        families["adapters"].add_metric(name, len(model["adapters"]))
        families["loads"].add_metric(name, model["loads"])
        families["unloads"].add_metric(name, model["unloads"])
    last_swap, budget = report["last_swap"], report["memory_budget"]
    cap = report["max_loaded_models"]
    return [
        residency,
        *families.values(),
        _counter(
            "loragate_catalog_swaps",
            "Loads that unloaded other models to make room.",
            report["swaps"],
        ),
        _gauge(
            "loragate_catalog_last_swap_timestamp_seconds",
            "When the last swap happened (Unix time; NaN before the first).",
            NAN if last_swap is None else last_swap["at"],
        ),
        _gauge(
            "loragate_catalog_memory_budget_bytes",
            "The memory the resident models' engines may hold together (NaN: not known yet).",
            NAN if budget is None else budget,
        ),
        _gauge(
            "loragate_catalog_max_loaded_models",
            "How many models may be resident at once (NaN: no cap).",
            NAN if cap is None else cap,
        ),
    ]


_ADAPTER_COUNTERS = (
    ("loads", "loragate_adapter_loads", "Adapter versions loaded into the engine."),
    ("swaps", "loragate_adapter_swaps", "Hot swaps: a public name moved to a new version."),
    ("load_failures", "loragate_adapter_load_failures", "Adapter loads that failed."),
    ("unloads", "loragate_adapter_unloads", "Retired adapter versions unloaded after draining."),
    (
        "store_repairs",
        "loragate_adapter_store_repairs",
        "Live adapter versions found modified on disk and stored again from their source.",
    ),
)


def _adapter_families(adapters: AdapterStats) -> list[Metric]:
    last = adapters.last_load_seconds
    size = adapters.store_bytes
    return [
        *(
            _counter(name, help_text, getattr(adapters, key))
            for key, name, help_text in _ADAPTER_COUNTERS
        ),
        _gauge(
            "loragate_adapter_last_load_duration_seconds",
            "How long the last adapter load took.",
            last if last is not None else NAN,
        ),
        _gauge(
            "loragate_adapters_served",
            "Public adapter names served now (the base model excluded).",
            adapters.served,
        ),
        _gauge(
            "loragate_adapter_store_bytes",
            "Bytes the adapter store holds on disk.",
            size if size is not None else NAN,
        ),
        _counter(
            "loragate_adapter_store_evictions",
            "Adapter versions evicted to keep the store under its cap.",
            adapters.store_evictions,
        ),
    ]
