"""How the engine is supervised: its start, its health probes, restarts after a crash, and
how long a stop and a drain may take; in seconds unless said otherwise.

``EngineSupervisor`` takes this group itself (``Settings`` is one), so each timing is declared
here once.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SupervisionFields(BaseModel):
    startup_timeout: float = Field(default=900.0, gt=0)  # no /health by then: the boot is killed
    probe_interval: float = Field(default=5.0, gt=0)  # between health probes of a ready engine
    probe_timeout: float = Field(default=5.0, gt=0)
    probe_failures: int = Field(default=3, ge=1)  # failed in a row before a hung engine is killed
    deep_probe: bool = False  # probe with a one-token completion too, not only /health
    restart_backoff: float = Field(default=1.0, ge=0)  # first restart's delay, doubled per failure
    restart_backoff_max: float = Field(default=30.0, ge=0)
    crash_loop_limit: int = Field(default=3, ge=1)  # failures within the window: give up (failed)
    crash_loop_window: float = Field(default=600.0, gt=0)
    stable_after: float = Field(default=120.0, ge=0)  # ready this long: earlier failures forgotten
    stop_timeout: float = Field(default=20.0, gt=0)  # SIGTERM to SIGKILL
    drain_timeout: float = Field(default=30.0, ge=0)
