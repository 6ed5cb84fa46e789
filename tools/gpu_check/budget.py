"""The acceptance run's clock: one overall budget, steps run in order, each skipped with its
reason when a package, a model or the time it needs is missing, and stopped when the budget
runs out under it. No GPU here: this part runs in the suite (tests/unit/test_gpu_check.py).

A step declares about how long it needs (``needs_s``) and what it needs besides time
(``requires``: each returns a reason to skip, or None). The runner skips a step whose needs
are not met, or when less than ``needs_s`` is left; otherwise it runs the step with an alarm
set at what is left less ``reserve_s`` (the time kept for stopping what the step started),
so that no step can take the run past its budget.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["passed", "failed", "skipped", "timed out"]


class CheckFailed(Exception):
    """A step's check did not hold: the message says what was found and what was wanted."""


class OutOfTime(Exception):
    """The budget ran out while a step was running."""


class Budget:
    """Seconds left of the run's budget, on ``clock`` (monotonic unless a test gives one)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._started = clock()

    def elapsed(self) -> float:
        return self._clock() - self._started

    def left(self) -> float:
        return max(self.seconds - self.elapsed(), 0.0)


@dataclass
class StepReport:
    """What a step found: its facts (numbers and names, for the JSON report) and its lines
    (for a person). A step fills it as it goes, so a step that fails or runs out of time
    still reports what it had found."""

    facts: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def fact(self, name: str, value: Any, line: str | None = None) -> None:
        self.facts[name] = value
        if line is not None:
            self.lines.append(line)

    def say(self, line: str) -> None:
        self.lines.append(line)


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[StepReport, Budget], None]
    needs_s: float
    requires: tuple[Callable[[], str | None], ...] = ()


@dataclass
class StepResult:
    name: str
    status: Status
    seconds: float
    reason: str | None = None
    report: StepReport = field(default_factory=StepReport)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "seconds": round(self.seconds, 1),
            "reason": self.reason,
            "facts": self.report.facts,
            "lines": self.report.lines,
        }


def skip_reason(step: Step, budget: Budget, reserve_s: float = 0.0) -> str | None:
    """Why ``step`` cannot run now, or None: its first unmet requirement, else too little time
    (what is left less ``reserve_s``, the time kept for stopping what a step started)."""
    for requirement in step.requires:
        reason = requirement()
        if reason is not None:
            return reason
    left = budget.left()
    if left - reserve_s < step.needs_s:
        kept = f" ({reserve_s:.0f} s of it kept for stopping)" if reserve_s else ""
        return (
            f"{left:.0f} s of the {budget.seconds:.0f} s budget left{kept}, "
            f"it needs about {step.needs_s:.0f} s"
        )
    return None


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise ``OutOfTime`` in this (main) thread after ``seconds``, whatever it is waiting on."""

    def expire(signum: int, frame: object) -> None:
        raise OutOfTime(f"the budget ran out ({seconds:.0f} s were left for this step)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_steps(
    steps: list[Step],
    budget: Budget,
    reserve_s: float = 20.0,
    on_result: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Run ``steps`` in order within ``budget``; each result is also handed to ``on_result``
    as soon as it is known (the report is printed as the run goes)."""
    results = []
    for step in steps:
        reason = skip_reason(step, budget, reserve_s)
        if reason is not None:
            result = StepResult(step.name, "skipped", 0.0, reason)
        else:
            result = run_one(step, budget, reserve_s)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def run_one(step: Step, budget: Budget, reserve_s: float) -> StepResult:
    report = StepReport()
    started = budget.elapsed()
    status: Status = "passed"
    reason = None
    try:
        with alarm(budget.left() - reserve_s):
            step.run(report, budget)
    except OutOfTime as exc:
        status, reason = "timed out", str(exc)
    except CheckFailed as exc:
        status, reason = "failed", str(exc)
    except Exception as exc:  # a step that broke is a failed step, and the run goes on
        status, reason = "failed", f"{type(exc).__name__}: {exc}"
    return StepResult(step.name, status, budget.elapsed() - started, reason, report)


def result_text(result: StepResult) -> str:
    """One step for a person: its status line, then what it found, indented."""
    head = f"== {result.name}: {result.status}"
    if result.status != "skipped":
        head += f" in {result.seconds:.1f} s"
    if result.reason:
        head += f": {result.reason}"
    return "\n".join([head, *(f"   {line}" for line in result.report.lines)])


def summary(results: list[StepResult], budget: Budget) -> str:
    counts = {status: 0 for status in ("passed", "failed", "skipped", "timed out")}
    for result in results:
        counts[result.status] += 1
    told = ", ".join(f"{n} {status}" for status, n in counts.items())
    return f"summary: {told}; {budget.elapsed():.0f} s of the {budget.seconds:.0f} s budget"


def exit_code(results: list[StepResult]) -> int:
    """0 when no step failed or ran out of time (skipped steps say why, and do not fail the
    run), else 1."""
    return 1 if any(r.status in ("failed", "timed out") for r in results) else 0


def json_report(results: list[StepResult], budget: Budget) -> str:
    return json.dumps(
        {
            "budget_s": budget.seconds,
            "elapsed_s": round(budget.elapsed(), 1),
            "exit_code": exit_code(results),
            "steps": [result.as_dict() for result in results],
        },
        indent=2,
    )
