"""The engine's life cycle, as one table of allowed transitions.

stopped -> starting -> ready <-> unhealthy
              |          |          |
              v          v          v
           restarting (backoff) -> starting ... or -> failed (crash loop / cannot boot)
any running state -> stopping -> stopped;  failed -> starting (admin restart)
"""

from __future__ import annotations

from enum import StrEnum


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
