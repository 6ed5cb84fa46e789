"""How far an adapter add has come: stage (download, conversion, validation, load), bytes, percent.

The manager starts one ``AddProgress`` per ``put`` and makes it the current one (a context
variable) while the add runs. The pipeline runs in a worker thread (``asyncio.to_thread``
copies the context along), so the code that fetches, converts and validates reports into the
same record without being handed it: ``report_stage`` and ``report_bytes`` do nothing when no
add is being tracked. The admin API shows the record (``GET /admin/adapters/{name}``), and so
the status page and a CLI can show the same progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

STAGES = ("download", "conversion", "validation", "store", "load")
FINISHED_STAGES = ("done", "failed")

# How long a finished add stays on the board (so a page polling once a second sees its end),
# and how many finished ones are kept at most.
KEEP_FINISHED_SECONDS = 600.0
KEEP_FINISHED = 20


@dataclass
class AddProgress:
    name: str
    source: str
    stage: str = "download"
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    @property
    def finished(self) -> bool:
        return self.stage in FINISHED_STAGES

    @property
    def percent(self) -> float | None:
        """Of the download, when its size is known; 100 once past it."""
        if self.stage != "download":
            return 100.0
        if not self.bytes_total:
            return None
        return round(min(100.0, 100.0 * self.bytes_done / self.bytes_total), 1)

    def enter(self, stage: str) -> None:
        self.stage = stage
        self.updated_at = time.time()

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "stage": self.stage,
            "stages": list(STAGES),
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "percent": self.percent,
            "finished": self.finished,
            "error": self.error,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
        }


current_progress: ContextVar[AddProgress | None] = ContextVar("loragate_add_progress", default=None)


def report_stage(stage: str) -> None:
    record = current_progress.get()
    if record is not None:
        record.enter(stage)


def report_bytes(done: int, total: int | None) -> None:
    record = current_progress.get()
    if record is not None:
        record.bytes_done, record.bytes_total = done, total
        record.updated_at = time.time()


class ProgressBoard:
    """The adds running now and those that finished lately, by adapter name."""

    def __init__(self) -> None:
        self._records: dict[str, AddProgress] = {}

    def get(self, name: str) -> AddProgress | None:
        return self._records.get(name)

    def all(self) -> list[AddProgress]:
        self._forget_old()
        return sorted(self._records.values(), key=lambda record: record.started_at)

    @contextmanager
    def track(
        self, name: str, source: str, redact: Callable[[str], str] = str
    ) -> Iterator[AddProgress]:
        """Make a fresh record current for the block; it ends ``done``, or ``failed`` with why
        (passed through ``redact``: the record is shown to admins, a source's secrets never)."""
        record = AddProgress(name=name, source=source)
        self._records[name] = record
        self._forget_old()
        token = current_progress.set(record)
        try:
            yield record
        except BaseException as exc:
            record.error = redact(str(exc)) or type(exc).__name__
            record.enter("failed")
            raise
        else:
            record.enter("done")
        finally:
            current_progress.reset(token)

    def _forget_old(self) -> None:
        finished = [r for r in self._records.values() if r.finished]
        cutoff = time.time() - KEEP_FINISHED_SECONDS
        finished.sort(key=lambda record: record.updated_at)
        for index, record in enumerate(finished):
            if record.updated_at < cutoff or index < len(finished) - KEEP_FINISHED:
                self._records.pop(record.name, None)
