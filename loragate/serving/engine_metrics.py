"""The engine's own /metrics, as the gateway's scrape shows it.

The engine's series are appended to the gateway's scrape (``metrics_scrape.render``) with three
changes, so one scrape target reads as one service:

- every engine sample carries ``component="engine"``;
- adapter version ids in label values (``fox@0123456789ab`` in
  ``vllm:lora_requests_info``'s ``running_lora_adapters``) become public names (``fox``),
  the zero adapter's becoming the base model's;
- the engine's ``process_*`` and ``python_*`` families are dropped: those names belong to the
  process being scraped, the gateway, whose own come from ``prometheus_client``'s standard
  collectors (``process_*`` with open fds and start time, ``python_info``, ``python_gc_*``;
  ``metrics_scrape``), once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from loragate.http import oneshot

log = logging.getLogger("loragate.gateway")

_OWN_FAMILIES = (b"process_", b"python_")
_COMPONENT = b'component="engine"'


def relabel_engine_metrics(text: bytes, rename: Callable[[bytes], bytes] | None) -> bytes:
    """The engine's exposition with ``component="engine"``, public adapter names (``rename``
    turns engine ids into them), and without the families that belong to the scraped process."""
    out: list[bytes] = []
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith(b"#"):
            parts = line.split(b" ", 3)
            if len(parts) >= 3 and parts[2].startswith(_OWN_FAMILIES):
                continue
            out.append(line)
            continue
        if line.startswith(_OWN_FAMILIES):
            continue
        if rename is not None and b"@" in line:
            line = rename(line)
        out.append(_with_component(line))
    return b"\n".join(out) + b"\n" if out else b""


def _with_component(sample: bytes) -> bytes:
    return _with_label(sample, _COMPONENT)


def _with_label(sample: bytes, label: bytes) -> bytes:
    brace = sample.find(b"{")
    space = sample.find(b" ")
    if brace != -1 and (space == -1 or brace < space):
        closing = sample.find(b"}", brace)
        if closing == brace + 1:  # name{} value
            return sample[: brace + 1] + label + sample[closing:]
        return sample[: brace + 1] + label + b"," + sample[brace + 1 :]
    if space == -1:
        return sample
    return sample[:space] + b"{" + label + b"}" + sample[space:]


def merge_catalog_metrics(expositions: dict[str, bytes]) -> bytes:
    """A catalog's engines' relabelled expositions (by model id) as one: every sample also
    carries ``catalog_model="ID"`` (two engines' process-wide series would be the same series
    otherwise), and each family's ``# HELP`` and ``# TYPE`` come once, its samples from every
    engine after them, as the exposition format asks."""
    families: dict[bytes, tuple[list[bytes], list[bytes]]] = {}  # name -> (header, samples)
    for model_id, text in expositions.items():
        label = b'catalog_model="' + model_id.encode() + b'"'
        current: bytes | None = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith(b"#"):
                parts = line.split(b" ", 3)
                if len(parts) >= 3 and parts[1] in (b"HELP", b"TYPE"):
                    current = parts[2]
                    header, _ = families.setdefault(current, ([], []))
                    if not any(seen.split(b" ", 2)[1] == parts[1] for seen in header):
                        header.append(line)
                continue
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
            family = current if current is not None and name.startswith(current) else name
            families.setdefault(family, ([], []))[1].append(_with_label(line, label))
    out = [line for header, samples in families.values() for line in (*header, *samples)]
    return b"\n".join(out) + b"\n" if out else b""


# vLLM's KV-cache use, a fraction (1 is full); the older name before vLLM 0.10.
_KV_CACHE_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")


def kv_cache_usage(text: bytes) -> float | None:
    """The engine's KV-cache use (0 to 1) from its relabelled exposition, the highest over its
    series (one per engine, under data parallelism); None when it reports none."""
    found: list[float] = []
    for line in text.splitlines():
        if line.startswith(_KV_CACHE_USAGE):
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
            if name in _KV_CACHE_USAGE:
                try:
                    found.append(float(line.rsplit(b" ", 1)[1]))
                except (IndexError, ValueError):
                    continue
    return max(found) if found else None


class EngineAddress(Protocol):
    @property
    def base_url(self) -> str: ...
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def uds(self) -> str | None: ...


async def scrape_engine_metrics(
    endpoint: EngineAddress, rename: Callable[[bytes], bytes] | None
) -> bytes | None:
    """The engine's /metrics as the gateway's scrape shows it, or None when the engine does
    not answer (the gateway's scrape must answer even then)."""
    try:
        answer = await oneshot.request(
            "GET",
            endpoint.base_url + "/metrics",
            timeout=3.0,
            headers=endpoint.headers,
            uds=endpoint.uds,
        )
    except Exception as exc:
        log.debug("metrics: the engine's /metrics did not answer: %r", exc)
        return None
    return relabel_engine_metrics(answer.body, rename) if answer.status == 200 else None
