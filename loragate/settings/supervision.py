"""How the engine is supervised: its start, its health probes, restarts after a crash, and
how long a stop and a drain may take; in seconds unless said otherwise.

``EngineSupervisor`` takes this group itself (``Settings`` is one), so each timing is declared
here once.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SupervisionFields(BaseModel):
    startup_timeout: float = Field(
        default=900.0,
        gt=0,
        description="Seconds one engine boot may take to answer /health; then it is killed.",
    )
    probe_interval: float = Field(
        default=5.0, gt=0, description="Seconds between health probes of a ready engine."
    )
    probe_timeout: float = Field(
        default=5.0, gt=0, description="Seconds one health probe may take."
    )
    probe_failures: int = Field(
        default=3,
        ge=1,
        description="Health probes failed in a row before a hung engine is killed and restarted.",
    )
    deep_probe: bool = Field(
        default=False,
        description="Probe with a one-token completion too, not only the engine's /health.",
    )
    restart_backoff: float = Field(
        default=1.0,
        ge=0,
        description="Seconds before the first restart after a failure, doubled per failure.",
    )
    restart_backoff_max: float = Field(
        default=30.0, ge=0, description="Longest wait between restarts, in seconds."
    )
    crash_loop_limit: int = Field(
        default=3,
        ge=1,
        description=(
            "Failures within crash_loop_window that put the engine in `failed`: no more "
            "restarts until POST /admin/engine/restart."
        ),
    )
    crash_loop_window: float = Field(
        default=600.0, gt=0, description="Seconds over which crash_loop_limit failures count."
    )
    stable_after: float = Field(
        default=120.0,
        ge=0,
        description="Seconds ready after which the engine's earlier failures are forgotten.",
    )
    stop_timeout: float = Field(
        default=20.0, gt=0, description="Seconds from SIGTERM to SIGKILL when the engine stops."
    )
    drain_timeout: float = Field(
        default=30.0,
        ge=0,
        description=(
            "Seconds requests in flight at shutdown have to finish (0: none waited for; a "
            "second SIGTERM or SIGINT stops waiting)."
        ),
    )
