"""Quantiles, ratios, the printed report, its tables, the watch on a measured process, and
the gateway's own counters."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from tools.bench import load
from tools.bench.load import Block, Samples

if TYPE_CHECKING:
    from tools.bench.targets import Process

DIRECT = "direct"
HEADER = f"  {'conc':>4}  {'target':<10} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8}  {'+p50':>8} {'+p90':>8} {'+p99':>8}"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    n: int
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(
            len(values), quantile(values, 0.5), quantile(values, 0.9), quantile(values, 0.99)
        )


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.2f}"


def signed_ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:+.2f}"


class Report:
    """Collects lines and the goal checks; prints as it goes so a long run shows progress."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.goals: list[tuple[bool, str]] = []

    def say(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)

    def goal(self, ok: bool, text: str) -> None:
        self.goals.append((ok, text))

    def finish(self) -> bool:
        if self.goals:
            self.say("")
            self.say("Goals")
            for ok, text in self.goals:
                self.say(f"  [{'met ' if ok else 'MISS'}] {text}")
        return all(ok for ok, _ in self.goals)


# ----- watching a measured process ----------------------------------------------------------


@dataclass
class ProcessWatch:
    """CPU time over the blocks aimed at one process, and its peak memory meanwhile."""

    process: Process
    target: str
    cpu: float = 0.0
    requests: int = 0
    peak_rss: int = 0
    _cpu_before: float = 0.0
    _sampler: asyncio.Task[None] | None = None
    per_block: list[float] = field(default_factory=list)

    async def before(self, target: str) -> None:
        if target != self.target:
            return
        self._cpu_before = self.process.cpu_seconds()
        self._sampler = asyncio.get_running_loop().create_task(self._sample())

    async def after(self, target: str) -> None:
        if target != self.target:
            return
        spent = self.process.cpu_seconds() - self._cpu_before
        self.cpu += spent
        self.per_block.append(spent)
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None

    async def _sample(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.peak_rss = max(self.peak_rss, self.process.rss())
            await asyncio.sleep(0.1)

    def count(self, results: list[Block]) -> None:
        self.requests += sum(b.requests for b in results if b.target == self.target)

    def cpu_ms_per_1000(self) -> float:
        return self.cpu / self.requests * 1e6 if self.requests else math.nan


class GatewayCounters:
    """The gateway's own counters (its /metrics) over one phase: its account of its time per
    request, and its young-generation garbage collections per request (a proxy at saturation
    pays for each; a few more objects per request in flight can make them ten times as many)."""

    OVERHEAD = "loragate_gateway_overhead_seconds_sum"
    REQUESTS = "loragate_gateway_overhead_seconds_count"
    YOUNG_GC = 'python_gc_collections_total{generation="0"}'

    def __init__(self, url: str) -> None:
        self.url = url + "/metrics"
        self._start: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for line in httpx.get(self.url, timeout=10).text.splitlines():
                name, _, value = line.rpartition(" ")
                if name in (self.OVERHEAD, self.REQUESTS, self.YOUNG_GC):
                    values[name] = float(value)
        return values

    def start(self) -> None:
        self._start = self._read()

    def _per_request(self, name: str) -> float:
        now = self._read()
        requests = now.get(self.REQUESTS, 0.0) - self._start.get(self.REQUESTS, 0.0)
        if name not in now or not requests:
            return math.nan  # a gateway without this counter, or no request
        return (now[name] - self._start.get(name, 0.0)) / requests

    def mean(self) -> float:
        """Seconds of its own time per request."""
        return self._per_request(self.OVERHEAD)

    def young_collections(self) -> float:
        """Young-generation garbage collections per request."""
        return self._per_request(self.YOUNG_GC)


def combine(*watches: ProcessWatch) -> tuple[load.BlockHook, load.BlockHook]:
    async def before(target: str) -> None:
        for watch in watches:
            await watch.before(target)

    async def after(target: str) -> None:
        for watch in watches:
            await watch.after(target)

    return before, after


# ----- tables ------------------------------------------------------------------------------


def latency_table(
    report: Report, samples: Samples, concurrency: int, pick: str = "latency"
) -> dict[str, Summary]:
    summaries: dict[str, Summary] = {}
    for name, values in samples.by_target.items():
        series = [
            getattr(s, pick) for s in values if s.status == 200 and getattr(s, pick) is not None
        ]
        summaries[name] = Summary.of(series)
    direct = summaries.get(DIRECT)
    for name, summary in summaries.items():
        added = ""
        if direct is not None and name != DIRECT:
            added = (
                f"  {signed_ms(summary.p50 - direct.p50):>8} {signed_ms(summary.p90 - direct.p90):>8} "
                f"{signed_ms(summary.p99 - direct.p99):>8}"
            )
        errors = samples.errors.get(name, 0)
        report.say(
            f"  {concurrency:>4}  {name:<10} {summary.n:>6} {ms(summary.p50):>8} {ms(summary.p90):>8} "
            f"{ms(summary.p99):>8}{added}" + (f"   ({errors} errors)" if errors else "")
        )
    return summaries


def paired_added(samples: Samples, name: str, pick: str = "latency") -> float:
    """Median of per-round differences (concurrency 1: sample i of each target is round i)."""
    ours, direct = samples.by_target.get(name, []), samples.by_target.get(DIRECT, [])
    pairs = [
        getattr(a, pick) - getattr(b, pick)
        for a, b in zip(ours, direct, strict=False)
        if a.status == b.status == 200
        and getattr(a, pick) is not None
        and getattr(b, pick) is not None
    ]
    return quantile(pairs, 0.5) if pairs else math.nan


def throughput_table(
    report: Report, results: list[Block], concurrency: int, unit: str
) -> dict[str, float]:
    rates: dict[str, tuple[float, float, int]] = {}
    for name in dict.fromkeys(b.target for b in results):
        mine = [b for b in results if b.target == name]
        seconds = sum(b.seconds for b in mine)
        rates[name] = (
            sum(b.requests for b in mine) / seconds,
            sum(b.tokens for b in mine) / seconds,
            sum(b.errors for b in mine),
        )
    direct = rates.get(DIRECT)
    direct_blocks = [b.requests / b.seconds for b in results if b.target == DIRECT]
    ratios: dict[str, float] = {}
    for name, (rps, tps, errors) in rates.items():
        ratio = rps / direct[0] if direct else math.nan
        ratios[name] = ratio
        token_ratio = tps / direct[1] if direct and direct[1] else math.nan
        blocks = [b.requests / b.seconds for b in results if b.target == name]
        spread = ""
        if name != DIRECT and direct_blocks:
            # Each round runs every target back to back: the ratio within a round shows the noise.
            per_round = sorted(x / d for x, d in zip(blocks, direct_blocks, strict=False) if d)
            spread = f"   per round x{quantile(per_round, 0.5):.2f} ({per_round[0]:.2f}..{per_round[-1]:.2f})"
        report.say(
            f"  {concurrency:>4}  {name:<10} {rps:>9.1f} req/s {tps:>9.1f} {unit}/s  "
            f"x{ratio:.3f} (tokens x{token_ratio:.3f}){spread}"
            + (f"   ({errors} errors)" if errors else "")
        )
    return ratios
