"""Quantiles, ratios and the printed report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


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
