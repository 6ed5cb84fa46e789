"""How far a long wait has come, in one record: an adapter add, the base model's download or
dequantization, the engine's boot. Stage, bytes done of total, percent, rate and a message.

The manager starts one ``WaitProgress`` per ``put`` and makes it the current one (a context
variable) while the add runs; a model's runtime does the same for the gateway's start
(base model download, GGUF dequantization, engine boot). The work runs in worker threads
(``asyncio.to_thread`` copies the context along), so the code that fetches, converts and
validates reports into the same record without being handed it: ``report_stage``,
``report_bytes`` and ``report_steps`` do nothing when no wait is being tracked. The admin API
shows an add's record (``GET /admin/adapters/{name}``), ``/health`` the start's, and the status
page, ``gateway adapters add``, ``gateway pull`` and systemd's ``STATUS=`` show ``describe()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

STAGES = ("download", "conversion", "validation", "store", "load")
# The gateway's own start: the base model is fetched (download), a GGUF dequantized
# (dequantization), then the engine boots (boot).
START_STAGES = ("prepare", "download", "dequantization", "boot")
FINISHED_STAGES = ("done", "failed")
# Stages measured in bytes; the others count steps (tensors, say) when they count at all.
BYTE_STAGES = ("download",)

# How long a finished add stays on the board (so a page polling once a second sees its end),
# and how many finished ones are kept at most.
KEEP_FINISHED_SECONDS = 600.0
KEEP_FINISHED = 20


@dataclass
class WaitProgress:
    name: str
    source: str
    stage: str = "download"
    bytes_done: int = 0
    bytes_total: int | None = None
    steps_done: int = 0  # of a stage that counts steps rather than bytes (tensors dequantized)
    steps_total: int | None = None
    message: str | None = None  # what the stage is doing, in words (the engine's boot phase)
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    stage_started_at: float = field(default_factory=time.time)

    @property
    def finished(self) -> bool:
        return self.stage in FINISHED_STAGES

    @property
    def percent(self) -> float | None:
        """Of the stage's bytes or steps, when their total is known; an add's past its
        download is 100 (what follows is short), a stage with nothing to count None."""
        if self.stage in BYTE_STAGES:
            done, total = self.bytes_done, self.bytes_total
        elif self.steps_total:
            done, total = self.steps_done, self.steps_total
        else:
            return 100.0 if self.stage in STAGES or self.finished else None
        if not total:
            return None
        return round(min(100.0, 100.0 * done / total), 1)

    @property
    def rate(self) -> float | None:
        """Bytes per second of the download so far, once a second of it has passed."""
        elapsed = self.updated_at - self.stage_started_at
        if self.stage not in BYTE_STAGES or elapsed < 1.0 or not self.bytes_done:
            return None
        return round(self.bytes_done / elapsed, 1)

    def enter(self, stage: str) -> None:
        if stage != self.stage:
            self.stage_started_at = time.time()
            self.steps_done, self.steps_total = 0, None
            if stage not in BYTE_STAGES:
                self.message = None
        self.stage = stage
        self.updated_at = time.time()

    def describe(self) -> str:
        """One line for a person: ``download acme/m 42% (1.2 GiB of 2.9 GiB, 31.0 MiB/s)``."""
        head = f"{self.stage} {self.source}" if self.source else self.stage
        if self.stage == "failed":
            return f"{head}: {self.error}" if self.error else head
        parts: list[str] = []
        if self.stage in BYTE_STAGES and self.bytes_done:
            parts.append(
                f"{_size(self.bytes_done)} of {_size(self.bytes_total)}"
                if self.bytes_total
                else _size(self.bytes_done)
            )
            if self.rate:
                parts.append(f"{_size(int(self.rate))}/s")
        elif self.steps_total:
            parts.append(f"{self.steps_done} of {self.steps_total}")
        if self.message:
            parts.append(self.message)
        percent = self.percent if self.stage in BYTE_STAGES or self.steps_total else None
        line = f"{head} {percent:.0f}%" if percent is not None else head
        return f"{line} ({', '.join(parts)})" if parts else line

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "stage": self.stage,
            "stages": list(START_STAGES if self.stage in START_STAGES else STAGES),
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "steps_done": self.steps_done,
            "steps_total": self.steps_total,
            "percent": self.percent,
            "rate": self.rate,
            "message": self.message,
            "description": self.describe(),
            "finished": self.finished,
            "error": self.error,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
        }


def _size(size: int | None) -> str:
    value = float(size or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop always returns


current_progress: ContextVar[WaitProgress | None] = ContextVar(
    "loragate_wait_progress", default=None
)


def report_stage(stage: str, message: str | None = None) -> None:
    record = current_progress.get()
    if record is not None:
        record.enter(stage)
        if message is not None:
            record.message = message


def report_bytes(done: int, total: int | None) -> None:
    record = current_progress.get()
    if record is not None:
        record.bytes_done, record.bytes_total = done, total
        record.updated_at = time.time()


def report_steps(done: int, total: int | None, record: WaitProgress | None = None) -> None:
    """Steps of the current stage (``record``, else the current one) done of ``total``."""
    record = record or current_progress.get()
    if record is not None:
        record.steps_done, record.steps_total = done, total
        record.updated_at = time.time()


def report_message(message: str | None) -> None:
    record = current_progress.get()
    if record is not None:
        record.message = message
        record.updated_at = time.time()


def hub_progress_class(record: WaitProgress | None = None) -> Any:
    """A silent ``tqdm_class`` for ``snapshot_download`` and ``hf_hub_download`` that feeds the
    bytes of every byte bar into ``record`` (default: the current one).

    huggingface_hub makes its bars in the calling thread but updates them from its download
    threads, which a context variable does not reach: so the record is taken here, once.
    snapshot_download makes two byte bars of the same bytes: "Downloading bytes" (network,
    xet) and "Reconstructing" (written to disk); only the second is counted. Its total grows
    as each file starts (``bar.total`` is set directly), so it is read at each update.
    """
    from tqdm.auto import tqdm

    target = record or current_progress.get()
    bars: list[Any] = []
    lock = threading.Lock()

    class HubProgress(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            kwargs.pop("name", None)  # huggingface_hub's own bars take it; tqdm refuses it
            counts = kwargs.get("unit") == "B" and kwargs.get("desc") != "Downloading bytes"
            super().__init__(*args, **kwargs)
            self.bytes_seen = int(kwargs.get("initial") or 0)
            self.counts = counts  # (not ``self in bars``: tqdm compares bars by position)
            if counts:
                with lock:
                    bars.append(self)
                self._feed()

        def update(self, n: float | None = 1) -> bool | None:
            self.bytes_seen += int(n or 0)
            if self.counts:
                self._feed()
            return None

        def _feed(self) -> None:
            if target is None:
                return
            with lock:
                done = sum(bar.bytes_seen for bar in bars)
                totals = [bar.total for bar in bars]
            total = sum(int(t) for t in totals) if all(totals) else None
            target.bytes_done, target.bytes_total = done, total
            target.updated_at = time.time()

    return HubProgress


class ProgressBoard:
    """The adds running now and those that finished lately, by adapter name."""

    def __init__(self) -> None:
        self._records: dict[str, WaitProgress] = {}

    def get(self, name: str) -> WaitProgress | None:
        return self._records.get(name)

    def all(self) -> list[WaitProgress]:
        self._forget_old()
        return sorted(self._records.values(), key=lambda record: record.started_at)

    @contextmanager
    def track(
        self, name: str, source: str, redact: Callable[[str], str] = str
    ) -> Iterator[WaitProgress]:
        """Make a fresh record current for the block; it ends ``done``, or ``failed`` with why
        (passed through ``redact``: the record is shown to admins, a source's secrets never)."""
        record = WaitProgress(name=name, source=source)
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
