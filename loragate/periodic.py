"""One background pass, run every interval until stopped, that no failure ends (a leaf:
imports nothing of loragate).

Every watcher of the gateway runs on it: the adapters' follow mode and store watch, the fleet
manifest's reconciler, a catalog's ttl pass. A hand-written ``while True`` loop ends at its
first exception, silently, and leaves the exception for whoever awaits the task at shutdown;
this one logs the pass that failed, with its traceback, and runs the next on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


class PeriodicTask:
    """``step`` run every ``interval`` seconds in one named asyncio task, until stopped.

    A pass that raises is logged with its traceback on ``log`` and the next pass runs on time:
    a watcher that ended at its first surprise (a full disk, a bug in one entry) would stop
    watching with nobody told. ``first_at_once``: the first pass runs at ``start`` rather than
    an interval later (the fleet converges at once; what was just loaded needs no check yet).
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], Awaitable[object]],
        interval: float,
        *,
        first_at_once: bool = False,
        log: logging.Logger | None = None,
    ) -> None:
        self.name = name
        self.interval = interval
        self._step = step
        self._first_at_once = first_at_once
        self._log = log or logging.getLogger("loragate")
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop (on the running event loop); a second call changes nothing."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self.name)

    def stop(self) -> None:
        """Cancel the loop now, without waiting for it to end (from synchronous code)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel the loop and wait until it has ended (a pass in flight is cancelled too).
        Never raises: what a pass raised was logged when it happened."""
        task = self._task
        self.stop()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def run_once(self) -> None:
        """One pass, as the loop runs it: whatever it raises is logged, not raised."""
        try:
            await self._step()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception(
                "%s: a pass failed (the next one runs in %gs)", self.name, self.interval
            )

    async def _loop(self) -> None:
        if not self._first_at_once:
            await asyncio.sleep(self.interval)
        while True:
            await self.run_once()
            await asyncio.sleep(self.interval)
