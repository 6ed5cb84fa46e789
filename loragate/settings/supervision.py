"""How the engine is supervised: its start, its health probes, restarts after a crash, and
how long a stop and a drain may take."""

from __future__ import annotations

from pydantic import BaseModel, Field


class SupervisionFields(BaseModel):
    startup_timeout: float = Field(default=900.0, gt=0)
    probe_interval: float = Field(default=5.0, gt=0)
    probe_timeout: float = Field(default=5.0, gt=0)
    probe_failures: int = Field(default=3, ge=1)
    deep_probe: bool = False
    restart_backoff: float = Field(default=1.0, ge=0)
    restart_backoff_max: float = Field(default=30.0, ge=0)
    crash_loop_limit: int = Field(default=3, ge=1)
    crash_loop_window: float = Field(default=600.0, gt=0)
    stable_after: float = Field(default=120.0, ge=0)
    stop_timeout: float = Field(default=20.0, gt=0)
    drain_timeout: float = Field(default=30.0, ge=0)
