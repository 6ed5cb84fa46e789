"""One look at the engine's supervision: what the metrics, status and admin routes read.

The supervisor hands out this frozen copy instead of its attributes, so nothing above it
depends on how it keeps its state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loragate.supervisor.states import SERVING, EngineState


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
