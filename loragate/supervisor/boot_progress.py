"""How far a boot has come, from the engine's log, reported every ``BOOT_REPORT_SECONDS`` so a
start-up of several minutes says what it is doing (in the log, in /health, and as the message
of the gateway's start progress record in its ``boot`` stage, which systemd's ``STATUS=``
shows)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from loragate.supervisor.engine_failure import current_boot
from loragate.supervisor.engine_log import boot_phase, tail_lines

log = logging.getLogger("loragate.supervisor")

BOOT_REPORT_SECONDS = 15.0  # how often a boot says how far it has come


class BootProgress:
    """One boot's clock: when it started and when its next report is due."""

    def __init__(self, log_path: Path) -> None:
        self._log_path = log_path
        self.started = time.monotonic()
        self._next_report = self.started + BOOT_REPORT_SECONDS

    def report_if_due(self) -> str | None:
        """A fresh account of the boot (also logged) when one is due, else None."""
        if time.monotonic() < self._next_report:
            return None
        self._next_report += BOOT_REPORT_SECONDS
        elapsed = time.monotonic() - self.started
        lines = current_boot(tail_lines(self._log_path, 80, max_bytes=64 * 1024))
        progress = f"{elapsed:.0f} s so far: {boot_phase(lines)}"
        log.info("engine starting, %s", progress)
        return progress
