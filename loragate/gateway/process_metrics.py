"""The gateway's own process metrics: ``process_*``, ``python_info`` and ``loragate_build_info``.

``prometheus_client``'s standard collectors, in a registry of their own so the scrape
(``metrics_scrape``) writes them once, after the gateway's families and before the engine's
(whose own ``process_*`` and ``python_*`` families ``backends.engine_metrics`` drops).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

_registry = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=_registry)
PlatformCollector(registry=_registry)
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
    """``process_*``, ``python_info`` and ``loragate_build_info``, as prometheus_client writes them."""
    return generate_latest(_registry)
