"""The last minutes of traffic, second by second: what the status page draws.

Prometheus counters answer "how many since start"; a person looking at the page asks "how
busy is it now". So each finished inference request also lands in a per-second bucket
(count, errors, latency and time-to-first-token sums and maxima) in a ring of the last ten
minutes, and ``series`` folds them into a few dozen points. Recording is a dict lookup and a
few additions, on the same path as the counters.
"""

from __future__ import annotations

import time
from typing import Any

WINDOW_SECONDS = 600


class _Second:
    __slots__ = ("at", "errors", "latency_max", "latency_sum", "requests", "ttft_count", "ttft_sum")

    def __init__(self, at: int) -> None:
        self.at = at
        self.requests = 0
        self.errors = 0
        self.latency_sum = 0.0
        self.latency_max = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0


class RecentTraffic:
    """Per-second request buckets over the last ``WINDOW_SECONDS`` (wall-clock seconds)."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._seconds: dict[int, _Second] = {}

    def add(self, status: int, latency: float, ttft: float | None) -> None:
        at = int(self._clock())
        bucket = self._seconds.get(at)
        if bucket is None:
            bucket = self._seconds[at] = _Second(at)
            if len(self._seconds) > WINDOW_SECONDS:
                self._forget_before(at - WINDOW_SECONDS)
        bucket.requests += 1
        if status >= 400:
            bucket.errors += 1
        bucket.latency_sum += latency
        bucket.latency_max = max(bucket.latency_max, latency)
        if ttft is not None:
            bucket.ttft_sum += ttft
            bucket.ttft_count += 1

    def series(self, window: int = 300, step: int = 5) -> list[dict[str, Any]]:
        """Points of ``step`` seconds over the last ``window``, oldest first, empty ones included.

        Each: ``t`` (the point's end, epoch seconds), ``rps``, ``errors``, ``latency_avg``,
        ``latency_max`` and ``ttft_avg`` in seconds (None without requests).
        """
        window = max(step, min(window, WINDOW_SECONDS))
        now = int(self._clock())
        points = []
        for end in range(now - window + step, now + 1, step):
            buckets = [b for s in range(end - step + 1, end + 1) if (b := self._seconds.get(s))]
            requests = sum(b.requests for b in buckets)
            ttft_count = sum(b.ttft_count for b in buckets)
            points.append(
                {
                    "t": end,
                    "rps": round(requests / step, 3),
                    "errors": sum(b.errors for b in buckets),
                    "latency_avg": (
                        round(sum(b.latency_sum for b in buckets) / requests, 4)
                        if requests
                        else None
                    ),
                    "latency_max": (
                        round(max(b.latency_max for b in buckets), 4) if requests else None
                    ),
                    "ttft_avg": (
                        round(sum(b.ttft_sum for b in buckets) / ttft_count, 4)
                        if ttft_count
                        else None
                    ),
                }
            )
        return points

    def _forget_before(self, cutoff: int) -> None:
        for at in [at for at in self._seconds if at < cutoff]:
            del self._seconds[at]
