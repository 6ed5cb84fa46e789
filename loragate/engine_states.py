"""The engine's life cycle, as one table of allowed transitions.

stopped -> starting -> ready <-> unhealthy
              |          |          |
              v          v          v
           restarting (backoff) -> starting ... or -> failed (crash loop / cannot boot)
any running state -> stopping -> stopped;  failed -> starting (admin restart)

With what an engine reports in those states (``EngineSnapshot``), a model's residency, and the
context length an OpenAI model list gives (``listed_max_model_len``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.STOPPED: frozenset({EngineState.STARTING}),
    EngineState.STARTING: frozenset(
        {EngineState.READY, EngineState.RESTARTING, EngineState.FAILED, EngineState.STOPPING}
    ),
    EngineState.READY: frozenset(
        {EngineState.UNHEALTHY, EngineState.RESTARTING, EngineState.STOPPING}
    ),
    EngineState.UNHEALTHY: frozenset(
        {EngineState.READY, EngineState.RESTARTING, EngineState.STOPPING}
    ),
    EngineState.RESTARTING: frozenset(
        {EngineState.STARTING, EngineState.RESTARTING, EngineState.FAILED, EngineState.STOPPING}
    ),
    EngineState.FAILED: frozenset({EngineState.STARTING, EngineState.STOPPING}),
    EngineState.STOPPING: frozenset({EngineState.STOPPED}),
}

# States in which the engine takes requests.
SERVING = frozenset({EngineState.READY, EngineState.UNHEALTHY})
# States from which it will become ready by itself.
RECOVERING = frozenset({EngineState.STARTING, EngineState.RESTARTING})


class InvalidTransition(RuntimeError):
    pass


def check_transition(current: EngineState, target: EngineState) -> None:
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(f"engine cannot go from {current} to {target}")


# One look at the engine's supervision: what the metrics, status and admin routes read.
#
# The supervisor hands out this frozen copy instead of its attributes, so nothing above it
# depends on how it keeps its state.
@dataclass(frozen=True)
class EngineSnapshot:
    state: EngineState
    reason: str
    since: float  # wall-clock time of the last state change
    boot_progress: str | None  # what a booting engine is doing, in words
    pid: int | None  # the vLLM API server's
    launcher_pid: int | None
    uptime_s: float | None
    restarts: int
    last_exit: str | None
    last_exit_at: float | None
    waiting_requests: int  # requests waiting for the engine to serve
    log_file: Path

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of ``GET /admin/engine`` (without its log tail)."""
        data = asdict(self)
        data["state"] = str(self.state)
        data["log_file"] = str(self.log_file)
        return data


# A base model's residency, as a catalog and ``gateway models list`` report it: whether its
# engine holds memory and takes requests, derived from the engine's state.
RESIDENT, LOADING, ASLEEP, COLD, FAILED = "resident", "loading", "asleep", "cold", "failed"
RESIDENCIES = (RESIDENT, LOADING, ASLEEP, COLD, FAILED)


def residency(state: EngineState, *, prepared: bool, failed: bool, asleep: bool) -> str:
    """``failed``: the model could not be prepared; ``prepared``: its model and adapters are
    set up (a stopped engine is then cold: the next request boots it)."""
    if failed or state == EngineState.FAILED:
        return FAILED
    if state in SERVING:
        return ASLEEP if asleep else RESIDENT
    if state == EngineState.STOPPED and prepared:
        return COLD
    return LOADING


def listed_max_model_len(listing: Any) -> int | None:
    """The ``max_model_len`` of the first entry of an OpenAI model list (vLLM gives every
    entry, base and adapters, the engine's one context length); None when it has none."""
    items = listing.get("data") if isinstance(listing, dict) else None
    first = items[0] if isinstance(items, list) and items else None
    value = first.get("max_model_len") if isinstance(first, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
