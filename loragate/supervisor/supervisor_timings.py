"""How long the engine supervisor waits for what, in seconds unless said otherwise (the
``supervision`` settings, carried to it by ``gateway.backends.engine_plan.timings_from``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SupervisorTimings:
    startup_timeout: float = 900.0  # a boot that has not answered /health by then is killed
    probe_interval: float = 5.0  # between health probes of a ready engine
    probe_timeout: float = 5.0
    probe_failures: int = 3  # probes failed in a row before a hung engine is killed
    deep_probe: bool = False  # probe with a one-token completion too, not only /health
    restart_backoff: float = 1.0  # the first restart's delay, doubled for each recent failure
    restart_backoff_max: float = 30.0
    crash_loop_limit: int = 3  # failures within crash_loop_window before giving up (failed)
    crash_loop_window: float = 600.0
    stable_after: float = 120.0  # ready this long, and earlier failures no longer count
    stop_timeout: float = 20.0  # SIGTERM to SIGKILL
