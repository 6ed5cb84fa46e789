"""Live tails of the gateway's own log (kept in memory) and the engine's (its log file).

The gateway logs to stderr, where a service manager collects it; a status page cannot read
that back. So the root logger also feeds a small ring of recent lines (``RecentLogLines``),
which ``gateway_lines`` follows. The engine writes to a file under the cache dir, which
``engine_lines`` follows by polling (it is appended to, and rotated past a size: a file
shorter than the position read so far starts over from its beginning). Both are served
``loggable`` (``loragate.logs``): the engine's lines quote prompts and its command line.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

from loragate.logs import FORMAT, SafeFormatter, loggable

KEEP_LINES = 2000
POLL_SECONDS = 0.3


class RecentLogLines(logging.Handler):
    """A logging handler that keeps the last ``KEEP_LINES`` formatted lines, numbered."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(SafeFormatter(FORMAT))
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=KEEP_LINES)
        self._next = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        for line in text.splitlines() or [""]:
            self._lines.append((self._next, line))  # under the handler's lock: see Handler.handle
            self._next += 1

    def last(self, count: int) -> tuple[int, list[str]]:
        """The last ``count`` lines, and the number of the line after them."""
        lines = list(self._lines)
        chosen = lines[-count:] if count > 0 else []
        return (lines[-1][0] + 1 if lines else self._next), [line for _, line in chosen]

    def after(self, number: int) -> tuple[int, list[str]]:
        """Lines numbered ``number`` and up (those still kept), and the number after them."""
        lines = [(n, line) for n, line in list(self._lines) if n >= number]
        return (lines[-1][0] + 1 if lines else max(number, self._next)), [line for _, line in lines]


_recent: RecentLogLines | None = None


def recent_gateway_log() -> RecentLogLines:
    """The process's one ring of recent lines, attached to the root logger.

    Attached again when missing: ``configure_logging`` replaces the root's handlers, and may
    run after the app was built (an embedding application's own set-up, say).
    """
    global _recent
    if _recent is None:
        _recent = RecentLogLines()
    root = logging.getLogger()
    if _recent not in root.handlers:
        root.addHandler(_recent)
    return _recent


async def gateway_lines(count: int, follow: bool) -> AsyncGenerator[str, None]:
    recent = recent_gateway_log()
    number, lines = recent.last(count)
    for line in lines:
        yield line
    while follow:
        await asyncio.sleep(POLL_SECONDS)
        number, lines = recent.after(number)
        for line in lines:
            yield line


async def engine_lines(path: Path, count: int, follow: bool) -> AsyncGenerator[str, None]:
    # The tail, and the size it ends at, read together: lines written meanwhile come next.
    position, tail = await asyncio.to_thread(_tail, path, count)
    for line in tail:
        yield loggable(line)
    if not follow:
        return
    partial = b""
    while True:
        await asyncio.sleep(POLL_SECONDS)
        size = await asyncio.to_thread(_size, path)
        if size < position:  # rotated or replaced: read the new file from its start
            position, partial = 0, b""
        if size == position:
            continue
        data = await asyncio.to_thread(_read, path, position, size - position)
        position += len(data)
        *complete, partial = (partial + data).split(b"\n")
        for raw in complete:
            yield loggable(raw.decode("utf-8", errors="replace").rstrip("\r"))


def _tail(path: Path, count: int, max_bytes: int = 64 * 1024) -> tuple[int, list[str]]:
    size = _size(path)
    data = _read(path, max(0, size - max_bytes), min(size, max_bytes))
    # Lines end at "\n" only, as when following (``splitlines`` would also cut at the form
    # feeds and Unicode line separators a prompt quoted in the engine's log may hold).
    lines = [line.rstrip("\r") for line in data.decode("utf-8", errors="replace").split("\n")]
    if lines and not lines[-1]:
        lines.pop()
    if size > max_bytes:
        lines = lines[1:]  # begins mid-line
    return size, lines[-count:] if count > 0 else []


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: Path, offset: int, length: int) -> bytes:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read(min(length, 1 << 20))
    except OSError:
        return b""


async def merged(
    sources: dict[str, AsyncIterator[str]], heartbeat: float, max_seconds: float
) -> AsyncIterator[tuple[str, str] | None]:
    """(source, line) pairs from every source as they come; None every ``heartbeat`` seconds
    of quiet (so a stream notices its client left); ends after ``max_seconds`` or when every
    source has ended."""
    queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue(maxsize=1000)

    async def pump(name: str, lines: AsyncIterator[str]) -> None:
        async for line in lines:
            await queue.put((name, line))

    tasks = [asyncio.create_task(pump(name, lines)) for name, lines in sources.items()]
    ends = time.monotonic() + max_seconds
    try:
        while time.monotonic() < ends:
            if all(task.done() for task in tasks) and queue.empty():
                return
            try:
                item = await asyncio.wait_for(queue.get(), heartbeat)
            except TimeoutError:
                item = None
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
